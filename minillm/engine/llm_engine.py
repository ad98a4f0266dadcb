"""The synchronous front end: requests in (checked, tokenized), one :meth:`LLMEngine.step` at a time, outputs out.

``step()`` takes the engine core's next ``EngineCoreOutputs`` from its client (``get_output()``), detokenizes them
(:class:`~minillm.engine.output_processor.OutputProcessor`) and aborts in the core the requests a stop string ended.
The core sits behind an :class:`~minillm.engine.core_client.EngineCoreClient`: ``LLMEngine(model, tokenizer, args)``
builds it here (``InprocClient``: ``engine.scheduler``, ``engine.model_runner`` can be looked at, each ``step()``
runs one step); ``LLMEngine.from_engine_args(args)`` (what ``LLM`` calls) in its own process (``SyncMPClient``,
``MINILLM_ENABLE_V1_MULTIPROCESSING=1``, the default). Requests join and leave between any two steps: continuous
batching.

vLLM counterpart: ``vllm/v1/engine/llm_engine.py`` (``LLMEngine.__init__`` with ``multiprocess_mode``,
``from_engine_args``, ``step``); the checks are ``vllm/v1/engine/input_processor.py``'s.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from minillm.config import LlamaConfig
from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.sched.output import SchedulerOutput
from minillm.core.sched.scheduler import Scheduler
from minillm.distributed.kv_transfer.base import KVConnectorBase_V1
from minillm.engine import EngineCoreOutputs, EngineCoreRequest, EngineStats
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.core import EngineCore
from minillm.engine.core_client import EngineCoreClient
from minillm.engine.input_processor import InputProcessor, PromptType, short_repr
from minillm.engine.output_processor import OutputProcessor
from minillm.engine.outputs import RequestOutput
from minillm.engine.parts import EngineParts
from minillm.executor.abstract import Executor
from minillm.model.llama import LlamaForCausalLM
from minillm.model.llama_tp import TensorParallelLlamaForCausalLM
from minillm.request import RequestStatus
from minillm.sampling_params import SamplingParams
from minillm.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["LLMEngine", "PromptType", "short_repr"]


class LLMEngine:
    """Continuous batching over a paged KV cache on one model: the front end, and a client to the engine core.

    Args:
        model: a loaded :class:`~minillm.model.llama.LlamaForCausalLM`, or ``None``: the engine core's worker(s)
            load ``engine_args.model`` (each tensor-parallel rank only its shard).
        tokenizer: its Hugging Face tokenizer, or ``None`` (then prompts must be token ids and ``text`` is empty).
        engine_args: the configuration (:class:`~minillm.engine.arg_utils.EngineArgs`); ``model``, ``dtype`` and
            ``device`` in it are ignored when ``model`` is given (see :meth:`from_engine_args`).
        parts: the engine's replaceable parts (:class:`~minillm.engine.parts.EngineParts`): attention, the KV cache
            manager's functions, the scheduler class, top-k/top-p, the stop check and ``prepare_inputs``. Default:
            the package's own. Chapter 8 passes a learner's answers here (in-process only).
        multiprocess_mode: run the engine core in its own process (``SyncMPClient``); default ``False``: in this
            process (``InprocClient``), as vLLM's ``LLMEngine.__init__`` defaults too.

    Raises:
        ValueError: a bad argument, or a KV cache too small to hold one request of ``max_model_len`` tokens.
        RuntimeError: the engine-core process failed to start (its error is in the message).
    """

    def __init__(self, model: LlamaForCausalLM | None, tokenizer: PreTrainedTokenizerBase | None = None,
                 engine_args: EngineArgs | None = None,
                 parts: EngineParts | None = None, multiprocess_mode: bool = False) -> None:
        args = engine_args if engine_args is not None else EngineArgs()
        if not isinstance(args, EngineArgs):
            raise ValueError(f"engine_args must be an EngineArgs, got {type(args).__name__}")
        if parts is not None and not isinstance(parts, EngineParts):
            raise ValueError(f"parts must be an EngineParts, got {type(parts).__name__}")
        if model is not None and not isinstance(model, LlamaForCausalLM):
            raise ValueError(f"model must be a LlamaForCausalLM (or None), got {type(model).__name__}")
        if multiprocess_mode and parts is not None and parts.replaced():
            raise ValueError(f"replaced engine parts ({parts.replaced()}) run in-process only: "
                             f"multiprocess_mode=False")
        self.engine_args = args
        self.tokenizer = tokenizer
        self.multiprocess_mode = multiprocess_mode
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.engine_core = EngineCoreClient.make_client(multiprocess_mode, asyncio_mode=False, engine_args=args,
                                                        model=model, parts=parts, eos_token_id=eos)
        ready = self.engine_core.ready
        self.model_config: LlamaConfig = ready["model_config"]
        self.num_gpu_blocks = ready["num_gpu_blocks"]
        self.attention_backend = ready["attention_backend"]
        # vLLM v0.33.0 decides by platform, not by process: on for a model on a GPU, off on a CPU (unless asked).
        self.async_scheduling = ready["async_scheduling"]
        self.scheduler_config = args.create_scheduler_config(self.model_config)
        self.max_model_len = self.scheduler_config.max_model_len
        self.eos_token_id: int | None = eos if eos is not None else self.model_config.eos_token_id
        self.input_processor = InputProcessor(tokenizer, self.model_config, self.max_model_len, self.eos_token_id,
                                              speculative=args.create_speculative_config() is not None)
        self.output_processor = OutputProcessor(tokenizer)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess_mode: bool | None = None) -> LLMEngine:
        """The engine that ``engine_args`` describe, model and tokenizer loaded.

        Args:
            multiprocess_mode: ``None``: ``MINILLM_ENABLE_V1_MULTIPROCESSING`` (default on). Either way the engine
                core's worker(s) load the model; this process loads only the tokenizer (and, in-process, the
                worker's weights).
        """
        from minillm.engine.core_client import multiprocessing_enabled

        if multiprocess_mode is None:
            multiprocess_mode = multiprocessing_enabled()
        model = None  # the engine core's worker(s) load it, in its process or in this one
        return cls(model, engine_args.load_tokenizer(), engine_args, multiprocess_mode=multiprocess_mode)

    # -- the engine core, when it lives in this process -------------------------------------------------------------
    def _inproc(self, what: str) -> EngineCore:
        core = self.engine_core.local_engine_core()
        if core is None:
            raise AttributeError(f"LLMEngine.{what} lives in the engine-core process (pid "
                                 f"{self.engine_core.ready['pid']}); build the engine in this process to look inside: "
                                 f"LLMEngine(model, tokenizer, args), or MINILLM_ENABLE_V1_MULTIPROCESSING=0")
        return core

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
    def model(self) -> LlamaForCausalLM | TensorParallelLlamaForCausalLM:
        return self.model_runner.model

    @property
    def parts(self) -> EngineParts:
        return self._inproc("parts").parts

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager

    @property
    def last_scheduler_output(self) -> SchedulerOutput | None:
        """The latest step's plan (for inspection and teaching)."""
        return self._inproc("last_scheduler_output").last_scheduler_output

    @property
    def kv_connector_scheduler(self) -> KVConnectorBase_V1 | None:
        return self._inproc("kv_connector_scheduler").kv_connector_scheduler

    @property
    def kv_connector_worker(self) -> KVConnectorBase_V1 | None:
        return self._inproc("kv_connector_worker").kv_connector_worker

    @property
    def stats(self) -> EngineStats:
        """The core's counters: the live object in-process, the latest step's snapshot from another process."""
        return self.engine_core.engine_stats

    @property
    def block_size(self) -> int:
        return self.engine_args.block_size

    def get_num_free_blocks(self) -> int:
        """Blocks free for allocation (cached-but-unused ones included). All of them when nothing runs:
        ``num_gpu_blocks - 1`` (the null block is never handed out)."""
        num_free: int = self.engine_core.call_utility("get_num_free_blocks")
        return num_free

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.tokenizer

    # -- requests in ------------------------------------------------------------------------------------------------
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
        """
        request, prompt_text = self.input_processor.process_inputs(request_id, prompt, params, priority,
                                                                   arrival_time)
        self._check_unused(request_id)
        return request, prompt_text

    def _check_unused(self, request_id: str) -> None:
        if request_id in self.output_processor.request_states:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")

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
            self._check_unused(request_id)
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
        return self.output_processor.has_unfinished_requests()

    def has_requests(self) -> bool:
        """Unfinished requests, or (in-process) anything the core still steps for: finished requests whose K/V a
        connector is still sending (chapter 9), steps in flight. Keep stepping until this is ``False`` to have
        every block back."""
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Take the engine core's next step's outputs and turn them into :class:`RequestOutput` s: one per request
        that got new tokens or finished (a request mid-prefill gets none). In-process this runs the step; with the
        core in its own process it waits for the step the core is running anyway."""
        if not self.has_requests():
            return []
        return self._process_engine_outputs(self.engine_core.get_output())

    def _process_engine_outputs(self, outputs: EngineCoreOutputs) -> list[RequestOutput]:
        logprobs = {o.request_id: o.new_logprobs for o in outputs.outputs if o.new_logprobs is not None}
        request_outputs, reqs_to_abort = self.output_processor.process_outputs(outputs.outputs, logprobs or None)
        if reqs_to_abort:  # stop strings: the core still holds these requests and their blocks
            self.engine_core.abort_requests(reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        return request_outputs
