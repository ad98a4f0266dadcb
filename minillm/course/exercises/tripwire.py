"""While a check runs a learner's answer, the package's own implementation of that exercise's part raises.

An exercise asks the learner to *build* a part of the engine that the package already has. Without a guard, an
answer that calls the package (``return compute_slot_mapping(...)``, ``return super()._schedule_waiting(step)``,
``my_contiguous_kernel = _contiguous_kernel``) gives the reference's own result and passes every comparison. So
each check calls the learner's code through :func:`guard` (or inside :func:`building`), and for as long as that code
runs, every implementation of the part listed in :data:`BUILDS` is replaced by a tripwire that raises
:class:`DelegationError`: "Exercise 2.1 asks you to write this yourself: your code called minillm's
``compute_slot_mapping`` ...".

How: nothing is replaced. While the learner's code runs, a profile function (``sys.setprofile``) sees every
Python call, and a call whose code is a target's (the function, the method, a Triton kernel's launch) or a copy of
it raises. So the name that reached it does not matter: an import, an alias, ``super()``, a default argument that
captured the function before the check started, a container, ``functools.partial``, a copied code object, the
module loaded again. A refusal the answer catches still fails the call (:func:`guard`).

The check's own reference calls run outside the guard, so they are never tripped. Other parts of the package stay
usable: exercise 2.3 may call ``hash_block_tokens`` (one block's hash) but not ``hash_request_tokens`` (the chain it
asks for).

In a learner's kernel the answer and the check share one interpreter, so this is a teacher's aid, not a wall: when
an exercise is graded, the answer runs in a process of its own (:mod:`minillm.course.exercises.grading`) and the
guard runs there.

vLLM has nothing like this: it is a course's device, in the spirit of a test double.
"""
from __future__ import annotations

import importlib
import re
import sys
import threading
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
    "6.1": ("minillm.worker.model_runner:prepare_inputs", "minillm.worker.model_runner:ModelRunner.prepare_inputs"),
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
    "10.1": ("minillm.worker.model_runner:ModelRunner.finish_requests",
             "minillm.worker.model_runner:ModelRunner.add_requests", "minillm.worker.model_runner:ModelRunner._add",
             "minillm.worker.model_runner:ModelRunner.update_requests"),
    "10.2": ("minillm.core.sched.async_scheduler:AsyncScheduler._update_after_schedule",
             "minillm.core.sched.async_scheduler:AsyncScheduler._update_request_with_output"),
    "10.3": ("minillm.model.parallel_layers:num_kv_heads_per_rank",
             "minillm.model.parallel_layers:QKVParallelLinear.__init__", "minillm.model.llama_tp:shard_summary",
             "minillm.engine.arg_utils:EngineArgs.resolved_num_gpu_blocks"),
    "10.4": ("kernels.input_batch:_prepare_pos_seq_lens_kernel", "kernels.input_batch:prepare_pos_seq_lens",
             "kernels.input_batch:prepare_pos_seq_lens_ref"),
}

# Where copies of a function's name are looked for, besides the learner's namespaces.
_PACKAGES = ("minillm", "kernels")


class DelegationError(AssertionError):
    """A learner's answer called the package's own implementation of the part its exercise asks for.

    An ``AssertionError``, so checks that let a learner's ``AssertionError`` through unchanged show it as it is.

    Attributes:
        exercise: ``"2.1"`` (or a challenge, ``"C2"``); ``target``: what was called,
            ``"minillm.attention.paged:compute_slot_mapping"``.
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


class Trip:
    """What :func:`building` caught: the exercise and the target the answer reached (``None`` if nothing)."""

    def __init__(self) -> None:
        self.exercise: str | None = None
        self.target: str | None = None


def _innermost(obj: Any) -> Any:
    """The function whose code runs when ``obj`` is called: through ``staticmethod``/``classmethod``, decorators
    (``__wrapped__``) and a Triton kernel's ``.fn``."""
    for _ in range(8):
        inner = getattr(obj, "__func__", None) or getattr(obj, "__wrapped__", None)
        if inner is None and not isinstance(obj, types.FunctionType):
            inner = getattr(obj, "fn", None)
        if inner is None:
            return obj
        obj = inner
    return obj


def _is_kernel(obj: Any) -> bool:
    return type(obj).__name__ in ("JITFunction", "Autotuner", "Heuristics", "InterpretedFunction")


