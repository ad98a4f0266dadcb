"""The engine's replaceable parts: the one seam through which chapter 8 runs a learner's own code as the engine.

Every field of :class:`EngineParts` is a function (or, for the scheduler, a class) that the engine calls at one
place, with the signature of the exercise that asks a learner to write it. The defaults are the package's own
implementations, so ``LLMEngine(model, tokenizer, args)`` and ``LLMEngine(model, tokenizer, args,
parts=EngineParts())`` are the same engine. Replace any subset:

>>> parts = EngineParts(check_stop=my_check_stop, scheduler_cls=MyScheduler)   # doctest: +SKIP
>>> engine = LLMEngine(model, tokenizer, EngineArgs(...), parts=parts)        # doctest: +SKIP

==================  ================  ================================================  =============================
field               exercise          signature                                         called by
==================  ================  ================================================  =============================
``attention``       1.2               ``(q, k, v, ctx_len) -> out``                     the model runner's attention
                                                                                        (per request, over its
                                                                                        gathered paged K/V)
``allocate_slots``  2.2               ``(pool, req_blocks, num_computed_tokens,         ``KVCacheManager.
                                      num_new_tokens, block_size) -> blocks | None``    allocate_slots``
``block_hashes``    2.3               ``(token_ids, block_size) -> [hash]``             ``KVCacheManager`` (prefix
                                                                                        cache keys)
``num_cached_tokens``  2.4            ``(block_hashes, num_tokens, block_size,          ``KVCacheManager.
                                      cached_hashes) -> int``                           get_computed_blocks``
``free``            2.5               ``(pool, req_blocks) -> None``                    ``KVCacheManager.free``
``scheduler_cls``   4.1-4.3           a :class:`Scheduler` subclass                     ``LLMEngine`` builds it
``top_k_top_p``     5.1               ``(logits, k, p) -> logits``                      ``Sampler`` (random rows)
``check_stop``      5.3               ``(request, max_model_len) -> bool``              ``Scheduler.
                                                                                        update_from_output``
``prepare_inputs``  6.1               ``(scheduler_output, requests, block_size,        ``ModelRunner.
                                      device) -> BatchInputs``                          _prepare_inputs``
==================  ================  ================================================  =============================

``attention=None`` (the default) keeps the engine's configured backend (the vectorized
:class:`~minillm.attention.torch_sdpa.TorchSDPAAttention` on a CPU, the Triton kernels on a GPU); a function there
makes the runner attend request by request through
:func:`~minillm.attention.paged.paged_attention_torch`, calling it once per request and layer. Slow, but it is the
learner's attention that runs.

The engine hands each part down to the piece that calls it as a plain function argument (:meth:`EngineParts.
scheduler_fns`, :meth:`EngineParts.model_runner_fns`): the scheduler, the KV cache manager and the model runner
never import the engine.

vLLM has no single object like this: its parts are chosen by configuration (``--attention-backend``,
``scheduler_cls`` in ``vllm/config/scheduler.py:SchedulerConfig``) and by class registries. The seam exists so a
learner's functions reach the engine without editing it and without monkey-patching.
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
