"""The engine core: the scheduler and the executor, stepping. In this process, or in a process of its own.

:class:`EngineCore` takes checked, tokenized requests and gives, per step, the new token ids of each request;
tokenizing, detokenizing and stop strings stay with the front end. :meth:`EngineCore.step` schedules, executes and
updates in turn; :meth:`EngineCore.step_with_batch_queue` (async scheduling) plans step N+1 and hands it to the
executor before it waits for step N. :class:`EngineCoreProc` is the same core in its own process: a busy loop on the
main thread, an input and an output thread for the two ZeroMQ sockets, a handshake first, Ctrl-C ignored (the client
handles it), and an exit when its parent dies or a step fails (the client hears ``EngineDeadError``). At start-up the
core reads only the model's config: its executor's worker(s) load the weights (each tensor-parallel rank its own
shard), report their KV cache spec and bytes, and allocate the smallest count over the ranks
(``EngineCore._initialize_kv_caches``).

vLLM counterpart: ``vllm/v1/engine/core.py`` (``EngineCore.__init__``, ``_initialize_kv_caches``,
``EngineCore.step``, ``step_with_batch_queue``, ``EngineCoreProc``:
``run_busy_loop``, ``process_input_sockets``, ``process_output_sockets``); vLLM adds data and pipeline parallelism,
structured output, KV events and sleep mode.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import msgspec
import torch

from minillm.core.kv_cache_utils import get_kv_cache_configs
from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from minillm.core.sched.scheduler import Scheduler
from minillm.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineDeadError,
    EngineStats,
    SchedulerStats,
    UtilityOutput,
)
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.parts import EngineParts
from minillm.executor.abstract import Executor
from minillm.executor.multiproc_executor import MultiprocExecutor
from minillm.executor.uniproc_executor import UniProcExecutor, mark_model_thread
from minillm.loaders.sharded_loader import TemporaryCheckpoint
from minillm.model.llama import LlamaForCausalLM
from minillm.model.llama_tp import check_tensor_parallel_config
from minillm.request import Request, RequestStatus
from minillm.serial_utils import MsgpackDecoder, MsgpackEncoder
from minillm.system_utils import watch_parent
from minillm.worker.model_runner import ModelRunner, ModelRunnerArgs
from minillm.worker.worker import Worker

if TYPE_CHECKING:
    import multiprocessing.connection

    import zmq

logger = logging.getLogger(__name__)

# Frames the core sends first, before the payload (the client's output thread dispatches on them).
READY, FAILED, OUTPUTS, DEAD = b"R", b"F", b"O", b"D"
# What a client's ABORT and UTILITY messages carry: (request ids, status) and (call id, method, arguments).
AbortPayload = tuple[list[str], int]
UtilityPayload = tuple[int, str, list[Any]]
ClientPayload = EngineCoreRequest | AbortPayload | UtilityPayload


class EngineCore:
    """The scheduler and the executor of one engine, stepping over requests.

    Start-up follows vLLM's: the executor builds the worker(s) from ``(Worker, kwargs)`` and each loads its model
    (rank ``r`` of several: only its shard, read from the checkpoint); then :meth:`_initialize_kv_caches` asks every
    worker for its KV cache spec and the bytes it can give, takes the smallest count of blocks and has every worker
    allocate that many; the scheduler is built last, for that many blocks.

    Args:
        model: a model already loaded in this process (the tests' random tiny models, a notebook's), or ``None``:
            the worker(s) load ``engine_args.model`` and this process reads only its config. A model object is handed
            to a worker in this process as it is; to worker processes with ``tensor_parallel_size > 1`` it goes as a
            temporary checkpoint (:class:`~minillm.loaders.sharded_loader.TemporaryCheckpoint`), written once,
            each rank reading its shard, removed once the ranks have loaded.
        engine_args: the configuration (``dtype`` and ``device`` are ignored when ``model`` is given).
        parts: the engine's replaceable parts (chapter 8), default the package's own.
        eos_token_id: the tokenizer's EOS id, what ``min_tokens`` blocks (default: the model config's).
        async_scheduling: step with the batch queue and the :class:`AsyncScheduler` (or ``parts.scheduler_cls``
            when it counts output placeholders itself).
        model_thread: a one-thread ``ThreadPoolExecutor`` on which the worker in this process is built, loads the
            model and runs every step (see :class:`~minillm.executor.uniproc_executor.UniProcExecutor`); ``None``:
            the caller's thread.

    Attributes:
        available_kv_cache_memory: the bytes each worker reported it can give its KV cache, by rank.
        num_gpu_blocks: the blocks every worker allocated (the smallest rank's count, or ``num_gpu_blocks``).

    Raises:
        ValueError: a bad argument, a worker whose budget holds fewer than 2 blocks, a KV cache too small for one
            request of ``max_model_len`` tokens, or async scheduling with a replaced scheduler class that does not
            count output placeholders (neither a subclass of ``AsyncScheduler`` nor overriding
            ``_update_after_schedule``).
    """

    def __init__(self, model: LlamaForCausalLM | None, engine_args: EngineArgs, parts: EngineParts | None = None,
                 eos_token_id: int | None = None, async_scheduling: bool = False,
                 model_thread: ThreadPoolExecutor | None = None) -> None:
        args = engine_args
        self.parts = parts if parts is not None else EngineParts()
        self.engine_args = args
        # The core needs the model's config and dtype, not its weights: from the model object, else from the config.
        if model is not None:
            self.model_config = model.config
            dtype, device = model.dtype, str(model.device)
        else:
            self.model_config = args.create_model_config()
            dtype, device = args.resolved_dtype(), args.resolved_device()
        config = self.model_config
        self.dtype = str(dtype).removeprefix("torch.")
        self.scheduler_config = args.create_scheduler_config(config)
        self.max_model_len = self.scheduler_config.max_model_len
        # Without an explicit choice, the backend follows where the model is (a CPU model on a machine that also has
        # a GPU must not get the GPU's Triton kernels).
        self.attention_backend = (args.attention_backend if args.attention_backend is not None
                                  else "triton" if device.startswith("cuda") else "torch")
        if self.attention_backend == "triton":
            import kernels  # noqa: F401  (switches on Triton's interpreter without a GPU before any kernel exists)
        scheduler_cls = self.parts.scheduler_cls
        if async_scheduling:
            from minillm.core.sched.async_scheduler import AsyncScheduler

            # The package's scheduler becomes AsyncScheduler. A replaced class is used as given (as vLLM's
            # SchedulerConfig.get_scheduler_cls does) when it counts the output placeholders of the steps in flight;
            # one that does not (chapter 4's) would plan each step without the tokens still in flight: refused.
            if scheduler_cls is Scheduler:
                scheduler_cls = AsyncScheduler
            elif not (issubclass(scheduler_cls, AsyncScheduler)
                      or scheduler_cls._update_after_schedule is not Scheduler._update_after_schedule):
                raise ValueError(f"async scheduling needs a scheduler that counts output placeholders (a subclass "
                                 f"of AsyncScheduler, or one that overrides _update_after_schedule as exercise 10.2's "
                                 f"does); a replaced scheduler ({scheduler_cls.__name__}) needs "
                                 f"async_scheduling=False")
        self.tensor_parallel_size = args.tensor_parallel_size
        uniproc = args.resolved_distributed_executor_backend() == "uni"
        if not uniproc:
            # vLLM's rule, before any process starts: the heads must split over the ranks.
            check_tensor_parallel_config(config, self.tensor_parallel_size)
            if self.parts.replaced():
                raise ValueError(f"replaced engine parts ({self.parts.replaced()}) run in this process only: "
                                 f"tensor_parallel_size=1 and distributed_executor_backend='uni' (the ranks live in "
                                 f"other processes)")
        # Chapter 9: a KV connector has two halves, one for the scheduler and one for the model runner.
        self.kv_connector_scheduler = self.kv_connector_worker = None
        kv_transfer_config = args.create_kv_transfer_config()
        if kv_transfer_config is not None:
            from minillm.distributed.kv_transfer import KVConnectorFactory, KVConnectorRole

            make = KVConnectorFactory.create_connector
            self.kv_connector_scheduler = make(kv_transfer_config, KVConnectorRole.SCHEDULER, config,
                                               args.block_size)
            self.kv_connector_worker = make(kv_transfer_config, KVConnectorRole.WORKER, config, args.block_size)
        self.eos_token_id = eos_token_id if eos_token_id is not None else config.eos_token_id
        runner_kwargs = ModelRunnerArgs(block_size=args.block_size, attention_backend=self.attention_backend,
                                        eos_token_id=self.eos_token_id,
                                        speculative_config=args.create_speculative_config(),
                                        kv_connector=self.kv_connector_worker,
                                        max_num_reqs=self.scheduler_config.max_num_seqs,
                                        max_model_len=self.max_model_len, **self.parts.model_runner_fns())
        worker_kwargs: dict[str, Any] = dict(dtype=dtype, device=device,
                                             kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                             kv_cache_memory_fraction=args.kv_cache_memory_fraction, **runner_kwargs)
        self.model_executor: Executor
        self.model_runner: ModelRunner | None = None
        if uniproc:
            self.model_executor = UniProcExecutor(Worker, dict(model=model if model is not None else args.model,
                                                               **worker_kwargs), model_thread)
        else:
            # Nothing of another rank's shard passes through here: the ranks get a path and read their own slices. A
            # model object is written once as a temporary checkpoint for them (one rank alone gets the object).
            checkpoint = None
            source: LlamaForCausalLM | str | None = args.model
            if model is not None and self.tensor_parallel_size > 1:
                checkpoint = TemporaryCheckpoint(model)
                source = checkpoint.path
            elif model is not None:
                source = model
            # Each rank keeps its own copy of the connector's worker side: the one built here is only what they
            # start from.
            self.kv_connector_worker = None
            try:
                self.model_executor = MultiprocExecutor(self.tensor_parallel_size, Worker,
                                                        dict(model=source, **worker_kwargs), seed=args.seed,
                                                        error_cls=EngineDeadError)
            finally:
                if checkpoint is not None:
                    checkpoint.cleanup()  # every rank has read its shard (or failed): the files are not needed
        try:
            self.available_kv_cache_memory: list[int] = []
            self.num_gpu_blocks = self._initialize_kv_caches()
            if isinstance(self.model_executor, UniProcExecutor):
                self.model_runner = self.model_executor.driver_worker.model_runner
            # The parts are handed down as plain functions: the core and the worker never import the engine.
            self.scheduler: Scheduler = scheduler_cls(self.scheduler_config, self.num_gpu_blocks, args.block_size,
                                                      args.enable_prefix_caching, **self.parts.scheduler_fns())
        except BaseException:
            self.model_executor.shutdown()
            raise
        if self.kv_connector_scheduler is not None:
            self.scheduler.set_kv_connector(self.kv_connector_scheduler)
        self.async_scheduling = async_scheduling
        # vLLM: VllmConfig.max_concurrent_batches, 2 with async scheduling (one step running, the next planned).
        self.batch_queue_size = 2 if async_scheduling else 1
        self.batch_queue: deque[tuple[Future, SchedulerOutput, Future]] | None = deque() if async_scheduling else None
        self.step_fn = self.step_with_batch_queue if async_scheduling else self.step
        self.stats = EngineStats()
        self.last_scheduler_output: SchedulerOutput | None = None  # the latest step's plan (for teaching)
        # (what, start, end) in time.monotonic() seconds, "schedule" and "update" here, "execute" from the
        # executor: recorded only between start_timeline() and take_timeline() (chapter 10's figure, bench/).
        self.timeline: list[tuple[str, float, float]] | None = None
        torch.manual_seed(args.seed)  # the global generator unseeded random sampling draws from

    def _initialize_kv_caches(self) -> int:
        """Size the KV cache from the workers' reports and have every worker allocate it; the blocks per worker.

        Every worker answers ``get_kv_cache_spec`` (its bytes per block: its own KV heads under tensor parallelism)
        and ``determine_available_memory`` (the bytes it can give); :func:`~minillm.core.kv_cache_utils.
        get_kv_cache_configs` takes the smallest count (or ``num_gpu_blocks``), ``initialize_from_config`` allocates
        it on every worker. vLLM v0.33.0: ``vllm/v1/engine/core.py:EngineCore._initialize_kv_caches``.
        """
        executor = self.model_executor
        specs = executor.get_kv_cache_specs()
        self.available_kv_cache_memory = executor.determine_available_memory()
        configs = get_kv_cache_configs(specs, self.available_kv_cache_memory, self.engine_args.num_gpu_blocks)
        executor.initialize_from_config(configs)
        executor.compile_or_warm_up_model()
        return configs[0].num_blocks

    # -- requests in and out ------------------------------------------------------------------------------------
    @staticmethod
    def preprocess_add_request(request: EngineCoreRequest) -> Request:
        """The scheduler's :class:`~minillm.request.Request` for a request that came from the client."""
        return Request(request.request_id, request.prompt_token_ids, request.sampling_params,
                       eos_token_id=request.eos_token_id, arrival_time=request.arrival_time,
                       priority=request.priority)

    def add_request(self, request: Request | EngineCoreRequest) -> None:
        """Queue a request; it runs from the next step on.

        Raises:
            TypeError: its ``request_id`` is not a string (vLLM v0.33.0's check and message,
                ``vllm/v1/engine/core.py:EngineCore.add_request``); nothing is queued.
            ValueError: the scheduler refuses it (an id in use, no room for an output within ``max_model_len``).
        """
        if not isinstance(request.request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request.request_id)}")
        if isinstance(request, EngineCoreRequest):
            request = self.preprocess_add_request(request)
        self.stats.num_requests += 1
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish these requests now (unknown or finished ids are ignored) and free their blocks. Their ids reach the
        runner with the next plan's ``finished_req_ids`` (vLLM v0.33.0:
        ``vllm/v1/engine/core.py:EngineCore.abort_requests``); with no step in flight it also drops them at once, so
        an engine nobody steps again holds no state of theirs. A step in flight for them still runs; its output for
        them is dropped."""
        self.scheduler.finish_requests(request_ids, status)
        if not self.batch_queue and request_ids:  # no step in flight reads the runner's states (always when sync)
            try:
                self.model_executor.collective_rpc("remove_requests", (request_ids,))
            except EngineDeadError:
                pass  # the ranks are gone, and their states with them; the next step says so

    def has_requests(self) -> bool:
        """Work to step for: unfinished requests, finished ones whose K/V is still being sent, or steps in flight.

        Finished requests alone are not: with no step in flight the runner has dropped them already
        (:meth:`abort_requests`, :meth:`_update_from_output`), so a loop that steps while this is ``True`` leaves no
        state behind. Their ids go with the next plan, or with an empty one if :meth:`step` is called. vLLM v0.33.0's
        busy loop (``vllm/v1/engine/core.py:EngineCoreProc._process_input_queue``) steps while
        ``Scheduler.has_requests()``, which counts them.
        """
        return self._can_plan() or bool(self.batch_queue)

    def _can_plan(self) -> bool:
        """Unfinished requests, or finished ones whose K/V is still being sent: a plan has something to schedule."""
        return self.scheduler.has_unfinished_requests() or bool(self.scheduler.pending_kv_sends)

    # -- stepping -----------------------------------------------------------------------------------------------
    def step(self) -> tuple[EngineCoreOutputs | None, bool]:
        """Schedule, execute, update: one synchronous step (vLLM v0.33.0: ``vllm/v1/engine/core.py:EngineCore.step``).

        With only finished requests left (``Scheduler.has_finished_requests``), the plan schedules no token and
        carries their ids, so the runner drops their states: no model step is counted, no output comes back.

        Returns:
            ``(outputs, model_executed)``: ``None`` when there was nothing to do.
        """
        if not self.scheduler.has_requests():
            return None, False
        scheduler_output = None
        try:
            if self._can_plan():
                scheduler_output = self._schedule()
            else:  # the empty plan: _schedule() would take it for a request that can never run
                start = time.monotonic()
                scheduler_output = self.last_scheduler_output = self.scheduler.schedule()
                if self.timeline is not None:
                    self.timeline.append(("schedule", start, time.monotonic()))
            model_output = self.model_executor.execute_model(scheduler_output)
            if model_output is None:
                # Between the forward pass and sampling, vLLM's core computes the grammar bitmask of the step's
                # structured-output requests (scheduler.get_grammar_bitmask); this engine has none yet: None.
                model_output = self.model_executor.sample_tokens(None)
            return (self._update_from_output(scheduler_output, model_output),
                    scheduler_output.total_num_scheduled_tokens > 0)
        except BaseException:
            self._abandon(scheduler_output)
            raise

    def step_with_batch_queue(self) -> tuple[EngineCoreOutputs | None, bool]:
        """One turn of async scheduling: plan and launch a step if the queue has room, else (or when nothing more
        can be planned) wait for the oldest step in flight and update from its output; with nothing in flight and
        only finished requests left, :meth:`step`'s empty plan (vLLM v0.33.0:
        ``vllm/v1/engine/core.py:EngineCore.step_with_batch_queue``).

        Returns:
            ``(outputs, model_executed)``: ``outputs`` is ``None`` on a turn that only launched a step.
        """
        assert self.batch_queue is not None
        batch_queue = self.batch_queue
        can_plan = self._can_plan()
        if not can_plan and not batch_queue:
            return self.step()  # nothing in flight, at most finished ids to send: the synchronous step does it
        model_executed = False
        try:
            if can_plan:
                scheduler_output = self._schedule()
                exec_future = self.model_executor.execute_model(scheduler_output, non_block=True)
                model_executed = scheduler_output.total_num_scheduled_tokens > 0
                # A step with tokens is sampled right after its forward pass, in the same queue of calls (vLLM
                # computes the grammar bitmask first); an empty step's output comes from execute_model itself.
                future = (self.model_executor.sample_tokens(None, non_block=True) if model_executed
                          else exec_future)
                batch_queue.appendleft((future, scheduler_output, exec_future))
                if len(batch_queue) < self.batch_queue_size and model_executed:
                    return None, model_executed  # do not wait on step N while step N+1 can still be planned
            future, scheduler_output, exec_future = batch_queue.pop()
            exec_future.result()  # a forward pass that failed raises here, with its own error
            model_output = future.result()
            if model_output is None:
                raise RuntimeError("a step without tokens to sample returned no output")
            return self._update_from_output(scheduler_output, model_output), model_executed
        except BaseException:
            self._abandon(None)
            raise

    def _schedule(self) -> SchedulerOutput:
        start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        self._before_execute(scheduler_output)
        if self.timeline is not None:
            self.timeline.append(("schedule", start, time.monotonic()))
        return scheduler_output

    def _before_execute(self, scheduler_output: SchedulerOutput) -> None:
        sched = self.scheduler
        waiting_on_transfers = sched.num_waiting_for_remote_kvs or sched.pending_kv_sends
        if (scheduler_output.total_num_scheduled_tokens == 0 and not sched.running and not waiting_on_transfers
                and not self.batch_queue):
            # Nothing runs and the first waiting request cannot be admitted: no later step can change that.
            raise RuntimeError(f"the engine cannot make progress: {sched.get_num_unfinished_requests()} request(s) "
                               f"wait but none fits the KV cache ({sched.kv_cache_manager.num_free_blocks} free "
                               f"blocks)")
        self.last_scheduler_output = scheduler_output
        for new in scheduler_output.scheduled_new_reqs:
            self.stats.num_cached_prompt_tokens += new.num_computed_tokens - new.num_external_computed_tokens
            self.stats.num_external_prompt_tokens += new.num_external_computed_tokens

    def _update_from_output(self, scheduler_output: SchedulerOutput,
                            model_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """The scheduler's update, logprobs and drafts attached, counters advanced (a plan of 0 tokens is no model
        step); with no step left in flight, the runner drops the requests that finished."""
        start = time.monotonic()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if model_output.logprobs:
            for out in outputs:
                entries = model_output.logprobs.get(out.request_id)
                if entries is not None:
                    out.new_logprobs = entries[:len(out.new_token_ids)]
        self.scheduler.update_draft_token_ids(model_output)
        if not self.batch_queue and self.scheduler.finished_req_ids:
            # No step in flight (always so when synchronous): the runner can drop the finished requests now, not only
            # when their ids ride the next plan (as in vLLM), so an engine nobody steps again holds no request state.
            self.model_executor.collective_rpc("remove_requests", (list(self.scheduler.finished_req_ids),))
        stats = self.stats
        if scheduler_output.total_num_scheduled_tokens:
            stats.num_steps += 1
        stats.num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        stats.num_generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        stats.num_preemptions += len(scheduler_output.preempted_req_ids)
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            if rid in model_output.req_id_to_index:
                stats.num_draft_tokens += len(drafts)
                kept = len(model_output.sampled_token_ids[model_output.req_id_to_index[rid]]) - 1
                stats.num_accepted_tokens += max(kept, 0)
        done = time.monotonic()
        if self.timeline is not None:
            self.timeline.append(("update", start, done))
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats(), timestamp=done)

    def _abandon(self, scheduler_output: SchedulerOutput | None) -> None:
        """After a step failed (or Ctrl-C hit it): the scheduler, the runner and the KV cache may disagree, so abort
        the requests the step touched (all, when ``schedule()`` itself failed or steps were in flight), and take
        the blocks it was to fill out of the prefix cache (hashed when allocated, their K/V maybe never written)."""
        try:
            if self.batch_queue:
                for future, _, _ in self.batch_queue:  # let the executor's thread finish: it writes the KV cache
                    try:
                        future.result()
                    except BaseException:  # noqa: BLE001 - the step's own error is the one being raised
                        pass
                self.batch_queue.clear()
                scheduler_output = None
            kv = self.scheduler.kv_cache_manager
            pool = kv.block_pool
            if scheduler_output is None:
                scheduled = list(self.scheduler.requests)
                for rid in scheduled:
                    pool.evict_cached_blocks(kv.get_blocks(rid))
            else:
                scheduled = list(scheduler_output.num_scheduled_tokens)
                for rid, num_new in scheduler_output.num_scheduled_tokens.items():
                    request = self.scheduler.requests.get(rid)
                    if request is not None:  # blocks before the step's first token held K/V computed earlier
                        first_unsure = max(request.num_computed_tokens - num_new, 0) // kv.block_size
                        pool.evict_cached_blocks(kv.get_blocks(rid)[first_unsure:])
            self.abort_requests(scheduled)
        except Exception:  # noqa: BLE001 - never hide the original error behind one from the clean-up
            logger.exception("cleaning up after a failed step failed too")

    # -- what a client may ask (UTILITY calls) ------------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        """The core now: queues, KV cache, counters."""
        kv = self.scheduler.kv_cache_manager
        return SchedulerStats(num_running_reqs=len(self.scheduler.running),
                              num_waiting_reqs=len(self.scheduler.waiting), num_blocks=kv.num_blocks,
                              num_free_blocks=kv.num_free_blocks, kv_cache_usage=float(kv.usage),
                              engine=msgspec.structs.replace(self.stats))

    def get_num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.num_free_blocks

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.scheduler.reset_prefix_cache(reset_running_requests)  # running ones preempted first, if asked

    def ping(self) -> str:
        return "pong"

    def start_timeline(self) -> None:
        """Record when each step is scheduled, executed and updated from, from now on."""
        self.timeline, self.model_executor.timeline = [], []

    def take_timeline(self) -> list[tuple[str, float, float]]:
        """The events recorded since :meth:`start_timeline`, in start order; recording stops."""
        events = list(self.timeline or []) + [("execute", a, b) for a, b in self.model_executor.timeline or []]
        self.timeline = self.model_executor.timeline = None
        return sorted(events, key=lambda e: e[1])

    def get_stats(self) -> SchedulerStats:
        return self.make_stats()

    def ready_message(self) -> EngineCoreReady:
        """The handshake: what a client learns about this core before anything else (``READY``)."""
        return EngineCoreReady(pid=os.getpid(), num_gpu_blocks=self.num_gpu_blocks, max_model_len=self.max_model_len,
                               block_size=self.engine_args.block_size, async_scheduling=self.async_scheduling,
                               attention_backend=self.attention_backend, dtype=self.dtype,
                               model_config=self.model_config)

    def shutdown(self) -> None:
        """Let the executor's thread finish, and a KV connector what it sends or waits for (chapter 9)."""
        self.model_executor.shutdown()
        for connector in (self.kv_connector_worker, self.kv_connector_scheduler):
            if connector is not None:
                connector.shutdown()


