"""While a check runs a learner's answer, the package's own implementation of that exercise's part raises.

An exercise asks the learner to *build* a part of the engine that the package already has. Without a guard, an
answer that calls the package (``return compute_slot_mapping(...)``, ``return super()._schedule_waiting(step)``,
``my_contiguous_kernel = _contiguous_kernel``) gives the reference's own result and passes every comparison. So
each check calls the learner's code through :func:`guard` (or inside :func:`building`), and for as long as that code
runs, every implementation of the part listed in :data:`BUILDS` is replaced by a tripwire that raises
:class:`DelegationError`: "Exercise 2.1 asks you to write this yourself: your code called minillm's
``compute_slot_mapping`` ...".

What is replaced, and where:

- a method (``minillm.core.sched.scheduler:Scheduler._schedule_waiting``) on its class, so an instance call, a
  ``super()`` call and a call through the base class all meet the tripwire;
- a function or a Triton kernel (``minillm.attention.paged:compute_slot_mapping``) under every name that holds it:
  in every ``minillm`` and ``kernels`` module (``from x import f`` copies the name), in the namespaces of the
  learner's code (a notebook's globals, where ``from minillm... import f`` or ``my_f = f`` put it), and in the
  closure cells of the learner's functions (``f`` captured from an enclosing function).

The check's own reference calls run outside the guard, so they are never tripped. Everything is put back when the
learner's call returns or raises. Other parts of the package stay usable: exercise 2.3 may call
``hash_block_tokens`` (one block's hash) but not ``hash_request_tokens`` (the chain it asks for).

vLLM has nothing like this: it is a course's device, in the spirit of a test double.
"""
from __future__ import annotations

import functools
import importlib
import re
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

# Exercise -> the package's implementations of the part it asks for, as "module:qualname". A method is
# "module:Class.method". Only what does the exercise's whole job is listed: helpers the exercise may use stay free.
BUILDS: dict[str, tuple[str, ...]] = {
    "0.1": ("minillm.config:LlamaConfig.kv_cache_bytes_per_token", "minillm.model.llama_tp:shard_summary"),
    "0.2": ("minillm.generate:generate_tokens", "minillm.generate:generate",
            "minillm.attention.chunked:PrefillRecord.greedy_continuation", "minillm.entrypoints.llm:LLM.generate",
            "minillm.engine.llm_engine:LLMEngine.step"),
    "1.1": ("minillm.attention.reference:causal_mask",),
    "1.2": ("minillm.attention.reference:reference_attention", "minillm.attention.paged:paged_attention_torch",
            "minillm.attention.contiguous:ContiguousKVCache.forward"),
    "1.3": ("minillm.attention.reference:merge_attn_states",),
    "1.4": ("minillm.attention.contiguous:ContiguousKVCache.forward", "minillm.attention.chunked:prefill_chunk",
            "minillm.attention.chunked:chunked_prefill"),
    "2.1": ("minillm.attention.paged:compute_slot_mapping",),
    "2.2": ("minillm.core.kv_cache_manager:allocate_new_blocks",
            "minillm.core.kv_cache_manager:KVCacheManager.allocate_slots"),
    "2.3": ("minillm.core.kv_cache_utils:hash_request_tokens",),
    "2.4": ("minillm.core.kv_cache_manager:num_cached_prefix_tokens",
            "minillm.core.kv_cache_manager:KVCacheManager.get_computed_blocks"),
    "2.5": ("minillm.core.kv_cache_manager:free_request_blocks", "minillm.core.block_pool:BlockPool.free_blocks",
            "minillm.core.kv_cache_manager:KVCacheManager.free"),
    "3.1": ("kernels.attention_stages:online_softmax_step", "kernels.attention_stages:online_softmax_attention"),
    "3.2": ("kernels.attention_stages:_contiguous_kernel", "kernels.attention_stages:attention_contiguous",
            "kernels.attention_stages:_paged_one_seq_kernel", "kernels.attention_stages:attention_paged_one_seq",
            "kernels.attention_stages:_varlen_kernel", "kernels.attention_stages:attention_varlen"),
    "3.3": ("kernels.attention_stages:kv_row_offsets", "kernels.attention_stages:attention_paged_one_seq"),
    "4.1": ("minillm.core.sched.scheduler:Scheduler._schedule_running",),
    "4.2": ("minillm.core.sched.scheduler:Scheduler._schedule_waiting",
            # challenge 4's watermark scheduler admits as 4.2 does when its watermark is 0
            "minillm.course.exercises.challenges.ch04:WatermarkScheduler._schedule_waiting"),
    "4.3": ("minillm.core.sched.scheduler:Scheduler._preempt_request",
            "minillm.core.sched.scheduler:Scheduler._allocate_or_preempt"),
    "5.1": ("minillm.sample.ops.topk_topp:apply_top_k_top_p",),
    "5.2": ("minillm.sample.rejection_sampler:assemble_spec_output",),
    "5.3": ("minillm.core.sched.utils:check_stop",),
    "5.4": ("minillm.engine.detokenizer:check_stop_strings",),
    "6.1": ("minillm.worker.model_runner:prepare_inputs", "minillm.worker.model_runner:ModelRunner._prepare_inputs"),
    "6.2": ("minillm.engine.llm_engine:LLMEngine.step", "minillm.engine.core:EngineCore.step",
            "minillm.engine.core:EngineCore._update_from_output"),
    "7.1": ("minillm.distributed.splits:make_split", "minillm.distributed.splits:_cut"),
    "7.2": ("minillm.distributed.context_parallel:ContextParallelAttention._attend_block",
            "minillm.attention.reference:merge_attn_states", "minillm.attention.reference:reference_attention"),
    "8.1": ("minillm.course.exercises.capstone:run_requests", "minillm.distributed.disaggregation:run_requests",
            "minillm.entrypoints.llm:LLM.generate"),
    "9.1": ("minillm.model.parallel_layers:shard_range", "minillm.model.parallel_layers:ColumnParallelLinear.__init__",
            "minillm.model.parallel_layers:MergedColumnParallelLinear.__init__",
            "minillm.model.parallel_layers:RowParallelLinear.__init__",
            "minillm.model.llama_tp:TensorParallelMLP.__init__"),
    "9.2": ("minillm.distributed.kv_transfer.prompt_connector:PromptKVConnector.get_num_new_matched_tokens",),
    "10.1": ("minillm.worker.model_runner:ModelRunner._update_states",),
    "10.2": ("minillm.core.sched.async_scheduler:AsyncScheduler._update_after_schedule",
             "minillm.core.sched.async_scheduler:AsyncScheduler._update_request_with_output"),
    "10.3": ("minillm.model.parallel_layers:num_kv_heads_per_rank",
             "minillm.model.parallel_layers:QKVParallelLinear.__init__", "minillm.model.llama_tp:shard_summary",
             "minillm.engine.arg_utils:EngineArgs.resolved_num_gpu_blocks"),
}

