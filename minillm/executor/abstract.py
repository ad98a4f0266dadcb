"""The executor interface: what the engine core asks of whatever runs the model.

The engine core never calls a model runner directly. It hands each step's
:class:`~minillm.core.sched.output.SchedulerOutput` to an executor and gets a
:class:`~minillm.core.sched.output.ModelRunnerOutput` back, right away (``non_block=False``) or as a
``concurrent.futures.Future`` (``non_block=True``): the second is what lets async scheduling plan step N+1 while
step N runs.

vLLM counterpart: ``vllm/v1/executor/abstract.py:Executor`` (``execute_model``, ``collective_rpc``,
``check_health``, ``shutdown``, ``supports_async_scheduling``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Runs steps on the model; the engine core's only door to it."""

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        """Whether :meth:`execute_model` can run a step without blocking the caller (needed by async scheduling)."""
        return False

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step; with ``non_block`` return a future at once. Steps run in the order they were given."""

    @abstractmethod
    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        """Call ``worker.method(*args, **kwargs)`` on every worker, or ``method(worker, *args, **kwargs)`` when
        ``method`` is a function; one result per worker, by rank."""

    def check_health(self) -> None:
        """Raise if a worker is gone (one worker in-process: it cannot be)."""

    def shutdown(self) -> None:
        """Release the workers (and any thread the executor started)."""
