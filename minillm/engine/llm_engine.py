"""The engine: requests in, a step loop, outputs out. Where the scheduler, the model runner and the sampler meet.

One :meth:`LLMEngine.step`::

    scheduler.schedule()              -> SchedulerOutput      which requests run, how many tokens each
    model_runner.execute_model(...)   -> ModelRunnerOutput    flat batch -> model -> logits at logits_indices -> sample
                                                              (a row per request; mid-prefill rows discarded)
    scheduler.update_from_output(...) -> EngineCoreOutputs    append tokens, check_stop, free finished blocks
    output_processor.process_outputs  -> RequestOutputs       detokenize, stop strings, streaming deltas

Continuous batching falls out of it: requests join (``add_request``) and leave (finish, ``abort_request``) between
any two steps, and every step runs whatever mix of prefill chunks and decodes the scheduler chose, in one pass.

vLLM counterpart: ``vllm/v1/engine/llm_engine.py`` (``LLMEngine``) driving ``vllm/v1/engine/core.py``
(``EngineCore.step``), with the input checks of ``vllm/v1/engine/input_processor.py`` (``InputProcessor``; older
releases called it ``Processor``, in ``processor.py``). Here the step is one synchronous loop in the caller's
process. vLLM v0.33.0 runs it differently by default, in two ways:

* the engine core (scheduler, executor, model) runs in a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``,
  ``vllm/envs.py``; ``SyncMPClient`` in ``vllm/v1/engine/core_client.py``), so vLLM's ``LLMEngine.step`` only collects
  that process's outputs, detokenizes them and aborts the requests a stop string ended, while the model runs on;
* async scheduling is on unless something incompatible is configured (``vllm/config/vllm.py``:
  ``VllmConfig.__post_init__``): ``EngineCore.step_with_batch_queue`` has ``AsyncScheduler`` schedule step N+1 while
  step N runs.

The loop here is ``EngineCore.step``, what vLLM runs with ``async_scheduling=False``, called in the caller's
process as ``InprocClient`` does (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minillm.config import LlamaConfig
from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.sched.scheduler import Scheduler
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.output_processor import OutputProcessor
from minillm.engine.parts import EngineParts
from minillm.engine.outputs import RequestOutput
from minillm.model.llama import LlamaForCausalLM
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams
from minillm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int]


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages name the bad value without quoting a huge one."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class EngineStats:
    """Counters since the engine was created (for tests, benchmarks and the notebook).

    Attributes:
        num_steps: steps that ran the model.
        num_scheduled_tokens: tokens computed (prefill chunks + decodes), summed over steps.
        num_generated_tokens: tokens appended to requests.
        num_preemptions: requests preempted (by recompute).
        num_cached_prompt_tokens: prompt tokens served from the prefix cache at admission.
        num_draft_tokens / num_accepted_tokens: speculative decoding's drafts verified, and those the model kept.
        num_external_prompt_tokens: prompt tokens a KV connector loaded from another engine at admission
            (chapter 9), counted as computed like prefix-cache hits.
    """

    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_external_prompt_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of the verified drafts that were kept (``nan`` before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")


class LLMEngine:
    """Continuous batching over a paged KV cache on one model.

    Args:
        model: a loaded :class:`~minillm.model.llama.LlamaForCausalLM`.
        tokenizer: its Hugging Face tokenizer, or ``None`` (then prompts must be token ids and ``text`` is empty).
        engine_args: the configuration (:class:`~minillm.engine.arg_utils.EngineArgs`); ``model``, ``dtype`` and
            ``device`` in it are ignored here since the model is already loaded (see :meth:`from_engine_args`).
        parts: the engine's replaceable parts (:class:`~minillm.engine.parts.EngineParts`): attention, the KV cache
            manager's functions, the scheduler class, top-k/top-p, the stop check and ``prepare_inputs``. Default:
            the package's own. Chapter 8 passes a learner's answers here.

    Raises:
        ValueError: a bad argument, or a KV cache too small to hold one request of ``max_model_len`` tokens.
    """

    def __init__(self, model: LlamaForCausalLM, tokenizer: Any = None, engine_args: EngineArgs | None = None,
                 parts: EngineParts | None = None) -> None:
        args = engine_args if engine_args is not None else EngineArgs()
        if not isinstance(args, EngineArgs):
            raise ValueError(f"engine_args must be an EngineArgs, got {type(args).__name__}")
        if parts is not None and not isinstance(parts, EngineParts):
            raise ValueError(f"parts must be an EngineParts, got {type(parts).__name__}")
        self.parts = parts if parts is not None else EngineParts()
        self.engine_args = args
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_config: LlamaConfig = model.config
        self.scheduler_config = args.create_scheduler_config(model.config)
        self.max_model_len = self.scheduler_config.max_model_len
        self.num_gpu_blocks = args.resolved_num_gpu_blocks(model.config, self.max_model_len, model.dtype)
        # Without an explicit choice, the backend follows where the model is (a CPU model on a machine that also has
        # a GPU must not get the GPU's Triton kernels).
        self.attention_backend = (args.attention_backend if args.attention_backend is not None
                                  else "triton" if model.device.type == "cuda" else "torch")
        if self.attention_backend == "triton":
            import kernels  # noqa: F401  (switches on Triton's interpreter without a GPU before any kernel exists)
        self.scheduler: Scheduler = self.parts.scheduler_cls(self.scheduler_config, self.num_gpu_blocks,
                                                             args.block_size, args.enable_prefix_caching, self.parts)
        # Chapter 9: a KV connector has two halves, one for the scheduler and one for the model runner.
        self.kv_connector_scheduler = self.kv_connector_worker = None
        if args.kv_transfer_config is not None:
            from minillm.distributed.kv_transfer import KVConnectorFactory, KVConnectorRole

            make = KVConnectorFactory.create_connector
            self.kv_connector_scheduler = make(args.kv_transfer_config, KVConnectorRole.SCHEDULER, model.config,
                                               args.block_size)
            self.kv_connector_worker = make(args.kv_transfer_config, KVConnectorRole.WORKER, model.config,
                                            args.block_size)
            self.scheduler.set_kv_connector(self.kv_connector_scheduler)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_token_id: int | None = eos if eos is not None else model.config.eos_token_id
        self.model_runner = ModelRunner(model, self.num_gpu_blocks, args.block_size, self.attention_backend,
                                        eos_token_id=self.eos_token_id,
                                        speculative_config=args.speculative_config, parts=self.parts,
                                        kv_connector=self.kv_connector_worker)
        self.output_processor = OutputProcessor(tokenizer)
        self.stats = EngineStats()
        self.last_scheduler_output: Any = None  # the latest step's plan (for inspection and teaching)
        torch.manual_seed(args.seed)  # the global generator unseeded random sampling draws from

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        """Load the model (and tokenizer) that ``engine_args`` name, then build the engine."""
        import minillm
        from minillm.tokenizer import load_tokenizer

        model, tokenizer = minillm.load_model(engine_args.model, dtype=engine_args.resolved_dtype(),
                                              device=engine_args.resolved_device())
        if engine_args.tokenizer is not None:
            tokenizer = load_tokenizer(engine_args.tokenizer)
        return cls(model, tokenizer, engine_args)

    # -- properties the callers use ---------------------------------------------------------------------------------
    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager

    @property
    def block_size(self) -> int:
        return self.engine_args.block_size

    def get_num_free_blocks(self) -> int:
        """Blocks free for allocation (cached-but-unused ones included). All of them when nothing runs:
        ``num_gpu_blocks - 1`` (the null block is never handed out)."""
        return self.kv_cache_manager.num_free_blocks

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # -- requests in ------------------------------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give the prompt as a list of token ids")
            if prompt == "":
                raise ValueError("the prompt is empty; give at least one token")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, (list, tuple)) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 1):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__} "
                         f"{short_repr(prompt)}")

    def _check_token_ids(self, ids: Any) -> list[int]:
        given = ids
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist() if ids.dim() == 1 else None
        elif isinstance(ids, (list, tuple)):
            ids = list(ids)
        else:  # None, an int, a string, a dict...: list() of them raises TypeError or gives characters
            ids = None
        if ids is None:
            raise ValueError(f"prompt_token_ids must be a list of token ids, got {short_repr(given)}")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be integers in [0, {vocab}) (the vocabulary), got "
                             f"{short_repr(bad[:5])}")
        return ids

    def _check_params(self, params: Any, prompt_len: int) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            try:
                params = SamplingParams(**params)
            except TypeError as e:
                raise ValueError(f"invalid sampling parameters: {e}") from None
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams (or a dict of its fields), got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        bad = [t for t in (params.stop_token_ids or []) if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad}")
        if self.engine_args.speculative_config is not None and params.logprobs is not None:
            raise ValueError(f"logprobs={params.logprobs} is not supported with speculative decoding in minillm; "
                             f"leave logprobs=None or create the engine without speculative_config")
        # A validated private copy: the caller may reuse (or mutate) its object for other requests.
        changes = {}
        if params.max_tokens is None:
            changes["max_tokens"] = self.max_model_len - prompt_len  # "until the context is full"
        return params.clone(**changes)

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                       priority: int = 0, arrival_time: float | None = None) -> tuple[Request, str | None]:
        """Check and tokenize one request without touching the engine's state; :meth:`add_request` queues it.

        Separate so that a caller adding a batch (:meth:`~minillm.entrypoints.llm.LLM.generate`) can check every
        request before adding any: a bad element then leaves nothing behind.

        Returns:
            ``(request, prompt_text)``: the :class:`~minillm.request.Request` to queue and the prompt's text
            (``None`` when it was given as token ids).

        Raises:
            ValueError: everything :meth:`add_request` lists.

        vLLM counterpart: ``InputProcessor.process_inputs`` in ``vllm/v1/engine/input_processor.py`` (older releases:
        ``Processor`` in ``processor.py``).
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {short_repr(request_id)}")
        if request_id in self.output_processor.request_states or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {short_repr(priority)}")
        prompt_text, prompt_ids = self._tokenize(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, which leaves no room for an output token "
                             f"within max_model_len ({self.max_model_len}); shorten the prompt or raise "
                             f"max_model_len")
        params = self._check_params(params, len(prompt_ids))
        request = Request(request_id, prompt_ids, params, eos_token_id=self.eos_token_id, arrival_time=arrival_time,
                          priority=priority)
        return request, prompt_text

    def add_request(self, request_id: str, prompt: PromptType | Request, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, prompt_text: str | None = None) -> None:
        """Queue a request; it runs from the next :meth:`step` on.

        Args:
            request_id: a unique, non-empty string (unique among unfinished requests).
            prompt: text (tokenized with the engine's tokenizer), a list of token ids, or a dict with
                ``"prompt"`` or ``"prompt_token_ids"`` (vLLM's ``TextPrompt`` / ``TokensPrompt``); or a
                :class:`~minillm.request.Request` that :meth:`process_inputs` returned for ``request_id`` (then
                ``params``, ``priority`` and ``arrival_time`` are already in it, and ``prompt_text`` goes with it).
            params: how to sample and when to stop (default ``SamplingParams()``); ``max_tokens=None`` means
                "until ``max_model_len``".
            priority: lower runs first under ``scheduling_policy="priority"``.

        Raises:
            ValueError: an empty prompt, a prompt that leaves no room for one output token within
                ``max_model_len``, token ids outside the vocabulary (or not a list of ints), invalid sampling
                parameters, or a request id that is not a non-empty string or is already in use.
        """
        if isinstance(prompt, Request):
            request = prompt
            if request.request_id != request_id:
                raise ValueError(f"the processed request is {request.request_id!r}, not {request_id!r}")
            if request_id in self.output_processor.request_states or request_id in self.scheduler.requests:
                raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        else:
            request, prompt_text = self.process_inputs(request_id, prompt, params, priority, arrival_time)
        self.output_processor.add_request(request_id, prompt_text, request.prompt_token_ids, request.sampling_params)
        try:
            self.scheduler.add_request(request)
        except BaseException:
            self.output_processor.abort_requests([request_id])
            raise

    def shutdown(self) -> None:
        """Let a KV connector finish what it sends or waits for (chapter 9); a no-op without one."""
        for connector in (self.kv_connector_worker, self.kv_connector_scheduler):
            if connector is not None:
                connector.shutdown()

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their KV blocks. Unknown or finished ids are ignored. No output is sent for
        them (the caller already knows)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.output_processor.abort_requests(ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self.model_runner.remove_requests(ids)

    # -- the loop ---------------------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones whose K/V a connector is still sending (chapter 9): keep stepping
        until this is ``False`` to have every block back."""
        return self.scheduler.has_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, update. Returns one :class:`RequestOutput` per request that got
        new tokens or finished in this step (a request mid-prefill gets none)."""
        if not self.scheduler.has_requests():
            return []
        scheduler_output = None
        try:
            scheduler_output = self.scheduler.schedule()
            return self._run_scheduled_step(scheduler_output)
        except BaseException:
            # Ctrl-C (KeyboardInterrupt) or an error part-way through a step leaves the scheduler, the runner and
            # the KV cache out of step with each other; drop the requests the step touched, so the engine stays
            # usable.
            try:
                self._abandon_step(scheduler_output)
            except Exception:  # noqa: BLE001 - never hide the original error behind one from the clean-up
                logger.exception("cleaning up after a failed step failed too")
            raise

    def _abandon_step(self, scheduler_output: Any) -> None:
        """Abort the requests a failed step scheduled (all of them when :meth:`Scheduler.schedule` itself failed),
        and take the blocks that step was to fill out of the prefix cache: they were hashed when allocated, but
        their K/V may never have been written, and a later prompt with the same prefix must not reuse them."""
        pool = self.kv_cache_manager.block_pool
        if scheduler_output is None:  # failed inside schedule(): any request may be half-scheduled, trust no block
            scheduled = list(self.scheduler.requests)
            for rid in scheduled:
                pool.evict_cached_blocks(self.kv_cache_manager.get_blocks(rid))
        else:
            scheduled = list(scheduler_output.num_scheduled_tokens)
            for rid, num_new in scheduler_output.num_scheduled_tokens.items():
                request = self.scheduler.requests.get(rid)
                if request is not None:  # blocks before the step's first token held K/V computed earlier
                    first_unsure = max(request.num_computed_tokens - num_new, 0) // self.block_size
                    pool.evict_cached_blocks(self.kv_cache_manager.get_blocks(rid)[first_unsure:])
        self.abort_request(scheduled)

    def _run_scheduled_step(self, scheduler_output: Any) -> list[RequestOutput]:
        waiting_on_transfers = self.scheduler.num_waiting_for_remote_kvs or self.scheduler.pending_kv_sends
        if scheduler_output.total_num_scheduled_tokens == 0 and not self.scheduler.running and not waiting_on_transfers:
            # Nothing runs and the first waiting request cannot be admitted: no later step can change that.
            raise RuntimeError(f"the engine cannot make progress: {self.get_num_unfinished_requests()} request(s) "
                               f"wait but none fits the KV cache ({self.get_num_free_blocks()} free blocks)")
        self.last_scheduler_output = scheduler_output
        for new in scheduler_output.scheduled_new_reqs:
            state = self.output_processor.request_states.get(new.req_id)
            if state is not None:
                state.num_cached_tokens = new.num_computed_tokens
                self.stats.num_cached_prompt_tokens += new.num_computed_tokens - new.num_external_computed_tokens
                self.stats.num_external_prompt_tokens += new.num_external_computed_tokens
        runner_output = self.model_runner.execute_model(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, reqs_to_abort = self.output_processor.process_outputs(core_outputs, runner_output.logprobs)
        if reqs_to_abort:  # stop strings: the scheduler still holds these requests and their blocks
            self.scheduler.finish_requests(reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        finished = [o.request_id for o in outputs if o.finished]
        self.model_runner.remove_requests(finished)
        self.scheduler.update_draft_token_ids(runner_output)  # after the stops above: finished ones get none

        if scheduler_output.total_num_scheduled_tokens:
            self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        self.stats.num_generated_tokens += sum(len(o.new_token_ids) for o in core_outputs)
        self.stats.num_preemptions += len(scheduler_output.preempted_req_ids)
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            if rid in runner_output.req_id_to_index:
                self.stats.num_draft_tokens += len(drafts)
                kept = len(runner_output.sampled_token_ids[runner_output.req_id_to_index[rid]]) - 1
                self.stats.num_accepted_tokens += max(kept, 0)
        return outputs
