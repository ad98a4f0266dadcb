"""How a front end talks to the engine core: one client class per way of reaching it, one interface.

:class:`InprocClient` (``LLMEngine(model, ...)``) calls an :class:`~minillm.engine.core.EngineCore` in this process
and steps it in ``get_output()``; :class:`SyncMPClient` (``LLM``) and :class:`AsyncMPClient` (``AsyncLLM``, ``serve``)
talk to an ``EngineCoreProc`` over two ZeroMQ IPC sockets; :class:`AsyncInprocClient` gives a synchronous client the
asyncio interface, one engine thread making every call. The multiprocess clients start the core with ``spawn`` (a
``fork``-ed child of a process whose OpenMP threads ran hangs in its first matmul), fail every waiter with
:class:`~minillm.engine.EngineDeadError` when it dies, and stop it when they are collected.

vLLM counterpart: ``vllm/v1/engine/core_client.py`` (``EngineCoreClient.make_client``, ``InprocClient``,
``MPClient``, ``SyncMPClient``, ``AsyncMPClient``). vLLM has no asyncio client in-process (its ``AsyncLLM`` always
runs the core in its own process) and reads the socket on the event loop, where one output thread serves here.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import multiprocessing.connection
import os
import queue
import tempfile
import threading
import time
import typing
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from minillm.engine import (
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineDeadError,
    EngineStats,
    SchedulerStats,
)
from minillm.request import RequestStatus
from minillm.serial_utils import MsgpackDecoder, MsgpackEncoder

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    import zmq

    from minillm.engine.arg_utils import EngineArgs
    from minillm.engine.core import EngineCore
    from minillm.engine.parts import EngineParts
    from minillm.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# How long the engine core may take to load the model and say it is ready.
HANDSHAKE_TIMEOUT_S = float(os.environ.get("MINILLM_ENGINE_READY_TIMEOUT_S", "300"))
# How long shutdown waits for the core to exit after SIGTERM before it kills it.
SHUTDOWN_TIMEOUT_S = 5.0


def multiprocessing_enabled() -> bool:
    """``MINILLM_ENABLE_V1_MULTIPROCESSING`` (default on): run the engine core in its own process."""
    value = os.environ.get("MINILLM_ENABLE_V1_MULTIPROCESSING", "1")
    if value not in ("0", "1"):
        raise ValueError(f"MINILLM_ENABLE_V1_MULTIPROCESSING must be 0 or 1, got {value!r}")
    return value == "1"


@functools.cache
def utility_result_type(method: str) -> Any:
    """The declared return type of ``EngineCore.<method>``: what a utility call gives in either mode (a result that
    crossed the process boundary as msgpack is converted back into it)."""
    from minillm.engine.core import EngineCore

    fn = getattr(EngineCore, method, None)
    return typing.get_type_hints(fn).get("return", Any) if callable(fn) else Any


class EngineCoreClient:
    """What a front end calls; one subclass per way of reaching the core. Pick one with :meth:`make_client`.

    Attributes:
        ready: the core's handshake (:class:`~minillm.engine.EngineCoreReady`).
    """

    ready: EngineCoreReady

    @staticmethod
    def make_client(multiprocess_mode: bool, asyncio_mode: bool, engine_args: EngineArgs,
                    model: LlamaForCausalLM | None = None, parts: EngineParts | None = None,
                    eos_token_id: int | None = None) -> EngineCoreClient:
        """The client for a core built from ``engine_args``: in its own process (``SyncMPClient``,
        ``AsyncMPClient``; it loads ``engine_args.model`` unless ``model`` is given), or here around ``model``
        (``InprocClient``, or ``AsyncInprocClient`` over one for asyncio). Async scheduling follows vLLM v0.33.0's
        platform rule for the device the model runs on (:meth:`~minillm.engine.arg_utils.EngineArgs.
        resolved_async_scheduling`)."""
        device = model.device.type if model is not None else engine_args.resolved_device()
        async_scheduling = engine_args.resolved_async_scheduling(device)
        if multiprocess_mode:
            mp_cls = AsyncMPClient if asyncio_mode else SyncMPClient
            return mp_cls(engine_args, model=None if model is None else model.eval(), eos_token_id=eos_token_id,
                          async_scheduling=async_scheduling)
        from minillm.engine.core import EngineCore

        core = EngineCore(None if model is None else model.eval(), engine_args, parts, eos_token_id=eos_token_id,
                          async_scheduling=async_scheduling)
        client = InprocClient(core)
        return AsyncInprocClient(client) if asyncio_mode else client

    # -- the synchronous interface (LLMEngine) ---------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def has_requests(self) -> bool:
        """Whether ``get_output()`` has outputs to wait for: requests in flight, or (in-process) anything the core
        must still step for."""
        raise NotImplementedError

    def call_utility(self, method: str, *args: object, timeout: float = 60.0) -> Any:
        """``EngineCore.<method>(*args)`` (a public method), its result of the declared return type in every mode."""
        raise NotImplementedError

    def get_stats(self) -> SchedulerStats:
        """The core now: its queues, KV cache and counters (a utility call)."""
        stats: SchedulerStats = self.call_utility("get_stats")
        return stats

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The core as of its latest step (in-process: now)."""
        raise NotImplementedError

    @property
    def engine_stats(self) -> EngineStats:
        """The core's counters: the live object in-process, the latest step's snapshot from another process."""
        return self.scheduler_stats.engine

    @property
    def is_dead(self) -> bool:
        return False

    def local_engine_core(self) -> EngineCore | None:
        """The :class:`~minillm.engine.core.EngineCore` itself when it lives in this process, else ``None``."""
        return None

    def shutdown(self) -> None:
        pass

    # -- the asyncio interface (AsyncLLM) --------------------------------------------------------------------------
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: list[str],
                                   status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.abort_requests(request_ids, status)

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def call_utility_async(self, method: str, *args: object, timeout: float = 60.0) -> Any:
        raise NotImplementedError

    async def get_stats_async(self) -> SchedulerStats:
        stats: SchedulerStats = await self.call_utility_async("get_stats", timeout=10)
        return stats


