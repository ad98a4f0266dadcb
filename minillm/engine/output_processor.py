"""From the core's token ids to what a user sees: text, streaming deltas, stop strings, finish reasons.

Each step's :class:`~minillm.engine.EngineCoreOutput` s are detokenized incrementally; a stop *string* (only the
text reveals it) finishes its request, whose id comes back in ``reqs_to_abort`` for the core to free. While a request
runs, the last ``len(longest stop string) - 1`` characters are held back, since they may begin a stop string and
streamed text cannot be taken back: so every ``delta_text`` joined is the final ``text``.

vLLM counterpart: ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``, ``RequestState``) and
``vllm/v1/engine/detokenizer.py`` (``get_next_output_text`` with its ``stop_buffer_length``).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minillm.core.sched.output import EngineCoreOutput
from minillm.engine.detokenizer import IncrementalDetokenizer
from minillm.engine.outputs import CompletionOutput, RequestOutput
from minillm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class RequestState:
    """What the output processor remembers about one unfinished request.

    Attributes:
        text: the text released so far (the concatenation of every ``delta_text`` sent).
        stop_buffer_length: characters held back while running (longest stop string minus one; 0 when the stop
            string is kept in the output, since nothing is ever cut then before the match's end).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_cached_tokens: int = 0
    stop_buffer_length: int = 0
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None

    @classmethod
    def new(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            tokenizer: PreTrainedTokenizerBase | None) -> RequestState:
        detok = IncrementalDetokenizer(tokenizer, params) if tokenizer is not None else None
        stops = params.stop or []
        buffer = 0 if (params.include_stop_str_in_output or not stops) else max(len(s) for s in stops) - 1
        wants_logprobs = params.logprobs is not None
        return cls(request_id, prompt, list(prompt_token_ids), params, detok, stop_buffer_length=buffer,
                   cumulative_logprob=0.0 if wants_logprobs else None, logprobs=[] if wants_logprobs else None)


class OutputProcessor:
    """Keeps a :class:`RequestState` per unfinished request and builds the step's :class:`RequestOutput` s.

    Args:
        tokenizer: a Hugging Face tokenizer, or ``None`` (then ``text`` stays empty and stop strings are refused).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine has none")
        self.request_states[request_id] = RequestState.new(request_id, prompt, prompt_token_ids, params,
                                                           self.tokenizer)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget these requests; return the ids that were known."""
        return [rid for rid in request_ids if self.request_states.pop(rid, None) is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def process_outputs(self, engine_core_outputs: Iterable[EngineCoreOutput],
                        logprobs: dict[str, list[dict[int, float]]] | None = None
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Turn one step's :class:`EngineCoreOutput` s into :class:`RequestOutput` s.

        Args:
            engine_core_outputs: the scheduler's per-request results of this step.
            logprobs: request id -> per new token ``{token_id: logprob}`` (sampled token first), if asked for.

        Returns:
            ``(request_outputs, reqs_to_abort)``: one output per request that changed, and the ids of requests
            that a stop string finished (the scheduler still holds them; the engine must free them).
        """
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        for eco in engine_core_outputs:
            state = self.request_states.get(eco.request_id)
            if state is None:
                continue  # aborted by the user while the model ran
            new_ids = list(eco.new_token_ids)
            state.num_cached_tokens = eco.num_cached_tokens
            finish_reason, stop_reason = eco.finish_reason, eco.stop_reason
            state.token_ids.extend(new_ids)
            if (logprobs is not None and state.logprobs is not None and state.cumulative_logprob is not None
                    and eco.request_id in logprobs):
                for token_id, entry in zip(new_ids, logprobs[eco.request_id], strict=False):
                    state.logprobs.append(entry)
                    state.cumulative_logprob += entry[token_id]
            full_text = ""
            if state.detokenizer is not None:
                # A FINISHED_STOPPED from check_stop (EOS or a stop id) leaves that last token's text out.
                stop_str = state.detokenizer.update(new_ids, stop_terminated=(finish_reason == "stop"))
                if stop_str is not None:
                    if finish_reason is None:
                        reqs_to_abort.append(eco.request_id)
                    finish_reason, stop_reason = "stop", stop_str
                full_text = state.detokenizer.output_text
            finished = finish_reason is not None
            release = len(full_text) if finished else len(full_text) - state.stop_buffer_length
            delta_text = full_text[len(state.text):release] if release > len(state.text) else ""
            state.text += delta_text
            completion = CompletionOutput(
                index=0, text=state.text, token_ids=list(state.token_ids), finish_reason=finish_reason,
                stop_reason=stop_reason, delta_text=delta_text, delta_token_ids=new_ids,
                cumulative_logprob=state.cumulative_logprob,
                logprobs=list(state.logprobs) if state.logprobs is not None else None)
            request_outputs.append(RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion],
                                                 finished, state.num_cached_tokens))
            if finished:
                del self.request_states[eco.request_id]
        return request_outputs, reqs_to_abort
