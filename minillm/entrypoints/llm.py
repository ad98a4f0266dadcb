"""``LLM``: offline batch inference in three lines, with vLLM's signature::

    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outputs = llm.generate(["Hello, my name is", "The capital of France is"], SamplingParams(temperature=0))
    print(outputs[0].outputs[0].text)

``generate`` adds every prompt to an :class:`~minillm.engine.llm_engine.LLMEngine` and steps it until all are
finished; ``generate_stream`` (not in vLLM's ``LLM``) yields the text as it grows.

vLLM counterpart: ``vllm/entrypoints/llm.py`` (``LLM.generate``, ``LLM.chat``), whose ``_run_engine`` comes from
``vllm/entrypoints/common/offline.py:OfflineInferenceMixin._run_engine``.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch

from minillm.engine.arg_utils import EngineArgs
from minillm.engine.core_client import multiprocessing_enabled
from minillm.engine.llm_engine import LLMEngine, PromptType, short_repr
from minillm.engine.outputs import RequestOutput
from minillm.model.llama import LlamaForCausalLM
from minillm.sampling_params import SamplingParams
from minillm.tokenizer import chat_prompt_ids

Messages = list[dict[str, str]]


class LLM:
    """An engine plus the convenience of running a whole batch of prompts to completion.

    Args:
        model: a ``.gguf`` file or a Hugging Face directory (``None``: the bundled SmolLM2), or an already loaded
            :class:`~minillm.model.llama.LlamaForCausalLM` (then pass ``tokenizer`` as an object too).
        tokenizer: a tokenizer path, or a tokenizer object when ``model`` is a loaded model.
        **engine_args: any field of :class:`~minillm.engine.arg_utils.EngineArgs` (``block_size``,
            ``num_gpu_blocks``, ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``,
            ``enable_chunked_prefill``, ``enable_prefix_caching``, ``attention_backend``, ...). ``dtype`` defaults
            to fp32 on a CPU, the lessons' dtype, exact against transformers' fp32 model; ``dtype="auto"`` asks for
            the machine's (bf16 with AMX-BF16 or AVX512-BF16), which ``python -m minillm serve`` and ``bench`` use.
            ``async_scheduling`` follows vLLM v0.33.0's platform rule: off on a CPU (``True`` asks for it), on
            for a GPU unless n-gram drafts are configured.

    The engine core runs in a process of its own (``MINILLM_ENABLE_V1_MULTIPROCESSING=1``, the default, as vLLM's
    ``VLLM_ENABLE_V1_MULTIPROCESSING``): its worker loads the model there, or each tensor-parallel rank its own
    shard in its process (a model given as an object is sent once, its tensors in shared memory, or with several
    ranks written once as a temporary checkpoint they read from), and this process keeps the tokenizer.
    ``MINILLM_ENABLE_V1_MULTIPROCESSING=0`` keeps it in this process, where ``llm.llm_engine.scheduler`` can be
    looked at. ``llm.shutdown()`` stops the core process; so does deleting ``llm``, or the interpreter exiting.
    """

    def __init__(self, model: str | LlamaForCausalLM | None = None, tokenizer: Any = None, **engine_args: Any) -> None:
        multiprocess = multiprocessing_enabled()
        if isinstance(model, LlamaForCausalLM):
            self.llm_engine = LLMEngine(model, tokenizer, EngineArgs.from_kwargs(**engine_args),
                                        multiprocess_mode=multiprocess)
        else:
            self.llm_engine = LLMEngine.from_engine_args(
                EngineArgs.from_kwargs(model=None if model is None else str(model), tokenizer=tokenizer,
                                       **engine_args), multiprocess_mode=multiprocess)
        self.request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine core (its process, when it has one). The ``LLM`` cannot generate afterwards."""
        self.llm_engine.shutdown()

    # -- adding requests --------------------------------------------------------------------------------------------
    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, torch.Tensor) and prompts.dim() == 1:
            return [prompts]  # one prompt given as a tensor of token ids
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a dict, a list of token ids or a list of those, got "
                             f"{type(prompts).__name__} {short_repr(prompts)}")
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _add_requests(self, prompts: list[PromptType],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                      priority: Sequence[int] | None = None) -> list[str]:
        """Check every request of the batch, then add them all: a bad element (of any kind) or an interrupt
        leaves nothing of the batch in the engine."""
        if not prompts:
            raise ValueError("no prompts given")
        if sampling_params is None or isinstance(sampling_params, (SamplingParams, dict)):
            params_list = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts; give one, or "
                                 f"one per prompt")
        else:
            raise ValueError(f"sampling_params must be a SamplingParams, a dict of its fields, or a list of them, "
                             f"got {type(sampling_params).__name__}")
        if priority is None:
            priorities: list[Any] = [0] * len(prompts)
        elif isinstance(priority, Sequence) and not isinstance(priority, str) and len(priority) == len(prompts):
            priorities = list(priority)
        else:
            raise ValueError(f"priority must be a list of one integer per prompt ({len(prompts)}), got "
                             f"{short_repr(priority)}")
        # Phase 1, nothing added yet: tokenize and check every request (vLLM's Processor.process_inputs).
        processed = []
        for i, (prompt, params, prio) in enumerate(zip(prompts, params_list, priorities, strict=True)):
            rid = str(next(self.request_counter))
            try:
                processed.append(self.llm_engine.process_inputs(rid, prompt, params, priority=prio))
            except ValueError as e:
                raise ValueError(f"prompt {i} of {len(prompts)}: {e}" if len(prompts) > 1 else str(e)) from None
        # Phase 2: add them all; if anything still goes wrong (even Ctrl-C), take back what was added.
        ids: list[str] = []
        try:
            for request, prompt_text in processed:
                self.llm_engine.add_request(request.request_id, request, prompt_text=prompt_text)
                ids.append(request.request_id)
        except BaseException:
            self.llm_engine.abort_request(ids)
            raise
        return ids

    # -- running ----------------------------------------------------------------------------------------------------
    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            # has_requests, not has_unfinished_requests: with a KV connector (chapter 9) a finished request may still
            # be sending its K/V, and its blocks come back only in a later step.
            while self.llm_engine.has_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        out_tokens += len(out.outputs[0].token_ids)
                        if pbar is not None:
                            pbar.update(1)
                            pbar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            # Ctrl-C in a notebook cell (KeyboardInterrupt) or an error: take this batch's unfinished requests out
            # of the engine (the step itself already dropped what it had half done), so the next generate() starts
            # clean instead of running these orphans.
            self.llm_engine.abort_request([rid for rid in request_ids if rid not in finished])
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [finished[rid] for rid in request_ids]

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate a completion for every prompt; returns their :class:`RequestOutput` s in prompt order.

        Args:
            prompts: one prompt or a list; each is a string, a list of token ids, or a dict with ``"prompt"`` or
                ``"prompt_token_ids"``.
            sampling_params: one for all prompts, or one per prompt (default ``SamplingParams()``).
            use_tqdm: show a progress bar over finished requests.
            priority: one per prompt, for ``scheduling_policy="priority"``.
        """
        ids = self._add_requests(self._as_prompt_list(prompts), sampling_params, priority)
        return self._run_engine(ids, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` dicts) or a list of conversations, with the
        model's chat template."""
        conversations = ([cast(Messages, messages)] if messages and isinstance(messages[0], dict)
                         else list(cast(Sequence[Messages], messages)))
        if not conversations or any(not c for c in conversations):
            raise ValueError("chat needs at least one non-empty conversation")
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        prompts = [{"prompt_token_ids": chat_prompt_ids(tok, list(c))} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate_stream(self, prompts: PromptType | Sequence[PromptType],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield every :class:`RequestOutput` as the engine produces it (``outputs[0].delta_text`` is the new text),
        until all of these prompts are finished."""
        ids = set(self._add_requests(self._as_prompt_list(prompts), sampling_params))
        try:
            while ids:
                for out in self.llm_engine.step():
                    if out.request_id in ids:
                        if out.finished:
                            ids.discard(out.request_id)
                        yield out
        finally:
            if ids:  # the caller stopped iterating early: free what is left
                self.llm_engine.abort_request(list(ids))