class EngineCoreProc(EngineCore):
    """:class:`EngineCore` in its own process, talking to one client over two ZeroMQ sockets.

    Built by :func:`run_engine_core` in the child process; the client is
    :class:`~minillm.engine.core_client.MPClient`.
    """

    def __init__(self, model: LlamaForCausalLM | None, engine_args: EngineArgs, input_address: str,
                 output_socket: zmq.Socket[bytes], eos_token_id: int | None = None, async_scheduling: bool = False,
                 model_thread: ThreadPoolExecutor | None = None) -> None:
        super().__init__(model, engine_args, eos_token_id=eos_token_id, async_scheduling=async_scheduling,
                         model_thread=model_thread)
        self.input_address = input_address
        self.output_socket = output_socket
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, ClientPayload]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[bytes, EngineCoreOutputs | bytes] | None] = queue.Queue()
        self._decoders = {EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
                          EngineCoreRequestType.ABORT: MsgpackDecoder(AbortPayload),
                          EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityPayload)}

    # -- the two socket threads ---------------------------------------------------------------------------------
    def process_input_sockets(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Input thread: receive, decode, queue. Decoding here keeps it off the busy loop's time."""
        import zmq

        sock = context.socket(zmq.PULL)
        sock.connect(self.input_address)
        try:
            while True:
                frame, payload = sock.recv_multipart(copy=False)
                kind = EngineCoreRequestType(bytes(frame.buffer))
                self.input_queue.put_nowait((kind, self._decoders[kind].decode(payload.buffer)))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def process_output_sockets(self) -> None:
        """Output thread: encode and send. The socket's send queue has no limit (``SNDHWM=0``), so a slow client
        never blocks a step; a dead parent ends the process (see :func:`run_engine_core`)."""
        import zmq

        encoder = MsgpackEncoder()
        try:
            while True:
                item = self.output_queue.get()
                if item is None:
                    return
                kind, payload = item
                data = payload if isinstance(payload, bytes) else encoder.encode(payload)  # DEAD's text is bytes
                self.output_socket.send_multipart([kind, data], copy=False)
        except zmq.ContextTerminated:
            pass

    # -- the busy loop ------------------------------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        """Take the client's messages, step while there is work, sleep on the input queue when there is none."""
        while True:
            self._process_input_queue()
            self._process_engine_step()

    def _process_input_queue(self) -> None:
        while not self.has_requests():
            kind, payload = self.input_queue.get()  # nothing to step: block until a message comes
            self._handle_client_request(kind, payload)
        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())

    def _process_engine_step(self) -> None:
        outputs, _ = self.step_fn()
        if outputs is not None and outputs.outputs:
            self.output_queue.put_nowait((OUTPUTS, outputs))

    def _handle_client_request(self, kind: EngineCoreRequestType, payload: ClientPayload) -> None:
        if isinstance(payload, EngineCoreRequest):  # ADD
            try:
                self.add_request(payload)
            except ValueError as e:  # the client checks first; a request the scheduler still refuses ends alone
                logger.warning("refused request %r: %s", payload.request_id, e)
                self.output_queue.put_nowait((OUTPUTS, EngineCoreOutputs(outputs=[self._refused(payload)])))
        elif kind is EngineCoreRequestType.ABORT:
            request_ids, status = cast(AbortPayload, payload)
            self.abort_requests(request_ids, RequestStatus(status))
        elif kind is EngineCoreRequestType.UTILITY:
            call_id, method, args = cast(UtilityPayload, payload)
            try:
                if method.startswith("_") or not callable(getattr(self, method, None)):
                    raise ValueError(f"unknown utility method {method!r}")
                result, failure = getattr(self, method)(*args), None
            except Exception as e:  # noqa: BLE001 - the caller gets the error, the core goes on
                result, failure = None, f"{type(e).__name__}: {e}"
            self.output_queue.put_nowait((OUTPUTS, EngineCoreOutputs(
                utility_output=UtilityOutput(call_id, failure, result))))

    @staticmethod
    def _refused(request: EngineCoreRequest) -> EngineCoreOutput:
        return EngineCoreOutput(request.request_id, [], finish_reason="abort")


