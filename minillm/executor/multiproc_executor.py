"""Worker processes, one per rank, that run every call together: tensor parallelism inside the engine, and the
distributed jobs of the course.

:class:`MultiprocExecutor` starts ``world_size`` processes (``spawn``) that join one gloo group and build a worker
each (``worker_cls(rank=r, tp_group=g, **worker_kwargs)``), which then runs its ``init_device`` and ``load_model`` (if
it has them) before the rank reports ready: each rank loads its own shard, and the engine core sends only a path.
A call is published once on a ZeroMQ ``XPUB`` socket
(which sees every rank subscribe, so nothing is sent before all listen) and answered on one ``PULL`` socket; a step
runs on every rank and only rank 0 answers. A failed or dead rank fails every call, named (a peer's broken
collective is a symptom: the rank that failed first is waited for up to 2 s); a monitor thread watches the
processes and the deadlines. vLLM broadcasts through a shared-memory ring buffer on one node
(``vllm/distributed/device_communicators/shm_broadcast.py:MessageQueue``), which saves a copy per rank.

vLLM counterpart: ``vllm/v1/executor/multiproc_executor.py`` (``MultiprocExecutor``: ``collective_rpc``,
``execute_model``, ``output_rank``, ``check_health``; ``WorkerProc``) and ``vllm/v1/serial_utils.py:run_method``.
"""
from __future__ import annotations

import functools
import importlib
import itertools
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_sentinels
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Literal, overload

from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from minillm.distributed.parallel_state import check_timeout
from minillm.executor.abstract import Executor
from minillm.system_utils import watch_parent

if TYPE_CHECKING:
    import zmq

# A rank stuck in a collective gives up after timeout_s and says where; a call waits this much longer, so that
# message comes first, before the executor names the ranks that did not answer at all.
_GRACE_S = 5.0
# How long a peer's broken collective waits for the rank that caused it (an error of its own, or its death).
_ROOT_CAUSE_WAIT_S = 2.0
_READY = "ready"
_SHUTDOWN = "__shutdown__"


class WorkerError(RuntimeError):
    """A worker rank failed, died or did not answer; the message names the rank (and carries its traceback).

    vLLM's ``MultiprocExecutor.collective_rpc`` raises a ``RuntimeError`` ("Worker failed with error ...") too."""


@dataclass
class _Call:
    """One call in flight: the ranks whose answer it waits for, what came back, and when it gives up."""

    future: Future[Any]
    reply_ranks: list[int]
    timeout_s: float
    deadline: float
    single: bool  # one rank answers (unique_reply_rank): the future gets its result, not a list
    results: dict[int, object] = field(default_factory=dict)


class _Calls:
    """The calls in flight and the executor's failure, shared with its two threads (which hold no reference to the
    executor, so deleting it, or the engine around it, stops the ranks)."""

    def __init__(self, procs: list[BaseProcess], error_cls: type[Exception]) -> None:
        self.procs = procs
        self.error_cls = error_cls
        self.lock = threading.Lock()
        self.pending: dict[int, _Call] = {}
        self.failure: str | None = None
        self.stop = threading.Event()
        # Both threads may see a rank die; one reaps it at a time, or the other reads no exit code.
        self.reap_lock = threading.Lock()

    def fail(self, why: str) -> None:
        """End every rank, then fail every call in flight, and every later one. Call with ``lock`` held.

        The ranks are ended first: a call that fails finds them gone, and a live peer left mid-collective could run
        nothing more anyway (vLLM's monitor shuts the executor down too)."""
        self.failure = self.failure or why
        with self.reap_lock:
            _end_processes(self.procs, terminate_wait_s=1.0)
        for call in self.pending.values():
            if not call.future.done():
                call.future.set_exception(self.error_cls(self.failure))
        self.pending.clear()