class _Watch:
    """The code objects of the active targets, and the profile function that refuses them."""

    def __init__(self) -> None:
        self.stack: list[tuple[list[str], Trip]] = []
        self.codes: dict[str, list[tuple[types.CodeType, str, str]]] = {}  # co_name -> (code, exercise, target)
        self.kernels: dict[int, tuple[str, str]] = {}  # id(code of a kernel's Python function) -> ...
        self.kernel_run_codes: set[types.CodeType] = set()
        self.previous: Any = None

    def _load(self) -> None:
        self.codes, self.kernels = {}, {}
        for numbers, _ in self.stack:
            for target in targets_of(numbers):
                number = _exercise_of(target, numbers)
                _, _, obj = _resolve(target)
                fn = _innermost(obj)
                code = getattr(fn, "__code__", None)
                if isinstance(code, types.CodeType):
                    self.codes.setdefault(code.co_name, []).append((code, number, target))
                if _is_kernel(obj) or _is_kernel(getattr(obj, "fn", None)):
                    self.kernel_run_codes |= _kernel_run_codes()
                    for code_name in ("run", "__call__"):
                        self.codes.setdefault(code_name, [])

    def match(self, frame: types.FrameType) -> tuple[str, str] | None:
        code = frame.f_code
        if code in self.kernel_run_codes:
            launched = frame.f_locals.get("self")
            inner = getattr(_innermost(launched), "__code__", None)
            if isinstance(inner, types.CodeType):
                for target_code, number, target in self.codes.get(inner.co_name, ()):
                    if _same_code(inner, target_code):
                        return number, target
            return None
        for target_code, number, target in self.codes.get(code.co_name, ()):
            if _same_code(code, target_code):
                return number, target
        return None

    def profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_name not in self.codes:
            return
        hit = self.match(frame)
        if hit is not None:
            number, target = hit
            for _, trip in self.stack:
                if trip.target is None:
                    trip.exercise, trip.target = number, target
            global _LAST
            _LAST = (number, target)
            raise DelegationError(number, target)


def _same_code(code: types.CodeType, target: types.CodeType) -> bool:
    """The target's code, or a copy of it: the same object, an equal one (``code.replace()``, the module loaded
    again), or the same place in the same file. (Not "the same bytecode": an honest answer may compile to the very
    bytecode of the package's method, and the lint refuses ``exec``/``compile`` that could copy it from source.)"""
    return (code is target or code == target
            or (code.co_filename == target.co_filename and code.co_firstlineno == target.co_firstlineno))


def _kernel_run_codes() -> set[types.CodeType]:
    """The code of Triton's kernel launch (``kernel[grid](...)`` ends in ``JITFunction.run``), if Triton is loaded."""
    found: set[types.CodeType] = set()
    jit = sys.modules.get("triton.runtime.jit")
    interpreter = sys.modules.get("triton.runtime.interpreter")
    for cls in (getattr(jit, "JITFunction", None), getattr(interpreter, "InterpretedFunction", None)):
        for name in ("run", "__call__"):
            fn = getattr(cls, name, None) if cls is not None else None
            if isinstance(fn, types.FunctionType):
                found.add(fn.__code__)
    return found


_WATCH = _Watch()
_LAST: tuple[str, str] | None = None


def tripped() -> tuple[str, str] | None:
    """``(exercise, target)`` of the last refusal in this process, or ``None``."""
    return _LAST


def active_exercises() -> list[str]:
    """The exercises of the innermost open :func:`building` block (``[]`` outside any)."""
    return list(_WATCH.stack[-1][0]) if _WATCH.stack else []


def _remote_grading() -> bool:
    grading = sys.modules.get("minillm.course.exercises.grading")
    return bool(getattr(grading, "ACTIVE", False))


