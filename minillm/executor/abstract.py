"""The executor interface: what the engine core asks of whatever runs the model.

The engine core never calls a model runner directly. It hands each step's
:class:`~minillm.core.sched.output.SchedulerOutput` to an executor and gets a
:class:`~minillm.core.sched.output.ModelRunnerOutput` back, right away (``non_block=False``) or as a
``concurrent.futures.Future`` (``non_block=True``): the second is what lets async scheduling plan step N+1 while
step N runs.

An executor builds its workers itself, from ``(worker_cls, worker kwargs)``, and has each load its model before it
returns (``init_device``, ``load_model``); the engine core then sizes the KV cache through it:
:meth:`~Executor.get_kv_cache_specs` and :meth:`~Executor.determine_available_memory` (one answer per worker), then
:meth:`~Executor.initialize_from_config` with the core's decision.

vLLM counterpart: ``vllm/v1/executor/abstract.py:Executor`` (``execute_model``, ``collective_rpc``,
``determine_available_memory``, ``get_kv_cache_specs``, ``initialize_from_config``, ``compile_or_warm_up_model``,
``check_health``, ``shutdown``, ``supports_async_scheduling``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Literal, overload

from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from minillm.kv_cache_interface import FullAttentionSpec, KVCacheConfig


class Executor(ABC):
    """Runs steps on the model; the engine core's only door to it.

    Attributes:
        timeline: ``(start, end)`` of each step's execution in ``time.monotonic()`` seconds, recorded while it is a
            list (the engine core's ``start_timeline`` sets it, ``take_timeline`` reads it and sets ``None``).
    """

    timeline: list[tuple[float, float]] | None = None

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        """Whether :meth:`execute_model` can run a step without blocking the caller (needed by async scheduling)."""
        return False

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: Literal[False] = False) -> ModelRunnerOutput | None: ...

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: Literal[True]) -> Future[ModelRunnerOutput | None]: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        """The first half of a step, the forward pass; with ``non_block`` return a future at once. ``None`` when the
        step has tokens to sample: :meth:`sample_tokens` returns its output. Calls run in the order they were
        given."""

    @overload
    def sample_tokens(self, grammar_output: object | None,
                      non_block: Literal[False] = False) -> ModelRunnerOutput: ...

    @overload
    def sample_tokens(self, grammar_output: object | None,
                      non_block: Literal[True]) -> Future[ModelRunnerOutput]: ...

    @abstractmethod
    def sample_tokens(self, grammar_output: object | None,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """The second half of the step :meth:`execute_model` began: sampling, with the step's grammar bitmask
        (structured outputs; ``None`` without them). vLLM v0.33.0: ``vllm/v1/executor/abstract.py:Executor``."""

    @abstractmethod
    def collective_rpc(self, method: str | Callable[..., object], args: tuple[object, ...] = (),
                       kwargs: Mapping[str, object] | None = None) -> list[Any]:
        """Call ``worker.method(*args, **kwargs)`` on every worker, or ``method(worker, *args, **kwargs)`` when
        ``method`` is a function; one result per worker, by rank."""

    # -- start-up (vLLM: ``Executor.get_kv_cache_specs``, ``determine_available_memory``, ...) ----------------------
    def get_kv_cache_specs(self) -> list[dict[str, FullAttentionSpec]]:
        """Each worker's KV cache spec, layer name -> :class:`~minillm.kv_cache_interface.FullAttentionSpec`, by
        rank."""
        specs: list[dict[str, FullAttentionSpec]] = self.collective_rpc("get_kv_cache_spec")
        return specs

    def determine_available_memory(self) -> list[int]:
        """The bytes each worker can give its KV cache, by rank."""
        available: list[int] = self.collective_rpc("determine_available_memory")
        return available

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        """Have every worker allocate its KV cache (each takes its own config, by rank) and build its runner."""
        self.collective_rpc("initialize_from_config", (kv_cache_configs,))

    def compile_or_warm_up_model(self) -> None:
        """Have every worker warm its model up (nothing to do on this engine's workers)."""
        self.collective_rpc("compile_or_warm_up_model")

    def check_health(self) -> None:  # noqa: B027 - optional: one worker in-process cannot be gone
        """Raise if a worker is gone (one worker in-process: it cannot be)."""

    def shutdown(self) -> None:  # noqa: B027 - optional: nothing to release by default
        """Release the workers (and any thread the executor started)."""