class InprocClient(EngineCoreClient):
    """The engine core as an object in this process (``MINILLM_ENABLE_V1_MULTIPROCESSING=0``, or an
    ``LLMEngine`` built around a loaded model): every call is a method call, ``get_output()`` runs steps."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core
        self.ready = engine_core.ready_message()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids, status)

    def get_output(self) -> EngineCoreOutputs:
        """Step until a step has outputs (a step mid-prefill has none; with async scheduling a turn that only
        launched a step has none either), or until there is nothing left to do."""
        core = self.engine_core
        while core.has_requests():
            outputs, _ = core.step_fn()
            if outputs is not None:
                return outputs
        return EngineCoreOutputs()

    def has_requests(self) -> bool:
        return self.engine_core.has_requests()

    def call_utility(self, method: str, *args: object, timeout: float = 60.0) -> Any:
        if method.startswith("_") or not callable(getattr(self.engine_core, method, None)):
            raise ValueError(f"unknown utility method {method!r}")
        return getattr(self.engine_core, method)(*args)

    @property
    def scheduler_stats(self) -> SchedulerStats:
        return self.engine_core.make_stats()

    @property
    def engine_stats(self) -> EngineStats:
        return self.engine_core.stats

    def local_engine_core(self) -> EngineCore:
        return self.engine_core

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class _LoopQueue:
    """Items handed from any thread to one asyncio event loop's queue (bound on first use; earlier ones are kept)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self._early: list[EngineCoreOutputs | BaseException] = []

    def bind(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[EngineCoreOutputs | BaseException]:
        with self._lock:
            if self._queue is None or (self._loop is not loop and self._loop is not None and self._loop.is_closed()):
                # (A closed loop's queue is dropped with whatever it held: nobody awaits those outputs.)
                self._loop, self._queue = loop, asyncio.Queue()
                early, self._early = self._early, []
                for item in early:
                    self._queue.put_nowait(item)
            return self._queue

    def put(self, item: EngineCoreOutputs | BaseException) -> None:
        with self._lock:
            if self._loop is None or self._queue is None:
                self._early.append(item)
                return
            loop, q = self._loop, self._queue
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody awaits outputs any more
            pass

    async def get(self) -> EngineCoreOutputs:
        q = self.bind(asyncio.get_running_loop())
        item = await q.get()
        if isinstance(item, BaseException):
            q.put_nowait(item)  # every later call must see it too
            raise item
        return item


@dataclass
class _Add:
    request: EngineCoreRequest
    accepted: asyncio.Future[None]


@dataclass
class _Abort:
    request_ids: list[str]
    status: RequestStatus


@dataclass
class _Utility:
    method: str
    args: tuple[object, ...]
    result: asyncio.Future[object]


class _Stop:
    pass


# What the event loop asks of the engine thread, in order.
_Command = _Add | _Abort | _Utility | _Stop


def _settle(future: asyncio.Future[Any], result: object, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled while it waited
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class AsyncInprocClient(EngineCoreClient):
    """The asyncio interface over a synchronous client (an :class:`InprocClient`, or an ``LLM``'s
    :class:`SyncMPClient`): one **engine thread** makes every call to it, so the core is never called from two
    threads, and requests added between two steps join the next one.

    Args:
        client: the synchronous client; only the engine thread calls it from now on.
        shutdown_client: shut ``client`` down with this one (``False``: leave it usable, as when an ``LLMEngine``'s
            core is served for a while).

    Attributes:
        engine_thread: the engine thread (it starts at once).
    """

    def __init__(self, client: EngineCoreClient, shutdown_client: bool = True) -> None:
        self.client = client
        self.ready = client.ready
        self._shutdown_client = shutdown_client
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._outputs = _LoopQueue()
        self._requests: set[str] = set()  # added through this client and not finished (engine thread only)
        self._stats = client.scheduler_stats
        self._dead: str | None = None
        self._stopped = False
        self.engine_thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        self.engine_thread.start()

    # -- called from any thread ------------------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self._dead is not None or self._stopped

    @property
    def scheduler_stats(self) -> SchedulerStats:
        return self._stats

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._stopped:
            raise EngineDeadError("the engine was shut down")

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Queue the abort (returns at once); it runs before any command queued after it."""
        if request_ids and not self.is_dead:
            self._commands.put(_Abort(list(request_ids), status))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort the requests this client added, stop the engine thread after its current step, and shut the
        wrapped client down if it is ours. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._commands.put(_Stop())
        if self.engine_thread is not threading.current_thread():
            self.engine_thread.join(timeout)
        self._fail_queued(EngineDeadError("the engine was shut down"))

    # -- called on the event loop ----------------------------------------------------------------------------------
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        """Hand the request to the engine thread and wait until the core has taken it.

        Raises:
            ValueError: the core refused it. Exception: whatever else adding it raised (the core goes on serving
                the other requests). EngineDeadError: the engine has stopped.
        """
        self._check_alive()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._commands.put(_Add(request, future))
        if self.is_dead:  # stopped while we queued: nobody will take the command
            self._fail_queued(EngineDeadError(self._dead or "the engine was shut down"))
        await future

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._outputs.get()

    async def call_utility_async(self, method: str, *args: object, timeout: float = 60.0) -> Any:
        self._check_alive()
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._commands.put(_Utility(method, args, future))
        return await asyncio.wait_for(future, timeout)

    # -- the engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        client = self.client
        try:
            while True:
                # Idle: sleep until a command comes. Busy: take whatever is queued, then step.
                commands = [self._commands.get()] if not client.has_requests() else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if isinstance(command, _Stop):
                        self._stop()
                        return
                    self._handle(command)
                if client.has_requests():
                    outputs = client.get_output()
                    for out in outputs.outputs:
                        if out.finished:
                            self._requests.discard(out.request_id)
                    self._stats = client.scheduler_stats
                    if outputs.outputs:
                        self._outputs.put(outputs)
                else:
                    self._stats = client.scheduler_stats
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it, whatever it is
            logger.exception("the engine loop failed; every request in flight is failed with the error")
            self._dead = f"the engine failed: {type(e).__name__}: {e}"
            self._fail_queued(EngineDeadError(self._dead))
            self._outputs.put(EngineDeadError(self._dead))

    def _handle(self, command: _Add | _Abort | _Utility) -> None:
        if isinstance(command, _Add):
            request, future = command.request, command.accepted
            try:
                self.client.add_request(request)
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop the others share
                if not isinstance(e, ValueError):  # a bug hit while adding, not a refusal the core foresaw
                    logger.exception("adding request %r failed; refusing it and serving the others",
                                     request.request_id)
                try:
                    self.client.abort_requests([request.request_id])  # whatever the failed add left behind
                except Exception:  # noqa: BLE001 - the id may be unknown to the core; that is fine
                    logger.debug("abort after a failed add of %r also failed", request.request_id, exc_info=True)
                self._reply(future, None, e)
                return
            self._requests.add(request.request_id)
            if not self._reply(future, None, None):  # the caller's loop is gone: nobody reads this request
                self._requests.discard(request.request_id)
                self.client.abort_requests([request.request_id])
        elif isinstance(command, _Abort):
            self._requests.difference_update(command.request_ids)
            self.client.abort_requests(command.request_ids, command.status)
        else:
            try:
                result, error = self.client.call_utility(command.method, *command.args), None
            except Exception as e:  # noqa: BLE001 - the caller gets the error, the core goes on
                result, error = None, e
            self._reply(command.result, result, error)

    @staticmethod
    def _reply(future: asyncio.Future[Any], result: object, error: BaseException | None) -> bool:
        try:
            future.get_loop().call_soon_threadsafe(_settle, future, result, error)
            return True
        except RuntimeError:  # the caller's event loop is closed
            return False

    def _stop(self) -> None:
        try:
            if self._requests:
                self.client.abort_requests(sorted(self._requests))
                self._requests.clear()
            self._stats = self.client.scheduler_stats
        finally:
            if self._shutdown_client:
                self.client.shutdown()

    def _fail_queued(self, error: EngineDeadError) -> None:
        """After the loop ended: release every caller still waiting for its command."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._reply(command.accepted, None, error)
            elif isinstance(command, _Utility):
                self._reply(command.result, None, error)


class _BackgroundResources:
    """Everything the client started, shut down once (by the finalizer, or explicitly)."""

    def __init__(self) -> None:
        self.proc: BaseProcess | None = None
        self.context: zmq.Context[zmq.Socket[bytes]] | None = None
        self.sockets: list[zmq.Socket[bytes]] = []
        self.death_writer: multiprocessing.connection.Connection | None = None
        self.output_thread: threading.Thread | None = None
        self.output_socket: zmq.Socket[bytes] | None = None
        self.shutting_down = False
        self.ipc_paths: list[str] = []

    def __call__(self) -> None:
        self.shutting_down = True
        proc = self.proc
        if proc is not None and proc.is_alive():
            proc.terminate()
            proc.join(SHUTDOWN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(SHUTDOWN_TIMEOUT_S)
        for sock in self.sockets:  # the caller's sockets; the output thread closes its own when it sees us
            sock.close(linger=0)
        if self.output_thread is None and self.output_socket is not None:  # start-up failed before the thread
            self.output_socket.close(linger=0)
        if self.context is not None:
            # term() waits for the output thread to close its socket (it polls, and stops when shutting_down);
            # waiting on a thread of its own, since this may run on that very thread (the client's last reference
            # dropped there).
            threading.Thread(target=_term_context, args=(self.context, self.output_thread), daemon=True).start()
        if self.death_writer is not None:
            self.death_writer.close()
        for path in self.ipc_paths:
            try:
                os.unlink(path)
            except OSError:
                pass


class MPClient(EngineCoreClient):
    """Start the engine core in its own process and talk to it over ZeroMQ.

    Args:
        engine_args: the configuration; the core's worker(s) load ``engine_args.model`` unless ``model`` is given.
        model: an already loaded model, sent to the core once (its tensors through shared memory); with
            ``tensor_parallel_size > 1`` written here once as a temporary checkpoint instead, which the ranks read
            their shards from (so the core's process never holds the whole model), removed once they are ready.
        eos_token_id: the tokenizer's EOS id (what ``min_tokens`` blocks).
        async_scheduling: the core steps with the batch queue.
        num_threads: torch threads in the core (default: the caller's count).

    Raises:
        RuntimeError: the core failed to start (its error is in the message) or did not answer in time.
        ValueError: an argument only the loaded model can check (raised as the in-process engine raises it).
    """

    def __init__(self, engine_args: EngineArgs, model: LlamaForCausalLM | None = None,
                 eos_token_id: int | None = None, async_scheduling: bool = False,
                 num_threads: int | None = None) -> None:
        import torch
        import torch.multiprocessing as torch_mp
        import zmq

        from minillm.engine.core import run_engine_core

        self._init_outputs()
        self.resources = _BackgroundResources()
        self._finalizer = weakref.finalize(self, self.resources)
        self.encoder = MsgpackEncoder()
        self._dead: str | None = None
        self._call_ids = itertools.count()
        self._utility_futures: dict[int, Future[object]] = {}
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()  # added, and neither finished (as far as get_output told) nor aborted

        base = os.path.join(tempfile.gettempdir(), f"minillm-{uuid.uuid4().hex[:12]}")
        input_path, output_path = base + "-in", base + "-out"
        self.resources.ipc_paths = [input_path, output_path]
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.resources.context = context
        self.input_socket = context.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(f"ipc://{input_path}")
        self.output_socket = context.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(f"ipc://{output_path}")
        self.resources.sockets = [self.input_socket]
        self.resources.output_socket = self.output_socket

        checkpoint = None
        if model is not None and engine_args.tensor_parallel_size > 1:
            from minillm.loaders.sharded_loader import TemporaryCheckpoint

            checkpoint = TemporaryCheckpoint(model)
            engine_args = dataclasses.replace(engine_args, model=checkpoint.path, dtype=model.dtype,
                                              device=model.device.type)
            model = None
        ctx = torch_mp.get_context("spawn")
        death_reader, death_writer = ctx.Pipe(duplex=False)
        self.resources.death_writer = death_writer
        # A loaded model goes through a pipe of its own after the start, not in the process's start-up data:
        # Process.start() writes that data while it still holds the pipe's read end, so when the child dies before
        # reading it all (a script without `if __name__ == "__main__":`) a large payload blocks start() forever.
        # Here, with our read end closed, a dead child makes send() fail, and the handshake says why.
        model_reader, model_writer = ctx.Pipe(duplex=False) if model is not None else (None, None)
        proc = ctx.Process(target=run_engine_core, name="EngineCore", kwargs=dict(
            engine_args=engine_args, eos_token_id=eos_token_id, async_scheduling=async_scheduling,
            input_address=f"ipc://{input_path}", output_address=f"ipc://{output_path}", death_pipe=death_reader,
            num_threads=num_threads if num_threads is not None else torch.get_num_threads(),
            model_pipe=model_reader))
        proc.start()
        death_reader.close()
        self.resources.proc = proc
        self.proc = proc
        if model_reader is not None and model_writer is not None:
            model_reader.close()
            try:
                model_writer.send(model)  # the tensors travel as shared memory, the pipe carries their handles
            except OSError:
                pass  # the child is gone: _wait_for_handshake reports it
            finally:
                model_writer.close()
        try:
            self.ready = self._wait_for_handshake()
        finally:
            if checkpoint is not None:
                checkpoint.cleanup()  # the ranks have read their shards (or the core failed)
        self._stats = SchedulerStats()
        # The threads hold only a weak reference to the client: deleting the client (an LLM going out of scope)
        # must reach the finalizer that stops the core.
        me = weakref.ref(self)
        self.resources.output_thread = threading.Thread(
            target=_process_outputs, args=(me, self.output_socket, self.resources), name="minillm-client-output",
            daemon=True)
        self.resources.output_thread.start()
        threading.Thread(target=_monitor, args=(me, proc, self.resources), name="minillm-core-monitor",
                         daemon=True).start()

    # -- start and stop -----------------------------------------------------------------------------------------
    def _wait_for_handshake(self) -> EngineCoreReady:
        from minillm.engine.core import FAILED, READY

        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        while not self.output_socket.poll(100):
            if not self.proc.is_alive():
                self.shutdown()
                raise RuntimeError(f"the engine core process exited during start-up (exit code "
                                   f"{self.proc.exitcode}); see its log above. A script that starts an engine must "
                                   f"do it under `if __name__ == \"__main__\":`: the core's process is started "
                                   f"with spawn, which imports the script again")
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the engine core did not report ready within {HANDSHAKE_TIMEOUT_S:.0f} s "
                                   f"(MINILLM_ENGINE_READY_TIMEOUT_S)")
        kind, payload = self.output_socket.recv_multipart()
        if kind == FAILED:
            self.shutdown()
            info: str = MsgpackDecoder(str).decode(payload)
            if info.startswith("ValueError: "):
                # An argument only the loaded model can check (e.g. heads that do not split over the ranks): the
                # caller's mistake, raised as the in-process engine raises it.
                raise ValueError(info.removeprefix("ValueError: "))
            raise RuntimeError(f"the engine core failed to start: {info}")
        assert kind == READY, kind
        ready: EngineCoreReady = MsgpackDecoder(EngineCoreReady).decode(payload)
        return ready

    def shutdown(self) -> None:
        """Stop the engine core (SIGTERM, SIGKILL after a timeout) and close the sockets. Idempotent."""
        self._finalizer()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def scheduler_stats(self) -> SchedulerStats:
        return self._stats

    def _mark_dead(self, why: str) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = why
            futures, self._utility_futures = self._utility_futures, {}
        for future in futures.values():
            future.set_exception(EngineDeadError(why))
        self._deliver(EngineDeadError(why))

    def _on_message(self, outputs: EngineCoreOutputs) -> None:
        if outputs.utility_output is not None:
            u = outputs.utility_output
            with self._lock:
                future = self._utility_futures.pop(u.call_id, None)
            if future is not None:
                if u.failure_message is not None:
                    future.set_exception(RuntimeError(u.failure_message))
                else:
                    future.set_result(u.result)
            return
        if outputs.scheduler_stats is not None:
            self._stats = outputs.scheduler_stats
        self._deliver(outputs)

    def _init_outputs(self) -> None:
        """Make where :meth:`_deliver` puts the outputs (before the output thread starts)."""
        raise NotImplementedError

    def _deliver(self, item: EngineCoreOutputs | BaseException) -> None:
        raise NotImplementedError

    def _taken(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """The caller has taken these outputs: their finished requests are no longer in flight."""
        with self._lock:
            for out in outputs.outputs:
                if out.finished:
                    self._in_flight.discard(out.request_id)
        return outputs

    # -- requests in --------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self.resources.shutting_down:
            raise EngineDeadError("the engine core was shut down")

    def _send(self, kind: EngineCoreRequestType, payload: object) -> None:
        self._check_alive()
        with self._lock:  # one socket, possibly several calling threads
            self.input_socket.send_multipart([kind.value, self.encoder.encode(payload)], copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)
        with self._lock:
            self._in_flight.add(request.request_id)

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        with self._lock:
            self._in_flight.difference_update(request_ids)
        if request_ids and self._dead is None and not self.resources.shutting_down:
            self._send(EngineCoreRequestType.ABORT, (list(request_ids), int(status)))

    def has_requests(self) -> bool:
        return bool(self._in_flight)

    def _call_utility_future(self, method: str, args: tuple[object, ...]) -> Future[object]:
        future: Future[object] = Future()
        call_id = next(self._call_ids)
        with self._lock:
            self._utility_futures[call_id] = future
        self._send(EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        return future

    def call_utility(self, method: str, *args: object, timeout: float = 60.0) -> Any:
        """Call ``method(*args)`` on the engine core (one of its public methods) and return its result, converted
        back into the method's declared return type (vLLM's ``UtilityResult`` carries the type instead)."""
        return msgspec.convert(self._call_utility_future(method, args).result(timeout), utility_result_type(method))


class SyncMPClient(MPClient):
    """The blocking client: ``get_output()`` waits for the core's next message (``LLM``, ``bench``)."""

    def _init_outputs(self) -> None:
        self.outputs_queue: queue.Queue[EngineCoreOutputs | BaseException] = queue.Queue()

    def _deliver(self, item: EngineCoreOutputs | BaseException) -> None:
        self.outputs_queue.put_nowait(item)

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (blocks; Ctrl-C interrupts the wait). Raises ``EngineDeadError`` when the core
        has died."""
        self._check_alive()
        item = self.outputs_queue.get()
        if isinstance(item, BaseException):
            self.outputs_queue.put_nowait(item)  # every later call must see it too
            raise item
        return self._taken(item)


class AsyncMPClient(MPClient):
    """The asyncio client (``AsyncLLM``, ``serve``): ``await get_output_async()``; sending never blocks. Outputs go
    to the event loop that first awaits them (those that come earlier are kept for it)."""

    def _init_outputs(self) -> None:
        self._outputs = _LoopQueue()

    def _deliver(self, item: EngineCoreOutputs | BaseException) -> None:
        self._outputs.put(item)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._check_alive()
        return self._taken(await self._outputs.get())

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def call_utility_async(self, method: str, *args: object, timeout: float = 60.0) -> Any:
        future = self._call_utility_future(method, args)
        result = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        return msgspec.convert(result, utility_result_type(method))


def _monitor(client_ref: weakref.ref[MPClient], proc: BaseProcess, resources: _BackgroundResources) -> None:
    """Monitor thread: the core's process ended; unless we stopped it, every waiter hears it now."""
    multiprocessing.connection.wait([proc.sentinel])
    proc.join(timeout=1)  # reaps it: exitcode is None until the process is waited for
    client = client_ref()
    if client is not None and not resources.shutting_down:
        client._mark_dead(f"the engine core process (pid {proc.pid}) died unexpectedly (exit code {proc.exitcode})")


def _process_outputs(client_ref: weakref.ref[MPClient], sock: zmq.Socket[bytes],
                     resources: _BackgroundResources) -> None:
    """Output thread: receive and decode the core's messages, hand each to the client."""
    import zmq

    from minillm.engine.core import DEAD

    decoder = MsgpackDecoder(EngineCoreOutputs)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        while not resources.shutting_down:
            if not poller.poll(100):  # wake up now and then to notice a shutdown
                continue
            kind, payload = sock.recv_multipart(copy=False)
            client = client_ref()
            if client is None:
                return
            if bytes(kind.buffer) == DEAD:
                client._mark_dead(f"the engine core failed: {bytes(payload.buffer).decode()}")
                return
            client._on_message(decoder.decode(payload.buffer))
            del client
    except Exception as e:  # noqa: BLE001 - a message we cannot read: the client cannot go on
        client = client_ref()
        if client is not None and not resources.shutting_down:
            logger.exception("reading the engine core's outputs failed")
            client._mark_dead(f"reading the engine core's outputs failed: {e}")
    finally:
        sock.close(linger=0)


def _term_context(context: zmq.Context[zmq.Socket[bytes]], output_thread: threading.Thread | None) -> None:
    if output_thread is not None and output_thread is not threading.current_thread():
        output_thread.join()
    context.term()
