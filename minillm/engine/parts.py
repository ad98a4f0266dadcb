"""The engine's replaceable parts: the one seam through which a learner's own functions run as the engine.

Each field of :class:`EngineParts` is a function (for the scheduler, a class) the engine calls at one place, with
the signature its field's type and the piece that calls it give: attention, the KV cache manager's four functions,
the scheduler class, top-k/top-p, the stop check and ``prepare_inputs``. The defaults are the package's own; they
are handed down as plain arguments (:meth:`EngineParts.scheduler_fns`, :meth:`EngineParts.model_runner_fns`), so
the scheduler and the runner never import the engine. A function as ``attention`` is called once per request and
layer over its gathered paged K/V: slow, but it is the learner's attention that runs.

vLLM has no such object: its parts are chosen by configuration (``--attention-backend``, ``scheduler_cls`` in
``vllm/config/scheduler.py:SchedulerConfig``) and class registries.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypedDict

import torch

from minillm.core.block_pool import BlockPool
from minillm.core.kv_cache_manager import KVCacheFns, allocate_new_blocks, free_request_blocks, num_cached_prefix_tokens
from minillm.core.kv_cache_utils import BlockHash, KVCacheBlock, hash_request_tokens
from minillm.core.sched.scheduler import Scheduler
from minillm.core.sched.utils import check_stop
from minillm.request import Request
from minillm.sample.ops.topk_topp import apply_top_k_top_p
from minillm.worker.model_runner import BatchInputs, prepare_inputs

# The parts in the order the engine meets them in a step: what capstone reports list, and which failure is "first".
PART_NAMES = ("attention", "allocate_slots", "block_hashes", "num_cached_tokens", "free", "scheduler_cls",
              "top_k_top_p", "check_stop", "prepare_inputs")


class SchedulerFns(KVCacheFns, total=False):
    """The scheduler's keyword arguments: its stop check, and what it passes on to its KV cache manager."""

    check_stop_fn: Callable[[Request, int], bool]


class ModelRunnerFns(TypedDict):
    """The model runner's replaceable functions."""

    attention_fn: Callable[..., torch.Tensor] | None
    top_k_top_p: Callable[..., torch.Tensor]
    prepare_inputs_fn: Callable[..., BatchInputs]


@dataclasses.dataclass(frozen=True)
class EngineParts:
    """The engine's replaceable parts (see the module docstring for each signature). Defaults: the package's own."""

    attention: Callable[..., torch.Tensor] | None = None
    allocate_slots: Callable[..., list[KVCacheBlock] | None] = allocate_new_blocks
    block_hashes: Callable[[Sequence[int], int], list[BlockHash]] = hash_request_tokens
    num_cached_tokens: Callable[..., int] = num_cached_prefix_tokens
    free: Callable[[BlockPool, Sequence[KVCacheBlock]], None] = free_request_blocks
    scheduler_cls: type[Scheduler] = Scheduler
    top_k_top_p: Callable[..., torch.Tensor] = apply_top_k_top_p
    check_stop: Callable[[Request, int], bool] = check_stop
    prepare_inputs: Callable[..., BatchInputs] = prepare_inputs

    def __post_init__(self) -> None:
        for name in PART_NAMES:
            value = getattr(self, name)
            if name == "attention" and value is None:
                continue
            if name == "scheduler_cls":
                if not (isinstance(value, type) and issubclass(value, Scheduler)):
                    raise ValueError(f"EngineParts.scheduler_cls must be a subclass of minillm's Scheduler, got "
                                     f"{value!r}")
            elif not callable(value):
                raise ValueError(f"EngineParts.{name} must be a function, got {type(value).__name__}: {value!r}")

    def replaced(self) -> list[str]:
        """The names of the parts that differ from the package's own, in :data:`PART_NAMES` order."""
        default = EngineParts()
        return [n for n in PART_NAMES if getattr(self, n) is not getattr(default, n)]

    def kv_cache_fns(self) -> KVCacheFns:
        """The KV cache manager's functions, as :class:`~minillm.core.kv_cache_manager.KVCacheManager` takes them."""
        return KVCacheFns(allocate_fn=self.allocate_slots, block_hashes_fn=self.block_hashes,
                          num_cached_tokens_fn=self.num_cached_tokens, free_fn=self.free)

    def scheduler_fns(self) -> SchedulerFns:
        """The scheduler's keyword arguments: its stop check, and the functions it passes on to its KV cache
        manager."""
        return SchedulerFns(check_stop_fn=self.check_stop, **self.kv_cache_fns())

    def model_runner_fns(self) -> ModelRunnerFns:
        """The model runner's keyword arguments: attention (``None``: the configured backend), the sampler's
        top-k/top-p filter and the input build."""
        return ModelRunnerFns(attention_fn=self.attention, top_k_top_p=self.top_k_top_p,
                              prepare_inputs_fn=self.prepare_inputs)
