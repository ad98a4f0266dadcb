"""What the engine hands back to its user after each step: one :class:`RequestOutput` per request that changed.

``text`` and ``token_ids`` are cumulative (everything generated so far), as in vLLM's default
``RequestOutputKind.CUMULATIVE``; ``delta_text`` and ``delta_token_ids`` hold only what is new since the previous
output of the same request, which is what a streaming client sends on (vLLM's ``RequestOutputKind.DELTA``). Joining
every ``delta_text`` of a request gives exactly its final ``text``.

vLLM counterpart: ``vllm/outputs.py`` (``RequestOutput``, ``CompletionOutput``).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated answer of a request (``n = 1`` here, so ``index`` is always 0).

    Attributes:
        index: which of the request's answers this is.
        text: the generated text so far (stop strings cut off, special tokens skipped).
        token_ids: the generated token ids so far (an EOS or stop token id that ended the request is included).
        finish_reason: ``None`` while running; then ``"stop"`` (EOS, a stop token id or a stop string), ``"length"``
            (``max_tokens`` or ``max_model_len``) or ``"abort"``.
        stop_reason: the stop string or stop token id that ended it (``None`` for EOS or a length cap).
        delta_text: the part of ``text`` that is new in this output.
        delta_token_ids: the part of ``token_ids`` that is new in this output.
        cumulative_logprob: sum of the sampled tokens' log-probabilities when ``logprobs`` was asked, else ``None``.
        logprobs: per generated token, ``{token_id: logprob}`` of the sampled token and the top ones, or ``None``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step.

    Attributes:
        request_id: the id given to ``add_request``.
        prompt: the prompt text (``None`` when the prompt was given as token ids).
        prompt_token_ids: the prompt's token ids.
        outputs: the answers (one here).
        finished: the request is done; no more outputs will come for it.
        num_cached_tokens: prompt tokens whose K/V came from the prefix cache at admission (a hit skips them).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0

    def __repr__(self) -> str:
        out = self.outputs[0] if self.outputs else None
        text = out.text if out else ""
        short = text if len(text) <= 60 else text[:57] + "..."
        return (f"RequestOutput(request_id={self.request_id!r}, prompt_tokens={len(self.prompt_token_ids)}, "
                f"output_tokens={len(out.token_ids) if out else 0}, text={short!r}, finished={self.finished}, "
                f"finish_reason={out.finish_reason if out else None!r})")