def run_engine_core(engine_args: EngineArgs, eos_token_id: int | None, async_scheduling: bool, input_address: str,
                    output_address: str, death_pipe: multiprocessing.connection.Connection,
                    num_threads: int | None = None,
                    model_pipe: multiprocessing.connection.Connection | None = None) -> None:
    """The engine-core process's entry point: start the engine core, handshake, busy loop; tell the client if
    anything fails.

    A model the caller already loaded arrives on ``model_pipe`` once the process runs (not with the process's
    start-up data: see ``MPClient.__init__``); without a pipe the engine core's worker(s) load ``engine_args.model``
    (on ``model_thread`` when the worker is in this process)."""
    import zmq

    # Ctrl-C in a terminal reaches the whole process group: the client handles it (it aborts its requests), and
    # the core must live on to serve the next call. SIGTERM is how the client shuts it down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    threading.Thread(target=watch_parent, args=(death_pipe,), name="minillm-parent-watch", daemon=True).start()
    # One thread does all of PyTorch's work in this process (loading, the KV cache, every step): a second thread
    # running ops would bring a second OpenMP team onto the same cores (see UniProcExecutor).
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minillm-model")
    context = zmq.Context()
    out = context.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(output_address)
    encoder = MsgpackEncoder()
    core: EngineCoreProc | None = None
    try:
        def build() -> EngineCoreProc:
            mark_model_thread(model_thread)  # the worker is built and loads here: its executor must not wait on us
            if num_threads is not None:
                torch.set_num_threads(num_threads)
            model = None  # the worker(s) load engine_args.model
            if model_pipe is not None:
                model = model_pipe.recv()
                model_pipe.close()
                if not isinstance(model, LlamaForCausalLM):
                    raise TypeError(f"the engine core needs a LlamaForCausalLM, got {type(model).__name__}")
            return EngineCoreProc(model, engine_args, input_address, out, eos_token_id, async_scheduling,
                                  model_thread=model_thread)

        try:
            core = model_thread.submit(build).result()
        except Exception as e:  # noqa: BLE001 - the client raises it in the caller's process
            out.send_multipart([FAILED, encoder.encode(f"{type(e).__name__}: {e}")])
            return
        out.send_multipart([READY, encoder.encode(core.ready_message())])
        threading.Thread(target=core.process_input_sockets, args=(context,), name="minillm-core-input",
                         daemon=True).start()
        output_thread = threading.Thread(target=core.process_output_sockets, name="minillm-core-output", daemon=True)
        output_thread.start()
        try:
            core.run_busy_loop()
        except SystemExit:
            raise
        except BaseException as e:  # noqa: BLE001 - a step failed: the client must hear it, then we exit
            logger.exception("the engine core failed")
            core.output_queue.put_nowait((DEAD, f"{type(e).__name__}: {e}".encode()))
        finally:
            core.output_queue.put_nowait(None)
            output_thread.join(timeout=5)
    finally:
        if core is not None:
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001 - exiting anyway
                logger.exception("engine core shutdown failed")
        model_thread.shutdown(wait=False)
        out.close(linger=2000)
        context.term()
