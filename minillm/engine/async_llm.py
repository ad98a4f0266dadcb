"""The asyncio front end: many consumers submit requests and await their outputs, streamed as they come.

:class:`AsyncLLM` is ``LLMEngine``'s sibling: it owns an ``InputProcessor``, an ``OutputProcessor`` and an
engine-core client, and one **output handler** task on the event loop awaits the core's outputs, detokenizes them,
aborts the requests a stop string ended and hands each ``RequestOutput`` to its request's collector. The client is an
``AsyncMPClient`` (the core in its own process, what ``python -m minillm serve`` runs) or an ``AsyncInprocClient`` (one
engine thread steps a core in this process). A consumer that stops listening (a client hangs up, its task is
cancelled) aborts its request, and the core frees its KV blocks at once.

vLLM counterpart: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate``, ``add_request``, ``_run_output_handler``,
``abort``, ``shutdown``) and ``RequestOutputCollector`` in ``vllm/v1/engine/output_processor.py``.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minillm.engine import EngineCoreOutputs, EngineDeadError, SchedulerStats
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.core_client import EngineCoreClient, multiprocessing_enabled
from minillm.engine.input_processor import InputProcessor, PromptType
from minillm.engine.output_processor import OutputProcessor
from minillm.engine.outputs import RequestOutput
from minillm.engine.parts import EngineParts
from minillm.model.llama import LlamaForCausalLM
from minillm.request import RequestStatus
from minillm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["AsyncLLM", "AsyncLLMStats", "EngineDeadError", "RequestOutputCollector"]

logger = logging.getLogger(__name__)


class _End:
    """Put on a collector's queue when its request ended with no final output (aborted, or the engine stopped)."""


_END = _End()


@dataclass(frozen=True)
class AsyncLLMStats:
    """A snapshot of the engine for ``/debug/kv_cache``; safe to read from any thread.

    (vLLM counterpart: the ``SchedulerStats`` and ``IterationStats`` of ``vllm/v1/metrics/stats.py``, which feed its
    ``/metrics``.)

    Attributes:
        num_blocks: KV cache blocks, the reserved null block included.
        num_free_blocks: blocks that can be allocated now (free or evictable prefix-cache blocks).
        kv_cache_usage: fraction of usable blocks held by requests, in ``[0, 1]``.
        num_unfinished_requests: the front end's or the core's count, whichever is more (the core's comes with its
            blocks, so 0 there means its blocks are free; the front end's covers requests on their way to it).
        num_requests_total / num_finished / num_aborted: counters since start.
        num_steps: steps the core ran the model.
    """

    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_unfinished_requests: int = 0
    num_requests_total: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_steps: int = 0