class MultiprocExecutor(Executor):
    """Runs every call on ``world_size`` worker processes, one per rank. Use it directly or as a context manager.

    Args:
        world_size: ranks (processes), ``>= 1``; the engine runs tensor parallelism with 2 or more.
        worker_cls: what each rank builds: ``worker_cls(rank=r, tp_group=g, **worker_kwargs)``, ``g`` a
            :class:`~minillm.distributed.parallel_state.TensorParallelGroup` of every rank; then its
            ``init_device()`` and ``load_model()``, where it has them (vLLM: ``WorkerProc.__init__``).
        worker_kwargs: the same for every rank; sent once through a pipe, tensors as shared memory (the engine core
            sends a checkpoint path instead, and each rank reads its own shard).
        seed: every rank seeds its global generator with it, so unseeded sampling draws the same on every rank.
        num_threads: PyTorch threads per rank (default: this process's, shared out among the ranks, at least 1).
        timeout_s: the longest a call (or a collective inside it) may take before the call fails.
        start_timeout_s: the longest the ranks may take to start, build their workers and report ready.
        error_cls: the exception a failure raises (default :class:`WorkerError`; the engine core passes
            :class:`~minillm.engine.EngineDeadError`).

    Attributes:
        procs: the ranks' processes, rank order.
        worker_info: what each rank reported (its worker's ``describe()``, or ``None``): when it was ready (weights
            loaded), then again after :meth:`initialize_from_config` (KV cache allocated).

    Raises:
        ValueError: a bad ``world_size``, ``timeout_s`` or ``start_timeout_s``.
        RuntimeError: a rank failed to start (its error is in the message) or did not report in time.
    """

    output_rank = 0

    def __init__(self, world_size: int, worker_cls: type, worker_kwargs: Mapping[str, object], seed: int = 0,
                 num_threads: int | None = None, timeout_s: float = 60.0, start_timeout_s: float = 120.0,
                 error_cls: type[Exception] = WorkerError) -> None:
        import torch
        import torch.multiprocessing as torch_mp
        import zmq

        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self.worker_cls = worker_cls
        self.timeout_s = check_timeout("timeout_s", timeout_s)
        start_timeout_s = check_timeout("start_timeout_s", start_timeout_s)
        self._call_ids = itertools.count()
        self.timeline = None  # (sent, answered) of each step while the engine core records a timeline
        self._step_start: float | None = None  # when the latest step's execute_model was sent

        base = os.path.join(tempfile.gettempdir(), f"minillm-mp-{uuid.uuid4().hex[:12]}")
        paths = [base + "-rpc", base + "-out", base + "-init"]
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._broadcast = self._context.socket(zmq.XPUB)
        self._broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # every rank's subscription arrives, not only the first
        self._broadcast.setsockopt(zmq.SNDHWM, 0)
        self._broadcast.bind(f"ipc://{paths[0]}")
        responses = self._context.socket(zmq.PULL)
        responses.setsockopt(zmq.RCVHWM, 0)
        responses.bind(f"ipc://{paths[1]}")

        ctx = torch_mp.get_context("spawn")
        threads = num_threads if num_threads is not None else max(1, torch.get_num_threads() // world_size)
        self.procs: list[BaseProcess] = []
        death_writers: list[Connection] = []
        arg_writers: list[Connection] = []
        for rank in range(world_size):
            death_reader, death_writer = ctx.Pipe(duplex=False)
            arg_reader, arg_writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker_main, name=f"Worker_TP{rank}", kwargs=dict(
                rank=rank, world_size=world_size, init_file=paths[2], broadcast_address=f"ipc://{paths[0]}",
                response_address=f"ipc://{paths[1]}", death_pipe=death_reader, args_pipe=arg_reader,
                worker_cls=worker_cls, seed=seed, num_threads=threads, timeout_s=self.timeout_s))
            proc.start()
            death_reader.close()
            arg_reader.close()
            self.procs.append(proc)
            death_writers.append(death_writer)
            arg_writers.append(arg_writer)
        self._calls = _Calls(list(self.procs), error_cls)
        # shutdown(), or deleting the executor (or the engine around it), or the interpreter's exit: no rank is left.
        self._threads: list[threading.Thread] = []
        self._finalizer = weakref.finalize(self, _release, list(self.procs), death_writers, paths, self._calls,
                                           self._context, [self._broadcast, responses], self._threads)
        for writer in arg_writers:
            try:
                writer.send(worker_kwargs)  # tensors go to shared memory once; each rank gets their handles
            except OSError:
                pass  # that rank is gone: the start-up wait below names it
            finally:
                writer.close()
        try:
            self.worker_info = _wait_until_ready(self._broadcast, responses, self.procs, start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._threads += [
            threading.Thread(target=_read_responses, args=(responses, self._calls),
                             name="minillm-mp-responses", daemon=True),
            threading.Thread(target=_monitor_workers, args=(self._calls,), name="minillm-mp-monitor", daemon=True)]
        for thread in self._threads:
            thread.start()

    def __enter__(self) -> MultiprocExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def is_failed(self) -> bool:
        """Whether a rank failed or died, or the executor was shut down (vLLM: ``Executor.is_failed``)."""
        return self._calls.failure is not None

    @property
    def alive_ranks(self) -> list[int]:
        """Ranks whose process is still running (empty once the executor failed or was shut down)."""
        return [r for r, p in enumerate(self.procs) if p.is_alive()]

    # -- calls ----------------------------------------------------------------------------------------------------
    def collective_rpc(self, method: str | Callable[..., object], args: tuple[object, ...] = (),
                       kwargs: Mapping[str, object] | None = None, unique_reply_rank: int | None = None,
                       non_block: bool = False, timeout_s: float | None = None) -> Any:
        """Call ``worker.method(*args, **kwargs)``, or ``method(worker, *args, **kwargs)``, on every rank.

        Args:
            method: the name of a method of ``worker_cls``, or a module-level function of an importable module (it
                travels by name: each rank imports it).
            args, kwargs: the same for every rank; they travel pickled.
            unique_reply_rank: only this rank answers (the others run the call too).
            non_block: return a ``Future`` at once.
            timeout_s: the longest the call may take (default: the executor's ``timeout_s``), plus 5 s of grace.

        Returns:
            One result per rank, by rank, or only ``unique_reply_rank``'s; with ``non_block``, a ``Future`` of that.

        Raises:
            ValueError: a method the workers do not have, a function they cannot import, a bad rank or timeout;
                checked here, before anything is sent, so the executor stays usable.
            error_cls: a rank died, failed, or did not answer in time (the executor has then failed for good).
        """
        self.check_health()
        _check_method(method, self.worker_cls)
        if unique_reply_rank is not None and (isinstance(unique_reply_rank, bool) or unique_reply_rank
                                              not in range(self.world_size)):
            raise ValueError(f"unique_reply_rank must be None or an int in [0, {self.world_size}), got "
                             f"{unique_reply_rank!r}")
        timeout_s = self.timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        reply_ranks = list(range(self.world_size)) if unique_reply_rank is None else [unique_reply_rank]
        future: Future[Any] = Future()
        calls = self._calls
        with calls.lock:
            if calls.failure is not None:
                raise calls.error_cls(calls.failure)
            call_id = next(self._call_ids)
            calls.pending[call_id] = _Call(future, reply_ranks, timeout_s, time.monotonic() + timeout_s + _GRACE_S,
                                           single=unique_reply_rank is not None)
            self._broadcast.send(pickle.dumps((call_id, method, args, kwargs or {}, unique_reply_rank),
                                              protocol=pickle.HIGHEST_PROTOCOL))
        return future if non_block else future.result()

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: Literal[False] = False) -> ModelRunnerOutput | None: ...

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: Literal[True]) -> Future[ModelRunnerOutput | None]: ...

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        """Publish the step to every rank; rank 0's answer comes back (the others ran the same step)."""
        future: Future[ModelRunnerOutput | None] = self.collective_rpc(
            "execute_model", (scheduler_output,), unique_reply_rank=self.output_rank, non_block=True)
        if self.timeline is not None:
            start, timeline = time.monotonic(), self.timeline
            self._step_start = start

            def done(f: Future[ModelRunnerOutput | None]) -> None:
                if f.exception() is None and f.result() is not None:  # no sampling to wait for: the step is over
                    timeline.append((start, time.monotonic()))
            future.add_done_callback(done)
        return future if non_block else future.result()

    @overload
    def sample_tokens(self, grammar_output: object | None,
                      non_block: Literal[False] = False) -> ModelRunnerOutput: ...

    @overload
    def sample_tokens(self, grammar_output: object | None,
                      non_block: Literal[True]) -> Future[ModelRunnerOutput]: ...

    def sample_tokens(self, grammar_output: object | None,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Every rank samples its step (the same tokens: same logits, same seeds); rank 0's output comes back."""
        future: Future[ModelRunnerOutput] = self.collective_rpc(
            "sample_tokens", (grammar_output,), unique_reply_rank=self.output_rank, non_block=True)
        if self.timeline is not None and self._step_start is not None:
            start, timeline = self._step_start, self.timeline
            future.add_done_callback(lambda _: timeline.append((start, time.monotonic())))
        return future if non_block else future.result()

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        """Every rank allocates its KV cache; :attr:`worker_info` is then read again (what each rank now holds)."""
        super().initialize_from_config(kv_cache_configs)
        if callable(getattr(self.worker_cls, "describe", None)):
            self.worker_info = self.collective_rpc("describe")

    def check_health(self) -> None:
        """Raise ``error_cls`` if a rank has died or failed, or the executor was shut down."""
        if self._calls.failure is not None:
            raise self._calls.error_cls(self._calls.failure)

    def shutdown(self) -> None:
        """Ask every rank to stop, give them 5 s, then terminate what is left; close the sockets. Idempotent."""
        if not self._finalizer.alive:
            return
        self._calls.stop.set()  # the ranks are about to exit on purpose: the monitor must not call it a death
        with self._calls.lock:
            try:
                self._broadcast.send(pickle.dumps((-1, _SHUTDOWN, (), {}, None)))
            except Exception:  # noqa: BLE001 - the socket may be gone already
                pass
        deadline = time.monotonic() + 5
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._finalizer()


def _check_method(method: object, worker_cls: type) -> None:
    """A ValueError, here in the caller, for a call no rank could make: a method ``worker_cls`` lacks, or a function
    that cannot travel by name."""
    if isinstance(method, str):
        if not callable(getattr(worker_cls, method, None)):
            raise ValueError(f"{worker_cls.__name__} has no method {method!r}")
        return
    check_importable_function(method)


def check_importable_function(fn: object) -> None:
    """A ValueError unless ``fn`` is a module-level function of an importable module: a pickled function travels by
    name and each rank imports it (a lambda, a nested function, or one defined in ``__main__`` or a notebook cannot).
    """
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not callable(fn) or not module or module == "__main__" or "." in qualname or "<" in qualname:
        raise ValueError(f"a function for the workers must be a module-level function of an importable module (each "
                         f"rank imports it by name), got {fn!r}")
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"cannot import {fn!r}'s module {module!r}: {e}") from None