@contextmanager
def building(exercises: str | Iterable[str], *learner: Any) -> Iterator[Trip]:
    """Inside the ``with`` block, running the package's implementation of the exercises' parts raises
    :class:`DelegationError`, whatever name reached it.

    The refusal is by code, not by name: a profile function (``sys.setprofile``) watches every Python call and
    refuses one whose code is a target's, or a copy of it (:func:`_same_code`): a default argument holding the
    package's function, an alias, a container, ``functools.partial``, a bound method, a copied code object, the
    module loaded again, a Triton kernel launched under another name. Nothing is replaced, so there is no original
    to hand back.

    Yields a :class:`Trip`; if the answer catches the refusal and goes on, ``trip.target`` still says what it
    reached (:func:`guard` then fails the call). In the grading process (:mod:`minillm.course.exercises.grading`),
    where no answer runs, the block only names the exercises for the calls that go to the answer's process.

    Args:
        exercises: ``"2.1"``, or several numbers (the capstone's scheduler: ``("4.1", "4.2", "4.3")``).
        learner: accepted for compatibility; the refusal no longer needs the learner's namespaces.
    """
    numbers = [exercises] if isinstance(exercises, str) else list(exercises)
    targets_of(numbers)  # ValueError for an unknown number, before anything starts
    trip = Trip()
    outermost = not _WATCH.stack
    _WATCH.stack.append((numbers, trip))
    watching = not _remote_grading()
    try:
        if watching:
            _WATCH._load()
            if outermost:
                _WATCH.previous = sys.getprofile()
                # Threads started inside the block are watched too (those started before it are refused by the
                # answer lint, rule "thread").
                threading.setprofile(_WATCH.profile)
            sys.setprofile(_WATCH.profile)
        yield trip
    finally:
        _WATCH.stack.pop()
        if watching:
            if outermost:
                threading.setprofile(None)
                sys.setprofile(_WATCH.previous)
                _WATCH.previous = None
            else:
                _WATCH._load()
                sys.setprofile(_WATCH.profile)


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
      the package's implementations (``my_f = compute_slot_mapping``), calling the wrapper raises at once. If the
      answer reached the package's implementation and caught the refusal, the call still fails.
    - A class becomes a subclass whose methods, those the learner's own classes define, run under the guard. A
      method the exercise asks for that the class does not define (so it would inherit the package's) raises
      :class:`DelegationError` here, when the check starts.

    The wrapper keeps the learner's name and docstring but holds no reference a caller could unwrap
    (``__wrapped__``). While grading (:mod:`minillm.course.exercises.grading`) an answer the lint refused raises
    its :class:`~minillm.course.exercises.lint.AnswerRefused` here.
    """
    numbers = [exercises] if isinstance(exercises, str) else list(exercises)
    grading = sys.modules.get("minillm.course.exercises.grading")
    if grading is not None:
        grading.raise_if_refused(numbers, learner)
    if not getattr(grading, "ACTIVE", False):
        _lint_in_kernel(numbers)
    if isinstance(learner, type):
        return _guard_class(numbers, learner)
    if not callable(learner):
        raise TypeError(f"guard() takes the learner's function or class, got {type(learner).__name__}: {learner!r}")
    same = _is_package_object(learner, numbers)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if same is not None:
            raise DelegationError(_exercise_of(same, numbers), same)
        return _run_guarded(numbers, learner, args, kwargs)

    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        try:
            setattr(guarded, attr, getattr(learner, attr))
        except (AttributeError, TypeError):
            pass
    if hasattr(learner, "__getitem__") and not isinstance(learner, type):  # a Triton kernel: kernel[grid](...)
        return _GuardedKernel(numbers, learner, guarded)
    return guarded


def _lint_in_kernel(numbers: list[str]) -> None:
    """In a learner's kernel, lint the answer as grading will (:mod:`minillm.course.exercises.lint`), so a
    refused answer is refused here too, with the same message: the answer is the last cell run whose first line is
    the exercise's title, and the cells run after it up to a check cell. Nothing happens outside IPython."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    if not history:
        return
    from minillm.course.exercises.build import answer_number
    from minillm.course.exercises.lint import check_answer

    for number in numbers:
        start = None
        for i in range(len(history) - 1, -1, -1):
            if answer_number(history[i].lstrip()) == number:
                start = i
                break
        if start is None:
            continue
        region = [history[start]]
        for src in history[start + 1:]:
            if src.lstrip().startswith("# Check") or answer_number(src.lstrip()):
                break
            region.append(src)
        try:
            check_answer("\n\n".join(region), number)
        except SyntaxError:
            pass


def _run_guarded(numbers: list[str], fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` under :func:`building`; a refusal the answer caught still fails the call."""
    with building(numbers) as trip:
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            if trip.target is not None:
                raise DelegationError(trip.exercise or numbers[0], trip.target) from None
            raise
    if trip.target is not None:
        raise DelegationError(trip.exercise or numbers[0], trip.target)
    return result


class _GuardedKernel:
    """A learner's Triton kernel under the guard: ``kernel[grid](...)`` and ``kernel(...)`` run in
    :func:`building`."""

    def __init__(self, numbers: list[str], kernel: Any, call: Callable[..., Any]) -> None:
        self._numbers, self._kernel, self._call = numbers, kernel, call
        self.__name__ = getattr(kernel, "__name__", "kernel")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        same = _is_package_object(self._kernel, self._numbers)
        launcher = self._kernel[grid]

        def launch(*args: Any, **kwargs: Any) -> Any:
            if same is not None:
                raise DelegationError(_exercise_of(same, self._numbers), same)
            return _run_guarded(self._numbers, launcher, args, kwargs)
        return launch


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
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _run_guarded(numbers, fn, (self, *args), kwargs)
        run.__name__, run.__qualname__, run.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
        return run

    guarded = type(cls.__name__, (cls,), {k: wrap(v) for k, v in methods.items()
                                          if not (k.startswith("__") and k.endswith("__"))})
    guarded.__qualname__ = cls.__qualname__
    guarded.__module__ = cls.__module__
    return guarded
