"""How the front end talks to the engine core: a method call in-process, or messages to another process.

======================  ============================  =======================================================
client                  used by                       the engine core
======================  ============================  =======================================================
:class:`InprocClient`   ``LLMEngine(model, ...)``:    an :class:`~minillm.engine.core.EngineCore` object in this
                        the notebooks, the capstone   process; ``get_output()`` steps it
:class:`SyncMPClient`   ``LLM``, ``bench``            an :class:`~minillm.engine.core.EngineCoreProc` process;
                                                      ``get_output()`` waits for its next message
:class:`AsyncMPClient`  ``AsyncLLM``, ``serve``       the same process; ``await get_output_async()``
======================  ============================  =======================================================

The multiprocess clients bind two ZeroMQ sockets on IPC paths (``PUSH`` for requests, ``PULL`` for outputs),
start the core with the ``spawn`` method (as vLLM's CPU platform does: a child ``fork``-ed from a process whose
OpenMP threads have run hangs in its first parallel matmul), wait for its handshake, and then:

* an **output thread** receives and decodes every message; step outputs go to a queue (a ``queue.Queue``, or the
  event loop's ``asyncio.Queue``), answers to utility calls to the future that waits for them;
* a **monitor thread** waits on the process's sentinel: if the core dies without being shut down, every waiter
  gets :class:`~minillm.engine.EngineDeadError` at once;
* a ``weakref.finalize`` shuts the core down (SIGTERM, then SIGKILL after a timeout) when the client is collected,
  shut down, or the interpreter exits, and the core exits by itself if this process dies (a pipe it watches).

The switch is ``MINILLM_ENABLE_V1_MULTIPROCESSING`` (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING``, default ``1``).

vLLM counterpart: ``vllm/v1/engine/core_client.py`` (``EngineCoreClient.make_client``, ``InprocClient``,
``MPClient``, ``SyncMPClient``, ``AsyncMPClient``, ``BackgroundResources``, ``start_engine_core_monitor``).
vLLM's ``AsyncMPClient`` reads its socket with ``zmq.asyncio`` on the event loop; here one output thread serves
both clients and hands outputs to the loop with ``call_soon_threadsafe``, which keeps the two clients one code path.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing.connection
import os
import queue
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from typing import Any

from minillm.engine import (EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, EngineDeadError,
                            SchedulerStats)
from minillm.request import RequestStatus
from minillm.serial_utils import MsgpackDecoder, MsgpackEncoder

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


class EngineCoreClient:
    """What the front end calls. Pick one with :meth:`make_client`."""

    @staticmethod
    def make_client(multiprocess_mode: bool, asyncio_mode: bool, **kwargs: Any) -> "EngineCoreClient":
        """``InprocClient(engine_core=...)`` without multiprocessing; else ``SyncMPClient`` or ``AsyncMPClient``
        with :class:`MPClient`'s arguments."""
        if not multiprocess_mode:
            if asyncio_mode:
                raise ValueError("the asyncio client needs the engine core in its own process "
                                 "(MINILLM_ENABLE_V1_MULTIPROCESSING=1)")
            return InprocClient(**kwargs)
        return AsyncMPClient(**kwargs) if asyncio_mode else SyncMPClient(**kwargs)

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    """The engine core as an object in this process (``MINILLM_ENABLE_V1_MULTIPROCESSING=0``, or an
    ``LLMEngine`` built around a loaded model): every call is a method call, ``get_output()`` runs steps."""

    def __init__(self, engine_core: Any) -> None:
        self.engine_core = engine_core

    def add_request(self, request: Any) -> None:
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

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class _BackgroundResources:
    """Everything the client started, shut down once (by the finalizer, or explicitly)."""

    def __init__(self) -> None:
        self.proc: Any = None
        self.context: Any = None
        self.sockets: list[Any] = []
        self.death_writer: Any = None
        self.output_thread: threading.Thread | None = None
        self.output_socket: Any = None
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
        engine_args: the configuration; the core loads ``engine_args.model`` itself unless ``model`` is given.
        model: an already loaded model, sent to the core once (its tensors through shared memory).
        eos_token_id: the tokenizer's EOS id (what ``min_tokens`` blocks).
        async_scheduling: the core steps with the batch queue.
        num_threads: torch threads in the core (default: the caller's count).

    Raises:
        RuntimeError: the core failed to start (its error is in the message) or did not answer in time.
    """

    def __init__(self, engine_args: Any, model: Any = None, eos_token_id: int | None = None,
                 async_scheduling: bool = False, num_threads: int | None = None) -> None:
        import torch
        import torch.multiprocessing as torch_mp
        import zmq

        from minillm.engine.core import run_engine_core

        self.resources = _BackgroundResources()
        self._finalizer = weakref.finalize(self, self.resources)
        self.encoder = MsgpackEncoder()
        self._dead: str | None = None
        self._call_ids = itertools.count()
        self._utility_futures: dict[int, Future] = {}
        self._lock = threading.Lock()

        base = os.path.join(tempfile.gettempdir(), f"minillm-{uuid.uuid4().hex[:12]}")
        input_path, output_path = base + "-in", base + "-out"
        self.resources.ipc_paths = [input_path, output_path]
        context = zmq.Context()
        self.resources.context = context
        self.input_socket = context.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(f"ipc://{input_path}")
        self.output_socket = context.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(f"ipc://{output_path}")
        self.resources.sockets = [self.input_socket]
        self.resources.output_socket = self.output_socket

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
        if model_writer is not None:
            model_reader.close()
            try:
                model_writer.send(model)  # the tensors travel as shared memory, the pipe carries their handles
            except OSError:
                pass  # the child is gone: _wait_for_handshake reports it
            finally:
                model_writer.close()
        self.ready = self._wait_for_handshake()
        self.stats = SchedulerStats()
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
    def _wait_for_handshake(self) -> dict:
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
        info = MsgpackDecoder().decode(payload)
        if kind == FAILED:
            self.shutdown()
            if info.startswith("ValueError: "):
                # An argument only the loaded model can check (e.g. heads that do not split over the ranks): the
                # caller's mistake, raised as the in-process engine raises it.
                raise ValueError(info.removeprefix("ValueError: "))
            raise RuntimeError(f"the engine core failed to start: {info}")
        assert kind == READY, kind
        return info

    def shutdown(self) -> None:
        """Stop the engine core (SIGTERM, SIGKILL after a timeout) and close the sockets. Idempotent."""
        self._finalizer()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

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
            self.stats = outputs.scheduler_stats
        self._deliver(outputs)

    def _deliver(self, item: EngineCoreOutputs | BaseException) -> None:
        raise NotImplementedError

    # -- requests in --------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self.resources.shutting_down:
            raise EngineDeadError("the engine core was shut down")

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        self._check_alive()
        with self._lock:  # one socket, possibly several calling threads
            self.input_socket.send_multipart([kind.value, self.encoder.encode(payload)], copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        if request_ids and self._dead is None and not self.resources.shutting_down:
            self._send(EngineCoreRequestType.ABORT, (list(request_ids), int(status)))

    def _call_utility_future(self, method: str, args: tuple) -> Future:
        future: Future = Future()
        call_id = next(self._call_ids)
        with self._lock:
            self._utility_futures[call_id] = future
        self._send(EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        return future

    def call_utility(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        """Call ``method(*args)`` on the engine core (one of its public methods) and return its result."""
        return self._call_utility_future(method, args).result(timeout)


class SyncMPClient(MPClient):
    """The blocking client: ``get_output()`` waits for the core's next message (``LLM``, ``bench``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.outputs_queue: queue.Queue = queue.Queue()
        super().__init__(*args, **kwargs)

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
        return item


class AsyncMPClient(MPClient):
    """The asyncio client (``AsyncLLM``, ``serve``): ``await get_output_async()``; sending never blocks.

    Args:
        loop: the event loop that awaits outputs (default: the running loop, else a new one must be set later
            with :meth:`bind_loop` before :meth:`get_output_async`).
    """

    def __init__(self, *args: Any, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._early: list[Any] = []  # delivered before a loop was bound
        self._bind_lock = threading.Lock()
        super().__init__(*args, **kwargs)
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        if loop is not None:
            self.bind_loop(loop)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver outputs to ``loop`` from now on (call on that loop's thread)."""
        with self._bind_lock:
            self._loop = loop
            self._outputs = asyncio.Queue()
            early, self._early = self._early, []
        for item in early:
            self._outputs.put_nowait(item)

    def _deliver(self, item: EngineCoreOutputs | BaseException) -> None:
        with self._bind_lock:
            if self._loop is None:
                self._early.append(item)
                return
            loop, outputs = self._loop, self._outputs
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody awaits outputs any more
            pass

    async def get_output_async(self) -> EngineCoreOutputs:
        self._check_alive()
        if self._outputs is None:
            self.bind_loop(asyncio.get_running_loop())
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)
            raise item
        return item

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str],
                                   status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.abort_requests(request_ids, status)

    async def call_utility_async(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        future = self._call_utility_future(method, args)
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)


def _monitor(client_ref: Any, proc: Any, resources: _BackgroundResources) -> None:
    """Monitor thread: the core's process ended; unless we stopped it, every waiter hears it now."""
    multiprocessing.connection.wait([proc.sentinel])
    proc.join(timeout=1)  # reaps it: exitcode is None until the process is waited for
    client = client_ref()
    if client is not None and not resources.shutting_down:
        client._mark_dead(f"the engine core process (pid {proc.pid}) died unexpectedly (exit code {proc.exitcode})")


def _process_outputs(client_ref: Any, sock: Any, resources: _BackgroundResources) -> None:
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


def _term_context(context: Any, output_thread: threading.Thread | None) -> None:
    if output_thread is not None and output_thread is not threading.current_thread():
        output_thread.join()
    context.term()