def _end_processes(procs: list[BaseProcess], terminate_wait_s: float) -> None:
    """Terminate every live process, wait up to ``terminate_wait_s`` for all, then kill the rest (a stopped
    process does not act on SIGTERM until continued; SIGKILL ends it anyway)."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + terminate_wait_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _wait_until_ready(broadcast: zmq.Socket[bytes], responses: zmq.Socket[bytes], procs: list[BaseProcess],
                      timeout_s: float) -> list[object]:
    """Wait until every rank subscribed to the broadcast and reported its worker built; their descriptions."""
    import zmq

    poller = zmq.Poller()
    poller.register(broadcast, zmq.POLLIN)
    poller.register(responses, zmq.POLLIN)
    subscribed, ready = 0, dict[int, object]()
    deadline = time.monotonic() + timeout_s
    while subscribed < len(procs) or len(ready) < len(procs):
        dead = [(r, p) for r, p in enumerate(procs) if not p.is_alive()]
        if dead:
            rank, proc = dead[0]
            raise RuntimeError(f"worker rank {rank} exited during start-up (exit code {proc.exitcode}); a script "
                               f"must start the executor (or the engine) under `if __name__ == \"__main__\":` "
                               f"(workers are started with spawn)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers did not start within {timeout_s:.0f} s: {subscribed} of {len(procs)} "
                               f"subscribed, ranks {sorted(ready)} ready")
        events = dict(poller.poll(200))
        if broadcast in events and broadcast.recv()[:1] == b"\x01":  # a subscription (b"\x00": unsubscription)
            subscribed += 1
        if responses in events:
            kind, rank, ok, payload = pickle.loads(responses.recv())
            if kind == _READY and not ok:
                raise RuntimeError(f"worker rank {rank} failed to start: {payload}")
            ready[rank] = payload
    return [ready[r] for r in range(len(procs))]


def _dead_rank(procs: list[BaseProcess], wait_s: float, reap_lock: threading.Lock) -> str | None:
    """Why a rank is dead, if one dies within ``wait_s`` (``None`` if every rank lives on)."""
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    died = wait_for_sentinels(list(sentinels), timeout=wait_s)
    if not died:
        return None
    rank = next(r for sentinel, r in sentinels.items() if sentinel in died)
    with reap_lock:
        procs[rank].join(timeout=1)  # reaped, so the exit code is known
    # Another thread (a caller's own join) may be the one reaping it: its exit code lands a moment later.
    deadline = time.monotonic() + 1
    while procs[rank].exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return f"worker rank {rank} (pid {procs[rank].pid}) died with exit code {procs[rank].exitcode}"


def _root_cause(rank: int, error: tuple[bool, str, str], responses: zmq.Socket[bytes], calls: _Calls) -> str:
    """The failure to report, given a rank's error ``(is_collective_error, summary, traceback)``.

    A broken collective on a live rank is usually a symptom: its peer died, or failed by itself and never reached
    the collective. Wait up to ``_ROOT_CAUSE_WAIT_S`` for that peer (its death, or an error that is not a
    collective's), and name it; otherwise name the first rank that reported."""
    errors = {rank: error}
    deadline = time.monotonic() + _ROOT_CAUSE_WAIT_S
    while all(collective for collective, _, _ in errors.values()):
        death = _dead_rank(calls.procs, 0.05, calls.reap_lock)
        if death is not None:
            return death
        if time.monotonic() > deadline:
            break
        if responses.poll(50):
            _, other, ok, payload = pickle.loads(responses.recv())
            if not ok:
                errors.setdefault(other, payload)
    rank = next((r for r, (collective, _, _) in errors.items() if not collective), rank)
    _, summary, tb = errors[rank]
    others = sorted(set(errors) - {rank})
    also = f" (then ranks {others} failed too)" if others else ""
    return f"worker rank {rank} failed: {summary}{also}\n{tb}"


def _read_responses(responses: zmq.Socket[bytes], calls: _Calls) -> None:
    """The response thread: match each rank's answer to its call; a rank's error fails the executor."""
    import zmq

    while not calls.stop.is_set():
        try:
            if not responses.poll(200):
                continue
            call_id, rank, ok, payload = pickle.loads(responses.recv())
            why = None if ok else _root_cause(rank, payload, responses, calls)
        except zmq.ZMQError:
            return  # the socket was closed: shutting down
        with calls.lock:
            if why is not None:
                # A rank's error ends the executor: its peers are left mid-collective, no later call can run.
                calls.fail(why)
                continue
            call = calls.pending.get(call_id)
            if call is None:
                continue  # a call that already failed
            call.results[rank] = payload
            if len(call.results) == len(call.reply_ranks):
                del calls.pending[call_id]
                results = [call.results[r] for r in call.reply_ranks]
                call.future.set_result(results[0] if call.single else results)


def _monitor_workers(calls: _Calls) -> None:
    """The monitor thread: a rank that dies, or a call past its deadline, fails every call (vLLM's
    ``MultiprocExecutor.start_worker_monitor``)."""
    while not calls.stop.is_set():
        death = _dead_rank(calls.procs, 0.2, calls.reap_lock)
        if death is not None and not calls.stop.is_set():
            with calls.lock:
                calls.fail(death)
            return
        now = time.monotonic()
        with calls.lock:
            late = [c for c in calls.pending.values() if now > c.deadline]
            if late:
                missing = sorted(set(late[0].reply_ranks) - set(late[0].results))
                calls.fail(f"worker rank(s) {missing} did not answer within {late[0].timeout_s + _GRACE_S:.0f} s")


def _release(procs: list[BaseProcess], death_writers: list[Connection], paths: list[str], calls: _Calls,
             context: zmq.Context[zmq.Socket[bytes]], sockets: list[zmq.Socket[bytes]],
             threads: list[threading.Thread]) -> None:
    """Stop the threads, end every rank (terminate, then kill), close the sockets, remove their files."""
    calls.stop.set()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=5)  # each wakes within 0.2 s; a socket must not close under a thread using it
    for writer in death_writers:
        writer.close()  # a rank still waiting for work sees its parent gone and exits
    with calls.lock:
        calls.fail("the executor was shut down")  # ends the ranks, and fails any call still waiting
        for socket in sockets:
            socket.close(linger=0)
    context.term()
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def _worker_main(rank: int, world_size: int, init_file: str, broadcast_address: str, response_address: str,
                 death_pipe: Connection, args_pipe: Connection, worker_cls: type, seed: int, num_threads: int,
                 timeout_s: float) -> None:
    """A rank's process: join the group, build the worker, load its model, then run every call the executor
    publishes.

    vLLM counterpart: ``vllm/v1/executor/multiproc_executor.py:WorkerProc.worker_main`` and its
    ``worker_busy_loop``."""
    import torch
    import torch.distributed as dist
    import zmq

    from minillm.distributed.comm import CollectiveError
    from minillm.distributed.parallel_state import TensorParallelGroup

    # Ctrl-C reaches the whole process group; the caller decides what happens, and stops us with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))
    threading.Thread(target=watch_parent, args=(death_pipe,), name="minillm-parent-watch", daemon=True).start()
    torch.set_num_threads(num_threads)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(broadcast_address)
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(response_address)
    try:
        worker_kwargs = args_pipe.recv()
        args_pipe.close()
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        torch.manual_seed(seed)  # the global generator unseeded random sampling draws from: the same on every rank
        worker = worker_cls(rank=rank, tp_group=TensorParallelGroup(dist.group.WORLD, timeout_s), **worker_kwargs)
        del worker_kwargs
        for step in ("init_device", "load_model"):  # vLLM: WorkerProc.__init__; each rank loads its own shard
            fn = getattr(worker, step, None)
            if callable(fn):
                fn()
        describe = getattr(worker, "describe", None)
        push.send(pickle.dumps((_READY, rank, True, describe() if describe is not None else None)))
    except BaseException as e:  # noqa: BLE001 - the executor raises it in the caller's process
        push.send(pickle.dumps((_READY, rank, False, f"{type(e).__name__}: {e}")))
        push.close(linger=2000)
        return
    try:
        while True:
            call_id, method, args, kwargs, reply_rank = pickle.loads(sub.recv())
            if method == _SHUTDOWN:
                break
            try:
                fn = getattr(worker, method) if isinstance(method, str) else functools.partial(method, worker)
                result, ok = fn(*args, **kwargs), True
            except Exception as e:  # noqa: BLE001 - sent back: the executor fails the call with it
                result, ok = (isinstance(e, CollectiveError), f"{type(e).__name__}: {e}", traceback.format_exc()), False
            if not ok or reply_rank is None or reply_rank == rank:
                push.send(pickle.dumps((call_id, rank, ok, result), protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        context.destroy(linger=1000)
