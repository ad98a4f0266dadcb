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

vLLM has no single object like this: its parts are chosen by configuration (``--attention-backend``,
``scheduler_cls`` in ``vllm/config/scheduler.py:SchedulerConfig``) and by class registries. The seam exists so a
learner's functions reach the engine without editing it and without monkey-patching.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any


def _default(module: str, name: str) -> Any:
    # Imported when an EngineParts is made, not when this module is: the modules below import this one.
    return dataclasses.field(default_factory=lambda: getattr(importlib.import_module(module), name))


# The parts in the order the engine meets them in a step: what capstone reports list, and which failure is "first".
PART_NAMES = ("attention", "allocate_slots", "block_hashes", "num_cached_tokens", "free", "scheduler_cls",
              "top_k_top_p", "check_stop", "prepare_inputs")


@dataclasses.dataclass(frozen=True)
class EngineParts:
    """The engine's replaceable parts (see the module docstring for each signature). Defaults: the package's own."""

    attention: Callable[..., Any] | None = None
    allocate_slots: Callable[..., Any] = _default("minillm.core.kv_cache_manager", "allocate_new_blocks")
    block_hashes: Callable[..., Any] = _default("minillm.core.kv_cache_utils", "hash_request_tokens")
    num_cached_tokens: Callable[..., Any] = _default("minillm.core.kv_cache_manager", "num_cached_prefix_tokens")
    free: Callable[..., Any] = _default("minillm.core.kv_cache_manager", "free_request_blocks")
    scheduler_cls: type = _default("minillm.core.sched.scheduler", "Scheduler")
    top_k_top_p: Callable[..., Any] = _default("minillm.sample.ops.topk_topp", "apply_top_k_top_p")
    check_stop: Callable[..., Any] = _default("minillm.core.sched.utils", "check_stop")
    prepare_inputs: Callable[..., Any] = _default("minillm.worker.model_runner", "prepare_inputs")

    def __post_init__(self) -> None:
        for name in PART_NAMES:
            value = getattr(self, name)
            if name == "attention" and value is None:
                continue
            if name == "scheduler_cls":
                from minillm.core.sched.scheduler import Scheduler

                if not (isinstance(value, type) and issubclass(value, Scheduler)):
                    raise ValueError(f"EngineParts.scheduler_cls must be a subclass of minillm's Scheduler, got "
                                     f"{value!r}")
            elif not callable(value):
                raise ValueError(f"EngineParts.{name} must be a function, got {type(value).__name__}: {value!r}")

    def replaced(self) -> list[str]:
        """The names of the parts that differ from the package's own, in :data:`PART_NAMES` order."""
        default = EngineParts()
        return [n for n in PART_NAMES if getattr(self, n) is not getattr(default, n)]
