"""One worker, in the engine core's process: the executor of a single-device engine.

It builds its worker from ``(worker_cls, worker_kwargs)`` and has it ``init_device`` and ``load_model`` before it
returns, as every executor does. A blocking step runs on the caller's thread; a non-blocking one (async scheduling)
on the executor's one thread, which keeps steps in order (step N+1 reads the token step N sampled) while the core
plans the next. Given ``model_thread`` (the engine-core process gives the thread it builds the core on), every call
runs there, the worker's construction and loading included: a second thread running ops brings a second OpenMP team
onto the same cores.

vLLM counterpart: ``vllm/v1/executor/uniproc_executor.py:UniProcExecutor`` (its ``_init_executor`` has the
``WorkerWrapperBase`` build the worker, then calls ``init_device`` and ``load_model``), which has no thread: its GPU
runner only launches the step's kernels and returns, and ``non_block`` waits on the device-to-host copy instead.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Literal, overload

from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from minillm.executor.abstract import Executor
from minillm.worker.worker import Worker

_local = threading.local()


def mark_model_thread(model_thread: ThreadPoolExecutor) -> None:
    """Record that the calling thread is ``model_thread``'s: a :class:`UniProcExecutor` built on it (the engine-core
    process builds its engine core there) then runs its calls inline instead of waiting on itself."""
    _local.pool = model_thread


class UniProcExecutor(Executor):
    """Runs steps on one worker, in this process.

    Args:
        worker_cls: what to build, ``worker_cls(rank=0, tp_group=None, **worker_kwargs)`` (the engine core's:
            :class:`~minillm.worker.worker.Worker`); its ``init_device`` and ``load_model`` run here, on
            ``model_thread``.
        worker_kwargs: its arguments (the model object or path, the runner's arguments, the KV cache budget).
        model_thread: the thread every call runs on (see the module docstring); ``None``: the caller's, or a thread
            of the executor's own for ``non_block``.

    Attributes:
        driver_worker: the one worker (its model runner, once the KV cache is allocated, owns the paged KV cache).
    """

    def __init__(self, worker_cls: type[Worker], worker_kwargs: Mapping[str, Any],
                 model_thread: ThreadPoolExecutor | None = None) -> None:
        self._model_thread = model_thread  # every call runs there
        self._thread: ThreadPoolExecutor | None = None  # started for the first non-blocking step without one
        self.timeline = None
        self._step_start: float | None = None
        # vLLM: UniProcExecutor._init_executor (init_worker, init_device, load_model).
        self.driver_worker: Worker = self._call(partial(worker_cls, rank=0, tp_group=None, **worker_kwargs))
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        start = time.monotonic()
        output = self.driver_worker.execute_model(scheduler_output)
        if self.timeline is not None:
            if output is None:
                self._step_start = start  # the step ends when its sampling does
            else:
                self.timeline.append((start, time.monotonic()))
        return output

    def _sample(self, grammar_output: object | None) -> ModelRunnerOutput:
        output = self.driver_worker.sample_tokens(grammar_output)
        if self.timeline is not None and self._step_start is not None:
            self.timeline.append((self._step_start, time.monotonic()))
        self._step_start = None
        return output

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: Literal[False] = False) -> ModelRunnerOutput | None: ...

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: Literal[True]) -> Future[ModelRunnerOutput | None]: ...

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        return self._run(self._execute, scheduler_output, non_block)

    @overload
    def sample_tokens(self, grammar_output: object | None,
                      non_block: Literal[False] = False) -> ModelRunnerOutput: ...

    @overload
    def sample_tokens(self, grammar_output: object | None,
                      non_block: Literal[True]) -> Future[ModelRunnerOutput]: ...

    def sample_tokens(self, grammar_output: object | None,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        return self._run(self._sample, grammar_output, non_block)

    def _run(self, fn: Callable[[Any], Any], arg: object, non_block: bool) -> Any:
        """``fn(arg)`` on the model thread (or here, when there is none and ``non_block`` is not set); both halves
        of every step go through the same one thread, so they run in the order they were given."""
        if self._model_thread is not None:
            future = self._model_thread.submit(fn, arg)
            return future if non_block else future.result()
        if not non_block:
            return fn(arg)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minillm-executor")
        return self._thread.submit(fn, arg)

    def collective_rpc(self, method: str | Callable[..., object], args: tuple[object, ...] = (),
                       kwargs: Mapping[str, object] | None = None) -> list[Any]:
        fn = getattr(self.driver_worker, method) if isinstance(method, str) else partial(method, self.driver_worker)
        return [self._call(partial(fn, *args, **(kwargs or {})))]

    def _call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the model thread, waiting for it; here when there is none, or when this is it
        (:func:`mark_model_thread`: the engine-core process builds the engine core on that thread)."""
        thread = self._model_thread
        if thread is None or getattr(_local, "pool", None) is thread:
            return fn()
        return thread.submit(fn).result()

    def shutdown(self) -> None:
        for thread in (self._thread, self._model_thread):
            if thread is not None:
                thread.shutdown(wait=True)
        self._thread = self._model_thread = None
