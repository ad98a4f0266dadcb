"""Tensor parallelism inside the engine: one worker process per rank, each step's plan broadcast to all of them.

:class:`MultiprocExecutor` starts ``tp_size`` processes (``spawn``). Each joins one gloo group
(``torch.distributed``), builds its :class:`~minillm.worker.worker.Worker` (its shard of the model, the paged KV
cache of its KV heads) and then waits for work. The engine core calls the executor as it calls the one-process one:

- :meth:`MultiprocExecutor.execute_model` publishes the step's :class:`SchedulerOutput` **once**; every rank receives
  it, runs the same step (the all-reduces inside the forward pass keep them in lockstep) and only rank 0
  (:attr:`MultiprocExecutor.output_rank`) answers with its :class:`ModelRunnerOutput`; a rank that fails answers
  with its error;
- :meth:`MultiprocExecutor.collective_rpc` calls any :class:`~minillm.worker.worker.Worker` method on every rank;
- a monitor thread watches the processes: when one dies, every call in flight, and every later one, fails at once
  with :class:`~minillm.engine.EngineDeadError` naming the rank; a rank that does not answer within
  ``timeout_s`` fails the call the same way, and a rank stuck in a collective gives up after ``timeout_s`` itself
  (:class:`~minillm.distributed.parallel_state.TensorParallelGroup`).

The broadcast is a ZeroMQ ``XPUB`` socket (``ipc://``) that every rank subscribes to: one send reaches every rank,
and the ``XPUB`` side sees each rank's subscription arrive, so nothing is published before every rank listens
(plain pub/sub would drop the first messages of a slow joiner). Answers come back on one ``PULL`` socket. vLLM uses a
shared-memory ring buffer for the ranks on its own node and a ZeroMQ ``XPUB`` socket for ranks on other nodes
(``vllm/distributed/device_communicators/shm_broadcast.py:MessageQueue``); a ring buffer saves a copy per rank,
which matters for a GPU's microsecond steps, not for a CPU step of tens of milliseconds. The messages are pickled,
as ``MessageQueue`` pickles them: they go only to this engine's own child processes, over sockets only they can open.

Not to be confused with chapters 7 and 9's :class:`minillm.distributed.launcher.MultiprocExecutor`, which runs
one-off jobs (a context-parallel or tensor-parallel prefill of one prompt) on ranks that each hold the full model;
this one is the engine's, stepping every request on ranks that each hold a shard.

vLLM counterpart: ``vllm/v1/executor/multiproc_executor.py`` (``MultiprocExecutor``: ``collective_rpc`` with
``unique_reply_rank``, ``execute_model``, ``output_rank``, ``check_health``, the worker monitor, ``WorkerProc``
and its busy loop).
"""
from __future__ import annotations

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
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any

from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from minillm.engine import EngineDeadError
from minillm.executor.abstract import Executor
from minillm.model.llama import LlamaForCausalLM
from minillm.system_utils import watch_parent

_GRACE_S = 5.0
_READY = "ready"
_SHUTDOWN = "__shutdown__"


@dataclass
class _Call:
    """One call in flight: the ranks whose answer it waits for, what came back, and when it gives up."""

    future: Future
    reply_ranks: list[int]
    deadline: float
    single: bool  # one rank answers (unique_reply_rank): the future gets its result, not a list
    results: dict[int, Any] = field(default_factory=dict)


