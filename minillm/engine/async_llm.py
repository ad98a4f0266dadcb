"""One engine, many clients: asyncio code submits requests and awaits their outputs, streamed as they come.

Two ways to run the engine underneath, one API (:meth:`AsyncLLM.generate`, :meth:`AsyncLLM.abort`):

* **The engine core in its own process** (:meth:`AsyncLLM.from_engine_args`, what ``python -m minillm serve``
  runs; vLLM's only way). The front end lives on the event loop: ``add_request`` checks and tokenizes the request
  (raising its ``ValueError`` at once), registers it with the output processor and sends it to the core through
  an :class:`~minillm.engine.core_client.AsyncMPClient`; one **output handler** task awaits the core's outputs,
  detokenizes them, aborts the requests a stop string ended, and hands each ``RequestOutput`` to its request's
  queue. The core never waits for the event loop, and the event loop never waits for a step.
* **An engine object in this process** (``AsyncLLM(engine)``: an in-process ``LLMEngine``, or anything with its
  methods): one **engine thread** owns it and alone calls ``add_request``, ``abort_request`` and ``step``; asyncio
  tasks talk to it through a thread-safe command queue, and it hands outputs back with
  ``loop.call_soon_threadsafe``.

Either way each request gets a :class:`RequestOutputCollector` (an ``asyncio.Queue`` on the caller's loop), and a
consumer that stops listening (a client disconnects, the task is cancelled, the iterator is closed) aborts its
request, whose KV blocks the core frees at once. Requests added between two steps join the next one.

vLLM counterpart: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate``, ``add_request``, ``output_handler``
in ``_run_output_handler``, ``abort``, ``shutdown``) and ``RequestOutputCollector`` in
``vllm/v1/engine/output_processor.py``.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

import msgspec

logger = logging.getLogger(__name__)


from minillm.engine import EngineDeadError, SchedulerStats  # noqa: E402  (one error, thread or process)


# Items on a collector's queue besides RequestOutput objects.
_END = object()  # the request was aborted (or the engine shut down) with no final output


@dataclass(frozen=True)
class AsyncLLMStats:
    """A snapshot the engine thread publishes after each loop iteration; safe to read from any thread.

    (Not :class:`~minillm.engine.llm_engine.EngineStats`, the engine's own counters. vLLM counterpart: the
    ``SchedulerStats`` and ``IterationStats`` of ``vllm/v1/metrics/stats.py``, which feed its ``/metrics``.)

    Attributes:
        num_blocks: KV cache blocks, the reserved null block included (0 if the engine has no KV cache manager).
        num_free_blocks: blocks that can be allocated now (free or evictable prefix-cache blocks).
        kv_cache_usage: fraction of usable blocks held by requests, in ``[0, 1]``.
        num_unfinished_requests: requests the engine still holds (waiting or running): with the engine core in its
            own process, the front end's or the core's, whichever is more (the core's count comes in the same
            snapshot as its blocks, so 0 there means its blocks are free; the front end's covers requests on their
            way to it).
        num_requests_total / num_finished / num_aborted: counters since start.
        num_steps: ``engine.step()`` calls so far.
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
    """The outputs of one request, delivered from the engine thread to one asyncio event loop.

    Created by :meth:`AsyncLLM.add_request`; read with ``await collector.get()`` (``None`` once the request was
    aborted without a final output) or through :meth:`AsyncLLM.stream_outputs`.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()
        self.finished = False  # the consumer has seen the final output (or the end)

    # ---- called from the engine thread
    def _call(self, fn: Any, *args: Any) -> bool:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            return False

    def _put(self, item: Any) -> bool:
        return self._call(self.queue.put_nowait, item)

    def _accept(self, error: BaseException | None) -> bool:
        def settle() -> None:
            if self.accepted.done():  # the caller was cancelled while waiting
                return
            if error is None:
                self.accepted.set_result(None)
            else:
                self.accepted.set_exception(error)

        return self._call(settle)

    # ---- called on the consumer's event loop
    async def get(self) -> Any:
        """The next ``RequestOutput``; ``None`` when the request ended without one (aborted). Raises engine errors."""
        if self.finished:
            return None
        item = await self.queue.get()
        if item is _END:
            self.finished = True
            return None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class AsyncLLM:
    """Serve many concurrent requests with one engine stepped by one background thread.

    Args:
        engine: an ``LLMEngine`` (anything with ``add_request``, ``abort_request``, ``step``,
            ``has_unfinished_requests``). From now on only the engine thread may call it.
        start: start the engine thread now (else on the first request).

    Use::

        llm = AsyncLLM(LLMEngine.from_engine_args(EngineArgs()))
        async for out in llm.generate("req-1", "The capital of France is", SamplingParams(max_tokens=8)):
            print(out.outputs[0].delta_text, end="")
        llm.shutdown()
    """

    def __init__(self, engine: Any, start: bool = True) -> None:
        from minillm.engine.core_client import AsyncMPClient

        self.engine = engine
        # The engine core in another process behind an asyncio client: no engine thread, an output handler task.
        self._client: AsyncMPClient | None = (engine.engine_core if isinstance(getattr(engine, "engine_core", None),
                                                                               AsyncMPClient) else None)
        self._output_handler: asyncio.Task | None = None
        # Read-only facts the server needs outside the engine thread (set once, never changed by the engine).
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.max_model_len: int | None = getattr(engine, "max_model_len", None)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._collectors: dict[str, RequestOutputCollector] = {}  # engine thread only
        self._counts = {"total": 0, "finished": 0, "aborted": 0, "steps": 0}  # engine thread only
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._dead: BaseException | None = None
        self._stop = threading.Event()
        self.stats = AsyncLLMStats()  # the engine thread publishes the real numbers as soon as it starts
        if self._client is not None:
            self._publish_stats()
        elif start:
            self.start()

    @classmethod
    def from_engine_args(cls, engine_args: Any, start: bool = True) -> "AsyncLLM":
        """Build the ``LLMEngine`` from :class:`~minillm.engine.arg_utils.EngineArgs` and wrap it."""
        from minillm.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(engine_args, asyncio_mode=True), start=start)

    # ------------------------------------------------------------------------------------------ lifecycle
    @property
    def is_running(self) -> bool:
        if self._client is not None:
            return self._dead is None and not self._client.is_dead
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None or (self._client is not None and self._client.is_dead)

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._start_lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine has stopped: {self._dead}")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run_engine_loop, name="minillm-engine", daemon=True)
                self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step, or the engine-core process; unfinished requests end
        (their iterators stop)."""
        if self._client is not None:
            if self._dead is None:
                self._dead = EngineDeadError("the engine was shut down")
            handler, self._output_handler = self._output_handler, None
            if handler is not None and not handler.done():  # shutdown may come from another thread (serve's)
                try:
                    handler.get_loop().call_soon_threadsafe(handler.cancel)
                except RuntimeError:  # its loop is closed: the task will never run again anyway
                    pass
            self._end_all(_END)
            self.engine.shutdown()
            return
        with self._start_lock:
            thread = self._thread
            if self._dead is None:
                self._dead = EngineDeadError("the engine was shut down")
        self._stop.set()
        if thread is not None and thread.is_alive():
            self._commands.put(("wake",))
            thread.join(timeout)
        self._fail_queued()

    # ------------------------------------------------------------------------------------------ client API
    async def add_request(self, request_id: str, prompt: str | list[int], params: Any,
                          priority: int = 0) -> RequestOutputCollector:
        """Hand a request to the engine thread and wait until the engine has accepted it.

        Raises:
            ValueError: the engine refused the request (bad prompt or parameters, duplicate id); the message is
                the engine's.
            Exception: whatever else ``engine.add_request`` raised for this request; the engine loop goes on
                serving the other requests.
            EngineDeadError: the engine thread has stopped.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")
        if self._client is not None:
            return await self._add_request_mp(request_id, prompt, params, priority)
        self.start()
        collector = RequestOutputCollector(request_id, asyncio.get_running_loop())
        self._commands.put(("add", collector, prompt, params, priority))
        if self._dead is not None:  # stopped while we queued: nobody will take the command
            self._fail_queued()
        try:
            await collector.accepted
        except asyncio.CancelledError:
            # The command is queued; an abort queued after it undoes it in order.
            self.abort(request_id)
            raise
        return collector

    async def stream_outputs(self, collector: RequestOutputCollector) -> AsyncIterator[Any]:
        """Yield the request's ``RequestOutput`` objects until the final one. Leaving early aborts the request."""
        try:
            while (out := await collector.get()) is not None:
                yield out
                if out.finished:
                    return
        finally:
            if not collector.finished:
                self.abort(collector.request_id)

    async def generate(self, request_id: str, prompt: str | list[int], params: Any,
                       priority: int = 0) -> AsyncIterator[Any]:
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
        """Abort requests (thread-safe, returns at once). Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self._client is not None:
            self._handle_abort(ids)
        elif ids and self._thread is not None and self._thread.is_alive():
            self._commands.put(("abort", ids))

    # ------------------------------------------------------------------------------------------ engine-core process
    async def _add_request_mp(self, request_id: str, prompt: Any, params: Any, priority: int
                              ) -> RequestOutputCollector:
        """Check and tokenize here (a bad request never reaches the core), then send it."""
        self._client._check_alive()
        engine = self.engine
        request, prompt_text = engine.process_inputs(request_id, prompt, params, priority=priority)
        collector = RequestOutputCollector(request_id, asyncio.get_running_loop())
        engine.output_processor.add_request(request_id, prompt_text, request.prompt_token_ids,
                                            request.sampling_params)
        self._collectors[request_id] = collector
        try:
            await self._client.add_request_async(request)
        except BaseException:
            engine.output_processor.abort_requests([request_id])
            self._collectors.pop(request_id, None)
            raise
        self._counts["total"] += 1
        if self._output_handler is None:
            self._output_handler = asyncio.get_running_loop().create_task(self._run_output_handler())
        return collector

    async def _run_output_handler(self) -> None:
        """The one task that takes the core's outputs: detokenize, abort stop-string finishes, deliver."""
        try:
            while True:
                outputs = await self._client.get_output_async()
                self._counts["steps"] += 1
                self._dispatch(self.engine._process_engine_outputs(outputs))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - EngineDeadError, or a bug: every waiter must hear it
            if not isinstance(e, EngineDeadError):
                logger.exception("the output handler failed; every request in flight is failed with the error")
                e = EngineDeadError(f"the engine failed: {type(e).__name__}: {e}")
            self._dead = e
            self._end_all(e)

    # ------------------------------------------------------------------------------------------ engine thread
    def _run_engine_loop(self) -> None:
        engine = self.engine
        try:
            self._publish_stats()
            while not self._stop.is_set():
                cmds = []
                if not engine.has_unfinished_requests():
                    # Idle: sleep until a command comes (waking now and then to notice a shutdown).
                    try:
                        cmds.append(self._commands.get(timeout=0.1))
                    except queue.Empty:
                        continue
                while True:  # take whatever else is queued: requests added now join the next step
                    try:
                        cmds.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for cmd in cmds:
                    if cmd[0] == "add":
                        self._handle_add(*cmd[1:])
                    elif cmd[0] == "abort":
                        self._handle_abort(cmd[1])
                if self._stop.is_set():
                    break
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._counts["steps"] += 1
                    self._dispatch(outputs)
                self._publish_stats()
            self._end_all(_END)
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it, whatever it is
            logger.exception("the engine loop failed; every request in flight is failed with the error")
            self._dead = e
            self._end_all(EngineDeadError(f"the engine failed: {type(e).__name__}: {e}"))
        self._publish_stats()

    def _handle_add(self, collector: RequestOutputCollector, prompt: Any, params: Any, priority: int) -> None:
        rid = collector.request_id
        if rid in self._collectors:
            collector._accept(ValueError(f"request_id {rid!r} is already in use by an unfinished request"))
            return
        try:
            self.engine.add_request(rid, prompt, params, priority=priority)
        except ValueError as e:
            collector._accept(e)
            return
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop every other request shares
            # Not a refusal the engine foresaw (that would be a ValueError) but a bug it hit while adding this
            # request; the engine has not stepped with it, so failing this request alone keeps the rest intact.
            logger.exception("adding request %r failed; refusing it and serving the others", rid)
            try:
                self.engine.abort_request([rid])  # drop whatever the failed add left half-registered
            except Exception:  # noqa: BLE001 - the id may be unknown to the engine; that is fine
                logger.debug("abort after a failed add of %r also failed", rid, exc_info=True)
            collector._accept(e)
            return
        self._counts["total"] += 1
        self._collectors[rid] = collector
        if not collector._accept(None):  # the caller's loop is gone: nobody will read this request
            self._handle_abort([rid])

    def _handle_abort(self, request_ids: list[str]) -> None:
        known = [rid for rid in request_ids if rid in self._collectors]
        if not known:
            return
        self.engine.abort_request(known)
        for rid in known:
            self._collectors.pop(rid)._put(_END)
        self._counts["aborted"] += len(known)

    def _dispatch(self, outputs: list[Any]) -> None:
        gone = []
        deliveries = []
        for out in outputs:
            collector = self._collectors.get(out.request_id)
            if collector is None:
                continue
            if out.finished:
                del self._collectors[out.request_id]
                self._counts["finished"] += 1
            deliveries.append((collector, out))
        # Publish first: a caller that has just received its final output must already see it counted.
        self._publish_stats()
        for collector, out in deliveries:
            if not collector._put(out) and not out.finished:
                gone.append(out.request_id)
        if gone:
            self._handle_abort(gone)

    def _end_all(self, item: Any) -> None:
        for collector in self._collectors.values():
            collector._put(item)
        self._collectors.clear()
        self._fail_queued()

    def _fail_queued(self) -> None:
        """After the loop ended: release every caller still waiting for its request to be accepted."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                cmd[1]._accept(EngineDeadError(f"the engine has stopped: {self._dead}"))

    async def get_stats(self) -> AsyncLLMStats:
        """The stats now. With the engine core in another process they are asked of it (a utility call, answered
        after every message sent before it, aborts included), not the snapshot of its last step."""
        if self._client is not None and not self.errored:
            try:
                self._client.stats = msgspec.convert(await self._client.call_utility_async("get_stats", timeout=10),
                                                     SchedulerStats)
            except EngineDeadError:
                pass
            self._publish_stats()
        return self.stats

    def _publish_stats(self) -> None:
        if self._client is not None:
            sched = self._client.stats
            self.stats = AsyncLLMStats(
                num_blocks=sched.num_blocks, num_free_blocks=sched.num_free_blocks,
                kv_cache_usage=sched.kv_cache_usage,
                num_unfinished_requests=max(self.engine.get_num_unfinished_requests(),
                                            sched.num_running_reqs + sched.num_waiting_reqs),
                num_requests_total=self._counts["total"], num_finished=self._counts["finished"],
                num_aborted=self._counts["aborted"], num_steps=sched.engine.num_steps)
            return
        kv = getattr(self.engine, "kv_cache_manager", None)
        try:
            unfinished = self.engine.get_num_unfinished_requests()
        except AttributeError:
            unfinished = len(self._collectors)
        self.stats = AsyncLLMStats(
            num_blocks=int(getattr(kv, "num_blocks", 0) or 0),
            num_free_blocks=int(getattr(kv, "num_free_blocks", 0) or 0),
            kv_cache_usage=float(getattr(kv, "usage", 0.0) or 0.0),
            num_unfinished_requests=unfinished,
            num_requests_total=self._counts["total"],
            num_finished=self._counts["finished"],
            num_aborted=self._counts["aborted"],
            num_steps=self._counts["steps"],
        )
