"""The engine's front end: requests in, outputs out, and the engine core (scheduler + model) behind a client.

One :meth:`LLMEngine.step`::

    engine_core.get_output()          -> EngineCoreOutputs    the core's next step (EngineCore.step):
        scheduler.schedule()              -> SchedulerOutput      which requests run, how many tokens each
        executor.execute_model(...)       -> ModelRunnerOutput    flat batch -> model -> logits -> sample
        scheduler.update_from_output(...) -> EngineCoreOutputs    append tokens, check_stop, free finished blocks
    output_processor.process_outputs  -> RequestOutputs       detokenize, stop strings, streaming deltas

Continuous batching falls out of it: requests join (``add_request``) and leave (finish, ``abort_request``) between
any two steps, and every step runs whatever mix of prefill chunks and decodes the scheduler chose, in one pass.

The front end keeps what needs the tokenizer: checking and tokenizing requests (:meth:`LLMEngine.process_inputs`,
vLLM's ``InputProcessor``) and detokenizing outputs (:class:`~minillm.engine.output_processor.OutputProcessor`). The
engine core (:mod:`minillm.engine.core`) is reached through a client (:mod:`minillm.engine.core_client`):

* ``LLMEngine(model, tokenizer, args)`` builds the core in this process (``InprocClient``): ``engine.scheduler``,
  ``engine.model_runner`` and ``engine.last_scheduler_output`` are there to look at, and on a CPU each ``step()``
  runs one synchronous step. The notebooks and the capstone use it.
* ``LLMEngine.from_engine_args(args)`` (what ``LLM`` calls) starts the core in a process of its own
  (``SyncMPClient``, ``MINILLM_ENABLE_V1_MULTIPROCESSING=1``, the default); ``step()`` then collects the outputs of
  steps the core runs on its own, while this process detokenizes.

Either way async scheduling follows vLLM v0.33.0's platform rule (``EngineArgs.async_scheduling``): off on a CPU
unless asked for, on for a model on a GPU unless something incompatible is configured.

vLLM counterpart: ``vllm/v1/engine/llm_engine.py`` (``LLMEngine.__init__`` with its ``multiprocess_mode``
argument, ``LLMEngine.from_engine_args``, ``LLMEngine.step``, which calls the client's ``get_output``, the output
processor's ``process_outputs`` and the client's ``abort_requests`` for the requests a stop string ended), with the
input checks of ``vllm/v1/engine/input_processor.py`` (``InputProcessor.process_inputs``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from minillm.config import LlamaConfig
from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.sched.scheduler import Scheduler
from minillm.engine import EngineCoreOutputs, EngineCoreRequest, EngineStats
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.core import EngineCore
from minillm.engine.core_client import AsyncMPClient, EngineCoreClient, InprocClient
from minillm.engine.output_processor import OutputProcessor
from minillm.engine.outputs import RequestOutput
from minillm.engine.parts import EngineParts
from minillm.executor.abstract import Executor
from minillm.model.llama import LlamaForCausalLM
from minillm.request import RequestStatus
from minillm.sampling_params import SamplingParams
from minillm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int]


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages name the bad value without quoting a huge one."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class LLMEngine:
    """Continuous batching over a paged KV cache on one model: the front end, and a client to the engine core.

    Args:
        model: a loaded :class:`~minillm.model.llama.LlamaForCausalLM`; ``None`` only with ``multiprocess_mode``
            (the core then loads ``engine_args.model`` itself).
        tokenizer: its Hugging Face tokenizer, or ``None`` (then prompts must be token ids and ``text`` is empty).
        engine_args: the configuration (:class:`~minillm.engine.arg_utils.EngineArgs`); ``model``, ``dtype`` and
            ``device`` in it are ignored when ``model`` is given (see :meth:`from_engine_args`).
        parts: the engine's replaceable parts (:class:`~minillm.engine.parts.EngineParts`): attention, the KV cache
            manager's functions, the scheduler class, top-k/top-p, the stop check and ``prepare_inputs``. Default:
            the package's own. Chapter 8 passes a learner's answers here (in-process only).
        multiprocess_mode: run the engine core in its own process (``SyncMPClient``); default ``False``: in this
            process (``InprocClient``), as vLLM's ``LLMEngine.__init__`` defaults too.
        asyncio_mode: with ``multiprocess_mode``, an :class:`~minillm.engine.core_client.AsyncMPClient` (for
            :class:`~minillm.engine.async_llm.AsyncLLM`, which then awaits the outputs; ``step()`` is not used).

    Raises:
        ValueError: a bad argument, or a KV cache too small to hold one request of ``max_model_len`` tokens.
        RuntimeError: the engine-core process failed to start (its error is in the message).
    """

    def __init__(self, model: LlamaForCausalLM | None, tokenizer: Any = None, engine_args: EngineArgs | None = None,
                 parts: EngineParts | None = None, multiprocess_mode: bool = False,
                 asyncio_mode: bool = False) -> None:
        args = engine_args if engine_args is not None else EngineArgs()
        if not isinstance(args, EngineArgs):
            raise ValueError(f"engine_args must be an EngineArgs, got {type(args).__name__}")
        if parts is not None and not isinstance(parts, EngineParts):
            raise ValueError(f"parts must be an EngineParts, got {type(parts).__name__}")
        if model is None and not multiprocess_mode:
            raise ValueError("give a loaded model, or multiprocess_mode=True to have the engine core load "
                             "engine_args.model (LLMEngine.from_engine_args does)")
        if model is not None and not isinstance(model, LlamaForCausalLM):
            raise ValueError(f"model must be a LlamaForCausalLM (or None), got {type(model).__name__}")
        if multiprocess_mode and parts is not None and parts.replaced():
            raise ValueError(f"replaced engine parts ({parts.replaced()}) run in-process only: "
                             f"multiprocess_mode=False")
        self.engine_args = args
        self.tokenizer = tokenizer
        self.multiprocess_mode = multiprocess_mode
        # vLLM v0.33.0 decides by platform, not by process: on for a model on a GPU, off on a CPU (unless asked).
        device = model.device.type if model is not None else args.resolved_device()
        self.async_scheduling = args.resolved_async_scheduling(device)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self._core: EngineCore | None = None
        if asyncio_mode and not multiprocess_mode:
            raise ValueError("asyncio_mode needs multiprocess_mode=True (the engine core in its own process)")
        if multiprocess_mode:
            if model is not None:
                model = model.eval()
            self.engine_core: EngineCoreClient = EngineCoreClient.make_client(
                multiprocess_mode=True, asyncio_mode=asyncio_mode, engine_args=args, model=model, eos_token_id=eos,
                async_scheduling=self.async_scheduling)
            ready = self.engine_core.ready
            self.model_config = LlamaConfig(**ready["model_config"])
            self.num_gpu_blocks: int = ready["num_gpu_blocks"]
            self.attention_backend: str = ready["attention_backend"]
        else:
            self._core = EngineCore(model.eval(), args, parts, eos_token_id=eos,
                                    async_scheduling=self.async_scheduling)
            self.engine_core = InprocClient(self._core)
            self.model_config = model.config
            self.num_gpu_blocks = self._core.num_gpu_blocks
            self.attention_backend = self._core.attention_backend
        self.scheduler_config = args.create_scheduler_config(self.model_config)
        self.max_model_len = self.scheduler_config.max_model_len
        self.eos_token_id: int | None = eos if eos is not None else self.model_config.eos_token_id
        self.output_processor = OutputProcessor(tokenizer)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess_mode: bool | None = None,
                         asyncio_mode: bool = False) -> "LLMEngine":
        """The engine that ``engine_args`` describe, model and tokenizer loaded.

        Args:
            multiprocess_mode: ``None``: ``MINILLM_ENABLE_V1_MULTIPROCESSING`` (default on). In its own process
                the core loads the model; this process loads only the tokenizer.
        """
        import minillm
        from minillm.engine.core_client import multiprocessing_enabled
        from minillm.loaders.load import load_model_tokenizer
        from minillm.tokenizer import load_tokenizer

        if multiprocess_mode is None:
            multiprocess_mode = multiprocessing_enabled()
        if multiprocess_mode:
            tokenizer = (load_tokenizer(engine_args.tokenizer) if engine_args.tokenizer is not None
                         else load_model_tokenizer(engine_args.model))
            return cls(None, tokenizer, engine_args, multiprocess_mode=True, asyncio_mode=asyncio_mode)
        model, tokenizer = minillm.load_model(engine_args.model, dtype=engine_args.resolved_dtype(),
                                              device=engine_args.resolved_device())
        if engine_args.tokenizer is not None:
            tokenizer = load_tokenizer(engine_args.tokenizer)
        if asyncio_mode:
            raise ValueError("asyncio_mode needs the engine core in its own process "
                             "(MINILLM_ENABLE_V1_MULTIPROCESSING=1)")
        return cls(model, tokenizer, engine_args)

    # -- the engine core, when it lives in this process -------------------------------------------------------------
    def _inproc(self, what: str) -> EngineCore:
        if self._core is None:
            raise AttributeError(f"LLMEngine.{what} lives in the engine-core process (pid "
                                 f"{self.engine_core.ready['pid']}); build the engine in this process to look inside: "
                                 f"LLMEngine(model, tokenizer, args), or MINILLM_ENABLE_V1_MULTIPROCESSING=0")
        return self._core

    @property
    def scheduler(self) -> Scheduler:
        return self._inproc("scheduler").scheduler

    @property
    def model_runner(self) -> ModelRunner:
        core = self._inproc("model_runner")
        if core.model_runner is None:
            raise AttributeError(f"with tensor_parallel_size={core.tensor_parallel_size} each rank's model runner "
                                 f"lives in its worker process; engine.model_executor.worker_info describes them")
        return core.model_runner

    @property
    def model_executor(self) -> Executor:
        """The executor that runs each step: one worker in this process, or one process per tensor-parallel rank."""
        return self._inproc("model_executor").model_executor

    @property
    def model(self) -> LlamaForCausalLM:
        return self.model_runner.model

    @property
    def parts(self) -> EngineParts:
        return self._inproc("parts").parts

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager

    @property
    def last_scheduler_output(self) -> Any:
        """The latest step's plan (for inspection and teaching)."""
        return self._inproc("last_scheduler_output").last_scheduler_output

    @property
    def kv_connector_scheduler(self) -> Any:
        return self._inproc("kv_connector_scheduler").kv_connector_scheduler

    @property
    def kv_connector_worker(self) -> Any:
        return self._inproc("kv_connector_worker").kv_connector_worker

    @property
    def stats(self) -> EngineStats:
        """The core's counters: the live object in-process, the latest step's snapshot from another process."""
        if self._core is not None:
            return self._core.stats
        return self.engine_core.stats.engine

    @property
    def block_size(self) -> int:
        return self.engine_args.block_size

    def get_num_free_blocks(self) -> int:
        """Blocks free for allocation (cached-but-unused ones included). All of them when nothing runs:
        ``num_gpu_blocks - 1`` (the null block is never handed out)."""
        return self.engine_core.call_utility("get_num_free_blocks")

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
        room = self.max_model_len - prompt_len
        if params.max_tokens is None or params.max_tokens > room:
            # "until the context is full"; a larger max_tokens would stop there too ("length"), and must not
            # travel as an int msgpack cannot hold (the engine core may be in another process).
            changes["max_tokens"] = room
            changes["min_tokens"] = min(params.min_tokens, room)
        if params.top_k >= vocab:
            changes["top_k"] = 0  # "keep every token", as a k at least the vocabulary does
        return params.clone(**changes)

    def _in_use(self, request_id: str) -> bool:
        if request_id in self.output_processor.request_states:
            return True
        return self._core is not None and request_id in self._core.scheduler.requests

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                       priority: int = 0, arrival_time: float | None = None
                       ) -> tuple[EngineCoreRequest, str | None]:
        """Check and tokenize one request without touching the engine's state; :meth:`add_request` queues it.

        Separate so that a caller adding a batch (:meth:`~minillm.entrypoints.llm.LLM.generate`) can check every
        request before adding any: a bad element then leaves nothing behind.

        Returns:
            ``(request, prompt_text)``: the :class:`~minillm.engine.EngineCoreRequest` to send to the core and the
            prompt's text (``None`` when it was given as token ids).

        Raises:
            ValueError: everything :meth:`add_request` lists.

        vLLM counterpart: ``InputProcessor.process_inputs`` in ``vllm/v1/engine/input_processor.py`` (older releases:
        ``Processor`` in ``processor.py``).
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {short_repr(request_id)}")
        if self._in_use(request_id):
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
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))):
            raise ValueError(f"arrival_time must be a number of seconds, got {short_repr(arrival_time)}")
        request = EngineCoreRequest(request_id, prompt_ids, params, self.eos_token_id,
                                    time.time() if arrival_time is None else float(arrival_time), priority)
        return request, prompt_text

    def add_request(self, request_id: str, prompt: PromptType | EngineCoreRequest,
                    params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, prompt_text: str | None = None) -> None:
        """Queue a request; it runs from the next :meth:`step` on.

        Args:
            request_id: a unique, non-empty string (unique among unfinished requests).
            prompt: text (tokenized with the engine's tokenizer), a list of token ids, or a dict with
                ``"prompt"`` or ``"prompt_token_ids"`` (vLLM's ``TextPrompt`` / ``TokensPrompt``); or an
                :class:`~minillm.engine.EngineCoreRequest` that :meth:`process_inputs` returned (then
                ``params``, ``priority`` and ``arrival_time`` are already in it, and ``prompt_text`` goes with it).
            params: how to sample and when to stop (default ``SamplingParams()``); ``max_tokens=None`` means
                "until ``max_model_len``".
            priority: lower runs first under ``scheduling_policy="priority"``.

        Raises:
            ValueError: an empty prompt, a prompt that leaves no room for one output token within
                ``max_model_len``, token ids outside the vocabulary (or not a list of ints), invalid sampling
                parameters, or a request id that is not a non-empty string or is already in use.
            TypeError: a processed request whose id is not a string (vLLM v0.33.0's message).
        """
        if isinstance(prompt, EngineCoreRequest):
            request = prompt
            if not isinstance(request.request_id, str):  # it could not cross to an engine-core process as one
                raise TypeError(f"request_id must be a string, got {type(request.request_id)}")
            if request.request_id != request_id:
                raise ValueError(f"the processed request is {request.request_id!r}, not {request_id!r}")
            if self._in_use(request_id):
                raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        else:
            request, prompt_text = self.process_inputs(request_id, prompt, params, priority, arrival_time)
        self.output_processor.add_request(request_id, prompt_text, request.prompt_token_ids, request.sampling_params)
        try:
            self.engine_core.add_request(request)
        except BaseException:
            self.output_processor.abort_requests([request_id])
            raise

    def shutdown(self) -> None:
        """Stop the engine core: its process, or (in-process) the executor's thread and a KV connector's
        transfers (chapter 9). The engine cannot be used afterwards when its core had its own process."""
        self.engine_core.shutdown()

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their KV blocks. Unknown or finished ids are ignored. No output is sent for
        them (the caller already knows)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.output_processor.abort_requests(ids)
        self.engine_core.abort_requests(ids)

    # -- the loop ---------------------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        if self._core is not None:
            return self._core.scheduler.has_unfinished_requests()
        return self.output_processor.has_unfinished_requests()

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones whose K/V a connector is still sending (chapter 9): keep stepping
        until this is ``False`` to have every block back."""
        if self._core is not None:
            return self._core.has_requests()
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        if self._core is not None:
            return self._core.scheduler.get_num_unfinished_requests()
        return self.output_processor.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Take the engine core's next step's outputs and turn them into :class:`RequestOutput` s: one per request
        that got new tokens or finished (a request mid-prefill gets none). In-process this runs the step; with the
        core in its own process it waits for the step the core is running anyway."""
        if not self.has_requests():
            return []
        if not hasattr(self.engine_core, "get_output") or isinstance(self.engine_core, AsyncMPClient):
            raise RuntimeError("this engine's core client is asyncio's: AsyncLLM awaits its outputs, step() cannot")
        return self._process_engine_outputs(self.engine_core.get_output())

    def _process_engine_outputs(self, outputs: EngineCoreOutputs) -> list[RequestOutput]:
        logprobs = {o.request_id: o.new_logprobs for o in outputs.outputs if o.new_logprobs is not None}
        request_outputs, reqs_to_abort = self.output_processor.process_outputs(outputs.outputs, logprobs or None)
        if reqs_to_abort:  # stop strings: the core still holds these requests and their blocks
            self.engine_core.abort_requests(reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        return request_outputs