class _Calls:
    """The calls in flight and the executor's failure, shared with its two threads (which hold no reference to the
    executor, so deleting it, or the engine around it, stops the ranks)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.pending: dict[int, _Call] = {}
        self.failure: str | None = None
        self.stop = threading.Event()
        # Both threads may see a rank die; one reaps it at a time, or the other reads no exit code.
        self.reap_lock = threading.Lock()

    def fail(self, why: str) -> None:
        """Fail every call in flight, and every later one. Call with ``lock`` held."""
        self.failure = self.failure or why
        for call in self.pending.values():
            if not call.future.done():
                call.future.set_exception(EngineDeadError(self.failure))
        self.pending.clear()


class MultiprocExecutor(Executor):
    """Runs every step on ``tp_size`` worker processes, one per tensor-parallel rank.

    Args:
        model: the full model; each rank builds its shard from it (the weights travel once, as shared memory).
        tp_size: ranks (processes), ``>= 2``.
        runner_kwargs: the model runner's arguments, the same on every rank (``num_blocks``, ``block_size``, ...).
        seed: every rank seeds its global generator with it, so unseeded sampling draws the same on every rank.
        num_threads: PyTorch threads per rank (default: this process's, shared out among the ranks, at least 1).
        timeout_s: the longest a step (or a collective inside it) may take before the call fails.
        start_timeout_s: the longest the ranks may take to start, load their shards and report ready.

    Attributes:
        procs: the ranks' processes, rank order.
        worker_info: what each rank reported when it was ready (:meth:`~minillm.worker.worker.Worker.describe`).

    Raises:
        RuntimeError: a rank failed to start (its error is in the message) or did not report in time.
    """

    output_rank = 0

    def __init__(self, model: LlamaForCausalLM, tp_size: int, runner_kwargs: dict[str, Any], seed: int = 0,
                 num_threads: int | None = None, timeout_s: float = 60.0, start_timeout_s: float = 120.0) -> None:
        import torch
        import torch.multiprocessing as torch_mp
        import zmq

        if tp_size < 2:
            raise ValueError(f"MultiprocExecutor runs 2 or more ranks, got tp_size={tp_size}; one rank runs in "
                             f"UniProcExecutor")
        self.tp_size = tp_size
        self.timeout_s = timeout_s
        self._calls = _Calls(timeout_s)
        self._call_ids = itertools.count()
        # (sent, answered) of each step, time.monotonic(), while the engine core records a timeline.
        self.timeline: list[tuple[float, float]] | None = None

        base = os.path.join(tempfile.gettempdir(), f"minillm-tp-{uuid.uuid4().hex[:12]}")
        paths = [base + "-rpc", base + "-out", base + "-init"]
        self._context = zmq.Context()
        self._broadcast = self._context.socket(zmq.XPUB)
        self._broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # every rank's subscription arrives, not only the first
        self._broadcast.setsockopt(zmq.SNDHWM, 0)
        self._broadcast.bind(f"ipc://{paths[0]}")
        responses = self._context.socket(zmq.PULL)
        responses.setsockopt(zmq.RCVHWM, 0)
        responses.bind(f"ipc://{paths[1]}")

        ctx = torch_mp.get_context("spawn")
        threads = num_threads if num_threads is not None else max(1, torch.get_num_threads() // tp_size)
        self.procs = []
        death_writers, model_writers = [], []
        for rank in range(tp_size):
            death_reader, death_writer = ctx.Pipe(duplex=False)
            model_reader, model_writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker_main, name=f"Worker_TP{rank}", kwargs=dict(
                rank=rank, tp_size=tp_size, init_file=paths[2], broadcast_address=f"ipc://{paths[0]}",
                response_address=f"ipc://{paths[1]}", death_pipe=death_reader, model_pipe=model_reader,
                runner_kwargs=runner_kwargs, seed=seed, num_threads=threads, timeout_s=timeout_s))
            proc.start()
            death_reader.close()
            model_reader.close()
            self.procs.append(proc)
            death_writers.append(death_writer)
            model_writers.append(model_writer)
        # shutdown(), or deleting the executor (or the engine around it), or the interpreter's exit: no rank is left.
        self._threads: list[threading.Thread] = []
        self._finalizer = weakref.finalize(self, _release, list(self.procs), death_writers, paths, self._calls,
                                           self._context, [self._broadcast, responses], self._threads)
        for writer in model_writers:
            try:
                writer.send(model)  # tensors go to shared memory once; each rank gets their handles
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
            threading.Thread(target=_read_responses, args=(responses, self._calls, list(self.procs)),
                             name="minillm-tp-responses", daemon=True),
            threading.Thread(target=_monitor_workers, args=(list(self.procs), self._calls), name="minillm-tp-monitor",
                             daemon=True)]
        for thread in self._threads:
            thread.start()

    # -- calls ----------------------------------------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, non_block: bool = False,
                       timeout_s: float | None = None) -> Any:
        """Call ``Worker.method(*args, **kwargs)`` on every rank.

        Returns:
            One result per rank, or only ``unique_reply_rank``'s; with ``non_block``, a ``Future`` of that.

        Raises:
            EngineDeadError: a rank died, failed, or did not answer within ``timeout_s`` (default: the executor's).
        """
        self.check_health()
        reply_ranks = list(range(self.tp_size)) if unique_reply_rank is None else [unique_reply_rank]
        future: Future = Future()
        calls = self._calls
        with calls.lock:
            call_id = next(self._call_ids)
            # A rank stuck in a collective gives up after timeout_s and says where; the executor waits a little
            # longer, so that message comes first, before it names the ranks that did not answer at all.
            deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s) + _GRACE_S
            calls.pending[call_id] = _Call(future, reply_ranks, deadline, single=unique_reply_rank is not None)
            self._broadcast.send(pickle.dumps((call_id, method, args, kwargs or {}, unique_reply_rank),
                                              protocol=pickle.HIGHEST_PROTOCOL))
        return future if non_block else future.result()

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Publish the step to every rank; rank 0's output comes back (the others ran the same step)."""
        future = self.collective_rpc("execute_model", (scheduler_output,), unique_reply_rank=self.output_rank,
                                     non_block=True)
        if self.timeline is not None:
            start, timeline = time.monotonic(), self.timeline
            future.add_done_callback(lambda _: timeline.append((start, time.monotonic())))
        return future if non_block else future.result()

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if a rank has died or failed, or the executor was shut down."""
        if self._calls.failure is not None:
            raise EngineDeadError(self._calls.failure)

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


def _wait_until_ready(broadcast: Any, responses: Any, procs: list, timeout_s: float) -> list[dict[str, Any]]:
    """Wait until every rank subscribed to the broadcast and reported its worker built; their descriptions."""
    import zmq

    poller = zmq.Poller()
    poller.register(broadcast, zmq.POLLIN)
    poller.register(responses, zmq.POLLIN)
    subscribed, ready = 0, {}
    deadline = time.monotonic() + timeout_s
    while subscribed < len(procs) or len(ready) < len(procs):
        dead = [(r, p) for r, p in enumerate(procs) if not p.is_alive()]
        if dead:
            rank, proc = dead[0]
            raise RuntimeError(f"tensor-parallel worker rank {rank} exited during start-up (exit code "
                               f"{proc.exitcode}); a script must create the engine under "
                               f"`if __name__ == \"__main__\":` (workers are started with spawn)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers did not start within {timeout_s:.0f} s: {subscribed} of "
                               f"{len(procs)} subscribed, ranks {sorted(ready)} ready")
        events = dict(poller.poll(200))
        if broadcast in events and broadcast.recv()[:1] == b"\x01":  # a subscription (b"\x00": unsubscription)
            subscribed += 1
        if responses in events:
            kind, rank, ok, payload = pickle.loads(responses.recv())
            if kind == _READY and not ok:
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start: {payload}")
            ready[rank] = payload
    return [ready[r] for r in range(len(procs))]


def _dead_rank(procs: list, wait_s: float, reap_lock: threading.Lock) -> str | None:
    """Why a rank is dead, if one dies within ``wait_s`` (``None`` if every rank lives on)."""
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    died = wait_for_sentinels(list(sentinels), timeout=wait_s)
    if not died:
        return None
    rank = sentinels[died[0]]
    with reap_lock:
        procs[rank].join(timeout=1)  # reaped, so the exit code is known
    return f"tensor-parallel worker rank {rank} (pid {procs[rank].pid}) died with exit code {procs[rank].exitcode}"


def _read_responses(responses: Any, calls: _Calls, procs: list) -> None:
    """The response thread: match each rank's answer to its call; a rank's error fails the executor."""
    import zmq

    while not calls.stop.is_set():
        try:
            if not responses.poll(200):
                continue
            call_id, rank, ok, payload = pickle.loads(responses.recv())
        except zmq.ZMQError:
            return  # the socket was closed: shutting down
        # A rank that dies mid-step shows first as a broken collective on its live peers: name the dead one.
        death = None if ok else _dead_rank(procs, 1.0, calls.reap_lock)
        with calls.lock:
            call = calls.pending.get(call_id)
            if call is None:
                continue  # a call that already failed
            if not ok:
                # A rank's error ends the executor: its peers are left mid-collective, no later step can run.
                calls.fail(death or f"tensor-parallel worker rank {rank} failed: {payload}")
                continue
            call.results[rank] = payload
            if len(call.results) == len(call.reply_ranks):
                del calls.pending[call_id]
                results = [call.results[r] for r in call.reply_ranks]
                call.future.set_result(results[0] if call.single else results)


def _monitor_workers(procs: list, calls: _Calls) -> None:
    """The monitor thread: a rank that dies, or a call past its deadline, fails every call (vLLM's
    ``MultiprocExecutor.start_worker_monitor``)."""
    while not calls.stop.is_set():
        death = _dead_rank(procs, 0.2, calls.reap_lock)
        if death is not None and not calls.stop.is_set():
            with calls.lock:
                calls.fail(death)
            return
        now = time.monotonic()
        with calls.lock:
            late = [c for c in calls.pending.values() if now > c.deadline]
            if late:
                missing = sorted(set(late[0].reply_ranks) - set(late[0].results))
                calls.fail(f"tensor-parallel worker rank(s) {missing} did not answer within "
                           f"{calls.timeout_s + _GRACE_S:.0f} s")


def _release(procs: list, death_writers: list, paths: list[str], calls: _Calls, context: Any, sockets: list,
             threads: list[threading.Thread]) -> None:
    """Stop the threads, end every rank (terminate, then kill), close the sockets, remove their files."""
    calls.stop.set()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=2)  # each wakes within 0.2 s; a socket must not close under a thread using it
    for writer in death_writers:
        writer.close()  # a rank still waiting for work sees its parent gone and exits
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    with calls.lock:
        calls.fail("the executor was shut down")
        for socket in sockets:
            socket.close(linger=0)
    context.term()
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def _worker_main(rank: int, tp_size: int, init_file: str, broadcast_address: str, response_address: str,
                 death_pipe: Any, model_pipe: Any, runner_kwargs: dict[str, Any], seed: int, num_threads: int,
                 timeout_s: float) -> None:
    """A rank's process: join the group, build the worker, then run every call the executor publishes.

    vLLM counterpart: ``vllm/v1/executor/multiproc_executor.py:WorkerProc.worker_main`` and its
    ``worker_busy_loop``."""
    import torch
    import torch.distributed as dist
    import zmq

    from minillm.distributed.parallel_state import TensorParallelGroup
    from minillm.worker.worker import Worker

    # Ctrl-C reaches the whole process group; the engine decides what happens, and stops us with SIGTERM.
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
        model = model_pipe.recv()
        model_pipe.close()
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp_size,
                                timeout=timedelta(seconds=timeout_s))
        torch.manual_seed(seed)  # the global generator unseeded random sampling draws from: the same on every rank
        worker = Worker(model, rank, TensorParallelGroup(dist.group.WORLD, timeout_s), **runner_kwargs)
        del model
        push.send(pickle.dumps((_READY, rank, True, worker.describe())))
    except BaseException as e:  # noqa: BLE001 - the executor raises it in the engine's process
        push.send(pickle.dumps((_READY, rank, False, f"{type(e).__name__}: {e}")))
        push.close(linger=2000)
        return
    try:
        while True:
            call_id, method, args, kwargs, reply_rank = pickle.loads(sub.recv())
            if method == _SHUTDOWN:
                break
            try:
                result, ok = getattr(worker, method)(*args, **kwargs), True
            except Exception as e:  # noqa: BLE001 - sent back: the executor fails the call with it
                traceback.print_exc()  # the whole story on this rank's stderr; the message carries the gist
                result, ok = f"{type(e).__name__}: {e}", False
            if not ok or reply_rank is None or reply_rank == rank:
                push.send(pickle.dumps((call_id, rank, ok, result), protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        context.destroy(linger=1000)