# Where copies of a function's name are looked for, besides the learner's namespaces.
_PACKAGES = ("minillm", "kernels")


class DelegationError(AssertionError):
    """A learner's answer called the package's own implementation of the part its exercise asks for.

    An ``AssertionError``, so checks that let a learner's ``AssertionError`` through unchanged show it as it is.

    Attributes:
        exercise: ``"2.1"`` (or a challenge, ``"C2"``); ``target``: what was called, ``"minillm.attention.paged:compute_slot_mapping"``.
    """

    def __init__(self, exercise: str, target: str) -> None:
        self.exercise, self.target = exercise, target
        module, qualname = target.split(":")
        how = (" (a super() call, or a method your class inherits instead of defining it, counts too)"
               if "." in qualname else "")
        what = f"Challenge {exercise[1:]}" if exercise.startswith("C") else f"Exercise {exercise}"
        super().__init__(f"{what} asks you to write this yourself: your code called minillm's "
                         f"`{qualname}` (in {module}){how}. Build the part from what the exercise gives you.")


def _resolve(target: str) -> tuple[Any, str, Any]:
    """``(owner, attribute name, the object)`` for ``"module:qualname"``; the owner is a module or a class."""
    module_name, qualname = target.split(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    obj = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    return owner, name, obj


def _challenge_targets(number: str) -> tuple[str, ...] | None:
    """A chapter's open challenge ``"C2"`` keeps its reference in ``minillm.course.exercises.challenges.ch02``, whose
    ``TARGETS`` lists what a delegating answer could call; ``None`` if there is no such module."""
    m = re.fullmatch(r"C(\d+)", number)
    if not m:
        return None
    try:
        module = importlib.import_module(f"minillm.course.exercises.challenges.ch{int(m.group(1)):02d}")
    except ModuleNotFoundError:
        return None
    return tuple(module.TARGETS)


def targets_of(exercises: str | Iterable[str]) -> list[str]:
    """The targets of one exercise (``"2.1"``: :data:`BUILDS`; ``"C2"``: chapter 2's challenge) or several.
    ``ValueError`` for an unknown number."""
    numbers = [exercises] if isinstance(exercises, str) else list(exercises)
    found: list[str] = []
    for n in numbers:
        targets = BUILDS.get(n) or _challenge_targets(n)
        if targets is None:
            raise ValueError(f"no exercise {n!r} in the tripwire's list; the exercises are {sorted(BUILDS)} and the "
                             f"challenges C<chapter> of minillm/course/exercises/challenges/")
        found.extend(targets)
    return found


def _exercise_of(target: str, numbers: list[str]) -> str:
    return next(n for n in numbers if target in targets_of(n))


class _Tripwire:
    """Stands in for a function or a kernel: calling it (or launching it, ``kernel[grid](...)``) raises."""

    def __init__(self, exercise: str, target: str, original: Any) -> None:
        self.exercise, self.target, self.original = exercise, target, original
        functools.update_wrapper(self, original, updated=()) if callable(original) else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise DelegationError(self.exercise, self.target)

    def __getitem__(self, grid: Any) -> "_Tripwire":
        return self

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        # As a class attribute it behaves like the method it replaces: bound, and raising when called.
        return self if instance is None else types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"<tripwire for {self.target} (exercise {self.exercise})>"


def _learner_closures(objs: Iterable[Any]) -> list[types.CellType]:
    """The closure cells of the learner's functions (and of their classes' methods): a package function captured
    there (``f = compute_slot_mapping`` in an enclosing function) is replaced in the cell."""
    cells: list[types.CellType] = []
    todo = [o for o in objs if not isinstance(o, dict)]
    while todo:
        obj = todo.pop()
        if isinstance(obj, type):
            todo.extend(v for c in obj.__mro__ if not c.__module__.startswith(_PACKAGES) for v in vars(c).values())
            continue
        fn = getattr(getattr(obj, "fn", obj), "__func__", getattr(obj, "fn", obj))
        if isinstance(fn, types.FunctionType) and not (fn.__module__ or "").startswith(_PACKAGES):
            for cell in fn.__closure__ or ():
                if cell not in cells:
                    cells.append(cell)
                    try:
                        value = cell.cell_contents
                    except ValueError:  # an empty cell
                        continue
                    if isinstance(value, types.FunctionType) and not (value.__module__ or "").startswith(_PACKAGES):
                        todo.append(value)  # a learner helper captured by another
    return cells


def _learner_namespaces(objs: Iterable[Any]) -> list[dict[str, Any]]:
    """The global namespaces the learner's code reads its names from (a notebook's, for code defined in it)."""
    found: dict[int, dict[str, Any]] = {}

    def add_function(fn: Any) -> None:
        for _ in range(8):  # a decorated function (@torch.inference_mode()) reads its names from the one it wraps
            fn = getattr(fn, "fn", fn)  # a Triton kernel keeps its Python function as .fn
            fn = getattr(fn, "__func__", fn)
            g = getattr(fn, "__globals__", None)
            if isinstance(g, dict) and not str(g.get("__name__", "")).startswith(_PACKAGES):
                found[id(g)] = g
            fn = getattr(fn, "__wrapped__", None)
            if fn is None:
                break

    for obj in objs:
        if isinstance(obj, dict):
            if not str(obj.get("__name__", "")).startswith(_PACKAGES):
                found[id(obj)] = obj
        elif isinstance(obj, type):
            for cls in obj.__mro__:
                if not cls.__module__.startswith(_PACKAGES):
                    for value in vars(cls).values():
                        add_function(value)
        else:
            add_function(obj)
    return list(found.values())


@contextmanager
def building(exercises: str | Iterable[str], *learner: Any) -> Iterator[None]:
    """Inside the ``with`` block, the package's implementations of the exercises' parts raise
    :class:`DelegationError`.

    Args:
        exercises: ``"2.1"``, or several numbers (the capstone's scheduler: ``("4.1", "4.2", "4.3")``).
        learner: the learner's functions, classes or namespaces (dicts) whose global names must be covered too.
            The namespace of the code that opens the block is always covered.
    """
    numbers = [exercises] if isinstance(exercises, str) else list(exercises)
    owner_of = {t: n for n in numbers for t in targets_of(n)}  # target -> the exercise that asks for it
    caller = sys._getframe(2).f_globals  # noqa: SLF001 - the check cell's namespace (frame 1 is contextmanager's)
    namespaces = _learner_namespaces([*learner, caller])
    closures = _learner_closures(learner)
    undo: list[tuple[Any, str, Any]] = []  # (dict, class or closure cell, name, the value it held)
    try:
        packages = [m.__dict__ for name, m in list(sys.modules.items())
                    if name.split(".")[0] in _PACKAGES and isinstance(m, types.ModuleType)]
        for target, number in owner_of.items():
            owner, name, original = _resolve(target)
            if isinstance(original, _Tripwire):
                continue  # already guarded by an enclosing block
            wire = _Tripwire(number, target, original)
            if isinstance(owner, type):
                undo.append((owner, name, original))
                setattr(owner, name, wire)
            # A method read off its class (``f = ModelRunner._update_states``) is the plain function, a copy the
            # class attribute's replacement does not reach: it is looked for by name too, as a function is.
            copies = (original, getattr(original, "__func__", original))
            for ns in [*packages, *namespaces]:
                for key, value in list(ns.items()):
                    if any(value is c for c in copies):
                        undo.append((ns, key, value))
                        ns[key] = wire
            for cell in closures:
                try:
                    held = cell.cell_contents
                except ValueError:
                    continue
                if any(held is c for c in copies):
                    undo.append((cell, "", held))
                    cell.cell_contents = wire
        yield
    finally:
        for where, name, original in reversed(undo):
            if isinstance(where, type):
                setattr(where, name, original)
            elif isinstance(where, types.CellType):
                where.cell_contents = original
            else:
                where[name] = original


def _is_package_object(obj: Any, numbers: list[str]) -> str | None:
    """The target ``obj`` is (or wraps), if it is one of the exercises' targets."""
    for target in targets_of(numbers):
        _, _, original = _resolve(target)
        inner = obj
        for _ in range(4):
            if inner is original or getattr(inner, "fn", None) is original:
                return target
            inner = getattr(inner, "__wrapped__", None)
            if inner is None:
                break
    return None


def guard(exercises: str | Iterable[str], learner: Any) -> Any:
    """The learner's function or class, made to run inside :func:`building` each time it is called.

    - A function (or a Triton kernel's launcher) becomes a wrapper that runs it under the guard. If it *is* one of
      the package's implementations (``my_f = compute_slot_mapping``), calling the wrapper raises at once.
    - A class becomes a subclass whose methods, those the learner's own classes define, run under the guard. A
      method the exercise asks for that the class does not define (so it would inherit the package's) raises
      :class:`DelegationError` here, when the check starts.
    """
    numbers = [exercises] if isinstance(exercises, str) else list(exercises)
    if isinstance(learner, type):
        return _guard_class(numbers, learner)
    if not callable(learner):
        raise TypeError(f"guard() takes the learner's function or class, got {type(learner).__name__}: {learner!r}")
    same = _is_package_object(learner, numbers)

    @functools.wraps(learner)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if same is not None:
            raise DelegationError(_exercise_of(same, numbers), same)
        with building(numbers, learner):
            return learner(*args, **kwargs)

    guarded.__wrapped_learner__ = learner  # type: ignore[attr-defined]
    return guarded


def _guard_class(numbers: list[str], cls: type) -> type:
    learner_classes = [c for c in cls.__mro__ if not c.__module__.startswith(_PACKAGES) and c is not object]
    for target in targets_of(numbers):
        owner, name, _ = _resolve(target)
        if isinstance(owner, type) and issubclass(cls, owner):
            definer = next((c for c in cls.__mro__ if name in vars(c)), None)
            if definer is None or definer.__module__.startswith(_PACKAGES):
                raise DelegationError(_exercise_of(target, numbers), target)
    methods: dict[str, Callable[..., Any]] = {}
    for c in learner_classes:
        for key, value in vars(c).items():
            if isinstance(value, types.FunctionType) and key not in methods:
                methods[key] = value

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with building(numbers, cls):
                return fn(self, *args, **kwargs)
        return run

    guarded = type(cls.__name__, (cls,), {k: wrap(v) for k, v in methods.items()
                                          if not (k.startswith("__") and k.endswith("__"))})
    guarded.__qualname__ = cls.__qualname__
    guarded.__module__ = cls.__module__
    guarded.__wrapped_learner__ = cls  # type: ignore[attr-defined]
    return guarded