class RequestOutputCollector:
    """The outputs of one request, queued on the event loop that asked for it.

    Created by :meth:`AsyncLLM.add_request`; read with ``await collector.get()`` (``None`` once the request ended
    without a final output) or through :meth:`AsyncLLM.stream_outputs`.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException | _End] = asyncio.Queue()
        self.finished = False  # the consumer has seen the final output (or the end)

    def put(self, item: RequestOutput | BaseException | _End) -> None:
        """Queue an item (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            pass

    async def get(self) -> RequestOutput | None:
        """The next ``RequestOutput``; ``None`` when the request ended without one (aborted). Raises engine errors."""
        if self.finished:
            return None
        item = await self.queue.get()
        if isinstance(item, _End):
            self.finished = True
            return None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class AsyncLLM:
    """Serve many concurrent requests, each an asyncio consumer of its outputs.

    Args: as :class:`~minillm.engine.llm_engine.LLMEngine`'s; ``multiprocess_mode`` defaults to ``True`` (vLLM's
    ``AsyncLLM`` always runs the core in its own process); ``False`` steps it on an engine thread in this process.

    Use::

        llm = AsyncLLM.from_engine_args(EngineArgs())
        async for out in llm.generate("req-1", "The capital of France is", SamplingParams(max_tokens=8)):
            print(out.outputs[0].delta_text, end="")
        llm.shutdown()

    Raises:
        ValueError: a bad argument (as ``LLMEngine``). RuntimeError: the engine-core process failed to start.
    """

    def __init__(self, model: LlamaForCausalLM | None, tokenizer: PreTrainedTokenizerBase | None = None,
                 engine_args: EngineArgs | None = None,
                 parts: EngineParts | None = None, multiprocess_mode: bool = True) -> None:
        args = engine_args if engine_args is not None else EngineArgs()
        if not isinstance(args, EngineArgs):
            raise ValueError(f"engine_args must be an EngineArgs, got {type(args).__name__}")
        if multiprocess_mode and parts is not None and parts.replaced():
            raise ValueError(f"replaced engine parts ({parts.replaced()}) run in-process only: "
                             f"multiprocess_mode=False")
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        client = EngineCoreClient.make_client(multiprocess_mode, asyncio_mode=True, engine_args=args, model=model,
                                              parts=parts, eos_token_id=eos)
        self._init_front_end(client, tokenizer, args)

    @classmethod
    def from_engine_core(cls, engine_core: EngineCoreClient, tokenizer: PreTrainedTokenizerBase | None,
                         engine_args: EngineArgs) -> AsyncLLM:
        """An ``AsyncLLM`` in front of a core someone else built, through an asyncio client (``AsyncMPClient``, or
        an ``AsyncInprocClient`` over another front end's synchronous client, as ``build_app(llm)`` serves an
        ``LLM``)."""
        self = cls.__new__(cls)
        self._init_front_end(engine_core, tokenizer, engine_args)
        return self

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess_mode: bool | None = None) -> AsyncLLM:
        """The engine ``engine_args`` describe; ``multiprocess_mode`` ``None``: ``MINILLM_ENABLE_V1_MULTIPROCESSING``
        (default on: the core runs in its own process, where its worker(s) load the model; this one loads only the
        tokenizer)."""
        if multiprocess_mode is None:
            multiprocess_mode = multiprocessing_enabled()
        model = None  # the engine core's worker(s) load it, in its process or in this one
        return cls(model, engine_args.load_tokenizer(), engine_args, multiprocess_mode=multiprocess_mode)

    def _init_front_end(self, engine_core: EngineCoreClient, tokenizer: PreTrainedTokenizerBase | None,
                        engine_args: EngineArgs) -> None:
        ready = engine_core.ready
        self.engine_args = engine_args
        self.tokenizer = tokenizer
        self.model_config = ready["model_config"]
        self.max_model_len: int = engine_args.create_scheduler_config(self.model_config).max_model_len
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.input_processor = InputProcessor(tokenizer, self.model_config, self.max_model_len,
                                              eos if eos is not None else self.model_config.eos_token_id,
                                              speculative=engine_args.create_speculative_config() is not None)
        self.output_processor = OutputProcessor(tokenizer)
        self.engine_core = engine_core
        self.output_handler: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop the requests and the handler live on
        self._collectors: dict[str, RequestOutputCollector] = {}  # that loop's thread only
        self._counts = {"total": 0, "finished": 0, "aborted": 0}
        self._dead: BaseException | None = None

    # ------------------------------------------------------------------------------------------ lifecycle
    @property
    def is_running(self) -> bool:
        return self._dead is None and not self.engine_core.is_dead

    @property
    def errored(self) -> bool:
        return not self.is_running

    def shutdown(self) -> None:
        """Stop the engine core (its process, or the engine thread); unfinished requests end (their streams stop).
        Safe to call from any thread, and more than once."""
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
        handler, self.output_handler = self.output_handler, None
        if handler is not None and not handler.done():
            try:
                handler.get_loop().call_soon_threadsafe(handler.cancel)
            except RuntimeError:  # its loop is closed: the task will never run again anyway
                pass
        self._on_loop(self._end_all, _END)
        self.engine_core.shutdown()

    # ------------------------------------------------------------------------------------------ client API
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                          priority: int = 0) -> RequestOutputCollector:
        """Check and tokenize the request here, then hand it to the engine core.

        Raises:
            ValueError: a bad prompt or parameters, a request id in use, or the core refused it; the message says
                which.
            Exception: whatever else adding it raised in an in-process core (the core goes on serving the others).
            EngineDeadError: the engine has stopped.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")
        request, prompt_text = self.input_processor.process_inputs(request_id, prompt, params, priority)
        loop = self._bind_loop()
        collector = RequestOutputCollector(request_id, loop)
        self.output_processor.add_request(request_id, prompt_text, request.prompt_token_ids,
                                          request.sampling_params)  # raises when the id is in use
        self._collectors[request_id] = collector
        if self.output_handler is None:
            self.output_handler = loop.create_task(self._run_output_handler())
        try:
            await self.engine_core.add_request_async(request)
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add it undoes (in-process), or sent after it
            raise
        except BaseException:
            self.output_processor.abort_requests([request_id])
            self._collectors.pop(request_id, None)
            raise
        self._counts["total"] += 1
        return collector

    async def stream_outputs(self, collector: RequestOutputCollector) -> AsyncIterator[RequestOutput]:
        """Yield the request's ``RequestOutput`` objects until the final one. Leaving early aborts the request."""
        try:
            while (out := await collector.get()) is not None:
                yield out
                if out.finished:
                    return
        finally:
            if not collector.finished:
                self.abort(collector.request_id)

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs (cumulative ``text``/``token_ids`` plus ``delta_*``) as they come.

        Cancelling the task that iterates, or closing the iterator early, aborts the request.
        """
        collector = await self.add_request(request_id, prompt, params, priority)
        try:
            async for out in self.stream_outputs(collector):
                yield out
        finally:
            if not collector.finished:
                self.abort(request_id)

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests (from any thread; returns at once, the abort runs on the event loop). Unknown or finished
        ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids:
            self._on_loop(self._abort_now, ids, defer=True)

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    @property
    def stats(self) -> AsyncLLMStats:
        """The stats as of the core's latest step (the counters: now)."""
        return self._make_stats(self.engine_core.scheduler_stats)

    async def get_stats(self) -> AsyncLLMStats:
        """The stats now: asked of the core (a utility call, answered after every message sent before it, aborts
        included), not the snapshot of its latest step."""
        sched = self.engine_core.scheduler_stats
        if not self.errored:
            try:
                sched = await self.engine_core.get_stats_async()
            except EngineDeadError:
                pass
        return self._make_stats(sched)

    # ------------------------------------------------------------------------------------------ the event loop
    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                raise RuntimeError("this AsyncLLM serves another event loop, which is still open; use it from that "
                                   "loop (or one AsyncLLM per loop)")
            if self._loop is not None:  # that loop is gone, and everything it was waiting for
                self._abort_now(list(self._collectors))
                self.output_handler = None
            self._loop = loop
        return loop

    def _on_loop(self, fn: Callable[..., object], *args: object, defer: bool = False) -> None:
        """Run ``fn(*args)`` on the event loop's thread: now if this is it (and not ``defer``), else soon; at once
        when there is no loop any more."""
        loop = self._loop
        if loop is None or loop.is_closed():
            fn(*args)
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop and not defer:
            fn(*args)
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed meanwhile
            fn(*args)

    async def _run_output_handler(self) -> None:
        """The one task that takes the core's outputs: detokenize, abort stop-string finishes, deliver."""
        try:
            while True:
                self._process_engine_outputs(await self.engine_core.get_output_async())
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - EngineDeadError, or a bug: every waiter must hear it
            if not isinstance(e, EngineDeadError):
                logger.exception("the output handler failed; every request in flight is failed with the error")
                e = EngineDeadError(f"the engine failed: {type(e).__name__}: {e}")
            self._dead = e
            self._end_all(e)

    def _process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        logprobs = {o.request_id: o.new_logprobs for o in outputs.outputs if o.new_logprobs is not None}
        request_outputs, reqs_to_abort = self.output_processor.process_outputs(outputs.outputs, logprobs or None)
        if reqs_to_abort:  # stop strings: the core still holds these requests and their blocks
            self.engine_core.abort_requests(reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        for out in request_outputs:
            collector = self._collectors.get(out.request_id)
            if collector is None:
                continue
            if out.finished:
                del self._collectors[out.request_id]
                self._counts["finished"] += 1
            collector.put(out)

    def _abort_now(self, request_ids: list[str]) -> None:
        known = self.output_processor.abort_requests(request_ids)
        for rid in known:
            collector = self._collectors.pop(rid, None)
            if collector is not None:
                collector.put(_END)
        self._counts["aborted"] += len(known)
        if known and not self.engine_core.is_dead:
            self.engine_core.abort_requests(known)

    def _end_all(self, item: BaseException | _End) -> None:
        collectors, self._collectors = list(self._collectors.values()), {}
        self.output_processor.abort_requests([c.request_id for c in collectors])
        for collector in collectors:
            collector.put(item)

    def _make_stats(self, sched: SchedulerStats) -> AsyncLLMStats:
        return AsyncLLMStats(
            num_blocks=sched.num_blocks, num_free_blocks=sched.num_free_blocks, kv_cache_usage=sched.kv_cache_usage,
            num_unfinished_requests=max(self.output_processor.get_num_unfinished_requests(),
                                        sched.num_running_reqs + sched.num_waiting_reqs),
            num_requests_total=self._counts["total"], num_finished=self._counts["finished"],
            num_aborted=self._counts["aborted"], num_steps=sched.engine.num_steps)
