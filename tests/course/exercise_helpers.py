"""Run one exercise's check cell of a solution notebook against a deliberately wrong answer.

``run_check(solution, "2.2", my_allocate_slots=wrong)`` executes the notebook's code cells in one namespace, in
order, up to and including the ``# Check Exercise 2.2`` cell; right after the ``# Exercise 2.2`` cell it replaces the
given names. It returns the exception the check cell raised (``None`` if it passed). Cells of later exercises are not
run, nor the check cells of earlier ones (each is tested on its own; running them again made every kept wrong answer
of a notebook's last exercise pay for all its checks). IPython line magics (``%matplotlib inline``) are skipped: the cells run as plain Python with the Agg backend.

Tests of typical mistakes use it to prove that a check fails on them, and says why.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import itertools
import linecache
import os
import random
import re
import sys
import types
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

import matplotlib
import nbformat
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]


_cell_numbers = itertools.count()


def _plain_python(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def _compile_cell(source: str, label: str):
    """Compile one cell under a name of its own, with its text in linecache, as IPython does: Triton's
    interpreter reads a kernel's source back (inspect.getsourcelines), so a kernel defined in a cell needs it."""
    name = f"<{label}:{next(_cell_numbers)}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    return compile(source, name, "exec")


def run_check(solution: str | Path, exercise: str, **replace: Any) -> BaseException | None:
    """Execute ``solution`` (a path, or a name under ``solutions/``) up to the check of ``exercise`` ("N.M"), with
    ``replace`` swapped in after the exercise's own cell. Returns what the check cell raised, or ``None``."""
    return _run_check(solution, exercise, None, replace, skip_exercise_checks=True)


def run_check_after_setup(solution: str | Path, exercise: str, **replace: Any) -> BaseException | None:
    """:func:`run_check` running, of the cells before the exercise, only the set-up cells (``# Environment set-up``
    first line): for an exercise whose check needs nothing the notebook computed before it (seconds, not a whole
    notebook's run per test)."""
    return _run_check(solution, exercise, None, replace, setup_only=True, skip_exercise_checks=True)


def run_check_with_answer(solution: str | Path, exercise: str, answer: str,
                          setup_only: bool = False) -> BaseException | None:
    """:func:`run_check` with the exercise's cell replaced by ``answer`` (a cell's source), as a learner hands it
    in. ``exercise`` is "N.M", or "N" for chapter N's challenge. With ``setup_only``, of the cells before the
    exercise only the set-up cells run (``# Environment set-up`` first line): for a challenge at the end of a long
    notebook. Returns what the check cell raised, or ``None``."""
    return _run_check(solution, exercise, answer, {}, setup_only, skip_exercise_checks=True)


# Notebooks whose later cells read names an earlier check cell defines (07: make_split, imported in 7.1's check; 09:
# the shards of 9.1's check): their earlier checks always run.
CHECKS_FEED_LATER_CELLS = {"07_context_parallel.ipynb", "09_disaggregation_and_tp.ipynb"}


def run_challenge(solution: str | Path, chapter: int | str, setup_only: bool = False,
                  **replace: Any) -> BaseException | None:
    """:func:`run_check` for chapter ``chapter``'s open challenge (``4``, ``"4"`` or ``"C4"``): the notebook's code
    cells up to its ``# Check Challenge N`` cell, the exercises' check cells left out (they are tested on their own),
    with ``replace`` swapped in after the ``# Challenge N:`` cell. ``setup_only``: as in
    :func:`run_check_with_answer`. Returns what the check raised, or ``None``."""
    number = str(chapter).removeprefix("C")
    return _run_check(solution, number, None, replace, setup_only, skip_exercise_checks=True)


def run_check_armed(solution: str | Path, exercise: str, arm: Callable[[], None],
                    **replace: Any) -> BaseException | None:
    """:func:`run_check` that calls ``arm()`` right before the check cell runs (after the lesson's cells, which may
    call the package's functions for their own purposes): :class:`ReferenceOrder` starts watching there."""
    return _run_check(solution, exercise, None, replace, skip_exercise_checks=True, before_check=arm)


def _first_line(cell: nbformat.NotebookNode) -> str:
    return cell.source.lstrip().splitlines()[0] if cell.source.strip() else ""


def _run_check(solution: str | Path, exercise: str, answer: str | None, replace: dict[str, Any],
               setup_only: bool = False, skip_exercise_checks: bool = False,
               before_check: Callable[[], None] | None = None) -> BaseException | None:
    path = Path(solution)
    if not path.is_absolute() and not path.exists():
        path = ROOT / "solutions" / path
    nb = nbformat.read(path, as_version=4)
    matplotlib.use("Agg")
    cwd = os.getcwd()
    os.chdir(path.parent)  # as Jupyter runs a notebook: relative paths from its own folder
    kind = "Exercise" if "." in exercise else "Challenge"  # "2.1", or "2" for chapter 2's challenge
    skip_exercise_checks = skip_exercise_checks and path.name not in CHECKS_FEED_LATER_CELLS
    code = [c for c in nb.cells if c.cell_type == "code"]
    at = next((i for i, c in enumerate(code) if _first_line(c).startswith(f"# {kind} {exercise}:")), len(code))
    try:
        key = (path.resolve(), kind, exercise, setup_only, skip_exercise_checks)
        shared = _SHARED_PREFIXES.get(key) if _SHARED_PREFIXES is not None else None
        if shared is not None:
            ns = shared.namespace()
        else:
            ns = {"__name__": "__main__"}
            _run_prefix(code[:at], ns, path.name, kind, exercise, setup_only, skip_exercise_checks)
            if _SHARED_PREFIXES is not None and _Prefix.shareable(ns):
                _SHARED_PREFIXES[key] = _Prefix(ns)
                ns = _SHARED_PREFIXES[key].namespace()
        for cell in code[at:]:
            first = _first_line(cell)
            if re.match(rf"# Check {kind} {re.escape(exercise)}(?=$|[\s,])", first) is not None:
                if before_check is not None:
                    before_check()
                try:
                    exec(_compile_cell(_plain_python(cell.source), f"{path.name}:check {exercise}"), ns)  # noqa: S102
                except BaseException as e:  # noqa: BLE001 - the caller asserts on it
                    return e
                return None
            is_exercise = first.startswith(f"# {kind} {exercise}:")
            source = answer if is_exercise and answer is not None else cell.source
            if skip_exercise_checks and first.startswith("# Check Exercise"):
                continue  # the earlier exercises' checks: each is tested on its own, and running them is slow
            exec(_compile_cell(_plain_python(source), f"{path.name}:cell"), ns)  # noqa: S102
            if is_exercise:
                missing = [k for k in replace if k not in ns]
                if missing:
                    raise LookupError(f"exercise {exercise} of {path.name} defines no {missing}")
                ns.update(replace)
        raise LookupError(f"{path.name} has no '# Check Exercise {exercise}' cell")
    finally:
        os.chdir(cwd)


def _run_prefix(cells: list[nbformat.NotebookNode], ns: dict[str, Any], name: str, kind: str, exercise: str,
                setup_only: bool, skip_exercise_checks: bool) -> None:
    """The cells before the exercise's own, into ``ns``: only the set-up cells with ``setup_only``, and not the
    earlier exercises' checks with ``skip_exercise_checks``."""
    for cell in cells:
        first = _first_line(cell)
        if re.match(rf"# Check {kind} {re.escape(exercise)}(?=$|[\s,])", first) is not None:
            raise LookupError(f"{name}: the check of exercise {exercise} comes before its exercise cell")
        if setup_only and not first.startswith("# Environment set-up"):
            continue
        if skip_exercise_checks and first.startswith("# Check Exercise"):
            continue  # the earlier exercises' checks: each is tested on its own, and running them is slow
        exec(_compile_cell(_plain_python(cell.source), f"{name}:cell"), ns)  # noqa: S102


# -- one run of a notebook's cells before an exercise, shared by the tests of that exercise -----------------------------
# key (notebook, kind, exercise, setup_only, skip_exercise_checks) -> the namespace after those cells; None: off.
_SHARED_PREFIXES: dict[tuple, _Prefix] | None = None


class _Prefix:
    """The namespace after a notebook's cells before an exercise, and the random generators' states there. Each
    :meth:`namespace` is a deep copy of it, as a fresh run would leave it: values copied (the state a check or a
    wrong answer may change), functions rebound to the copy (a function of the notebook that appends to one of its
    lists appends to the copy's), and the random generators set back. Modules, models and tokenizers are shared,
    as every test of a file shares the session's model (conftest's ``smollm``). A function of the notebook kept
    inside a value rather than under its own name keeps the first run's globals."""

    def __init__(self, ns: dict[str, Any]) -> None:
        self.ns = ns
        self.rng = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())

    @staticmethod
    def shareable(ns: dict[str, Any]) -> bool:
        """No class made by the cells (its methods would keep the first run's globals, which a copy cannot
        rebind), and a copy can be made (no lock or thread in the state); else each test runs the cells."""
        if any(isinstance(v, type) and v.__module__ == "__main__" for v in ns.values()):
            return False
        try:
            _Prefix(ns).namespace()
        except (TypeError, copy.Error):
            return False
        return True

    def namespace(self) -> dict[str, Any]:
        copy_ns: dict[str, Any] = {}
        memo: dict[int, Any] = {id(self.ns): copy_ns}
        for name, value in self.ns.items():
            if name == "__builtins__" or isinstance(value, (types.ModuleType, torch.nn.Module)) or type(
                    value).__module__.startswith(("transformers.", "tokenizers.")):
                memo[id(value)] = value
            elif isinstance(value, types.FunctionType) and value.__globals__ is self.ns:
                f = types.FunctionType(value.__code__, copy_ns, value.__name__, value.__defaults__,
                                       value.__closure__)
                f.__kwdefaults__, f.__qualname__ = value.__kwdefaults__, value.__qualname__
                f.__dict__.update(value.__dict__)
                memo[id(value)] = f
        copy_ns.update({name: copy.deepcopy(value, memo) for name, value in self.ns.items()})
        random.setstate(self.rng[0])
        np.random.set_state(self.rng[1])
        torch.random.set_rng_state(self.rng[2])
        return copy_ns


@contextlib.contextmanager
def shared_prefixes() -> Iterator[None]:
    """Within it, the tests of one exercise run the notebook's cells before it once (the first test), and each
    gets a fresh copy of what they left (see :class:`_Prefix`): for a file whose tests each re-ran seconds of a
    notebook's lesson cells before the exercise's check."""
    global _SHARED_PREFIXES
    _SHARED_PREFIXES = {}
    try:
        yield
    finally:
        _SHARED_PREFIXES = None


_counter = itertools.count()


def caught(solution: str, exercise: str, **wrong) -> str:
    """The message of the AssertionError the check of ``exercise`` raises on ``wrong``; fails if it raises nothing
    or something else."""
    e = run_check(solution, exercise, **wrong)
    assert isinstance(e, AssertionError), f"check {exercise} did not fail with an AssertionError on {wrong}: {e!r}"
    return str(e)


def exercise_source(solution: str, exercise: str) -> str:
    """The source of exercise ``exercise``'s cell ("2.1"), or of a challenge's ("C2")."""
    nb = nbformat.read(ROOT / "solutions" / solution, as_version=4)
    title = f"# Challenge {exercise[1:]}:" if exercise.startswith("C") else f"# Exercise {exercise}:"
    return next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith(title))


def mutated(solution: str, exercise: str, name: str, *edits: tuple[str, str], header: str = "",
            tmp_path: Path | None = None):
    """``name`` from the solution's exercise cell with each ``(old, new)`` edit applied (each must apply once).

    With ``tmp_path`` the code is written to a file and imported (Triton kernels need a source file)."""
    source = exercise_source(solution, exercise)
    for old, new in edits:
        assert source.count(old) == 1, f"edit {old!r} does not apply once to exercise {exercise}"
        source = source.replace(old, new)
    if tmp_path is None:
        ns: dict = {}
        exec(compile(header + source, f"<wrong {exercise}>", "exec"), ns)  # noqa: S102
        return ns[name]
    path = tmp_path / f"wrong_{exercise.replace('.', '_')}_{next(_counter)}.py"
    path.write_text(header + source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


# The course-wide exercise format (issue 24), checked by each chapter's test file.
EXERCISE_HEADING = re.compile(r"^### Exercise (\d+\.\d+) (★{1,3}) \S")
# Two folded hints in one cell, each with its English text and then its Chinese **提示 N：** paragraph.
_BLOCK = r"(?:(?!</details>|<details>).)*"
HINT_FORMAT = re.compile(r"^<details><summary>Hint 1: the idea</summary>\n" + _BLOCK + r"[A-Za-z]" + _BLOCK
                         + r"\n\*\*提示 1：\*\* \S" + _BLOCK + r"\n</details>\n"
                         r"<details><summary>Hint 2: closer to the code</summary>\n" + _BLOCK + r"[A-Za-z]" + _BLOCK
                         + r"\n\*\*提示 2：\*\* \S" + _BLOCK + r"\n</details>$", re.S)
CHALLENGE_HEADING = re.compile(r"^### Challenge (\d+) (★★★?) \S.* \(optional, extra credit\)\n")  # its stars: its credit


# -- the order of a check: the answer of a case first, then the reference ---------------------------------------------
def case_key(value: Any) -> Hashable:
    """A hashable name for a case's arguments, equal for equal values (a deep copy of a case has the same key):
    tensors and arrays by shape, dtype and bytes, containers element by element, other objects by ``repr``."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return ("tensor", tuple(t.shape), str(t.dtype), hashlib.sha1(t.view(torch.uint8).numpy().tobytes()
                                                                     if t.numel() else b"").hexdigest())
    if isinstance(value, np.ndarray):
        return ("array", value.shape, str(value.dtype), hashlib.sha1(np.ascontiguousarray(value).tobytes()).hexdigest())
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), case_key(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(case_key(v) for v in value))
    if isinstance(value, (int, float, str, bytes, bool, type(None))):
        return value
    return ("repr", repr(value))


class ReferenceOrder:
    """Watches a check: the learner's answer of each case must run before the reference of that case, and no result
    of the reference may be within the answer's reach while it runs.

    Wrap the answer with :meth:`answer` and the package function the check calls as its reference with
    :meth:`reference`; nothing is recorded until :meth:`arm` (so a lesson cell may call the package's function).
    A case is named by ``key(args, kwargs)`` when given (the answer's and the reference's calls of one case must give
    the same key), else by its number: the n-th answer call and the n-th reference call are the n-th case. With
    ``callers``, only the reference calls made by a function of one of those names count (the capstone's reference
    scheduler also calls the reference's KV-cache parts, outside the comparison of a part).

    At each answer call it records a violation if the reference already ran for that case, and, with
    ``track_results``, if a result the reference returned (``"any"``: for any case so far; ``"same case"``: for this
    case, asked again) is a local of any calling frame (a notebook global included), an element of a container
    there, an argument of the answer, or an attribute of one. At each reference call (cases by number) it records a
    violation if the answer of that case has not run. :meth:`assert_in_order` raises
    with the violations, and if either side never ran.
    """

    def __init__(self, key: Callable[[tuple, dict], Hashable] | None = None, track_results: str | None = None,
                 callers: set[str] | None = None) -> None:
        self.key, self.track_results, self.callers = key, track_results, callers
        self.armed = False
        self.answers: list[Hashable] = []      # the case of each answer call, in order
        self.references: list[Hashable] = []   # the case of each reference call, in order
        self.results: list[tuple[Hashable, Any]] = []  # (case, result): kept alive, so that their ids stay unique
        self.violations: list[str] = []

    def arm(self) -> None:
        self.armed = True

    def _case(self, args: tuple, kwargs: dict, calls: list[Hashable]) -> Hashable:
        return self.key(args, kwargs) if self.key is not None else len(calls)

    def answer(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def answer(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                case = self._case(args, kwargs, self.answers)
                # A case may come twice (random cases): its reference may have run as often as its answer did.
                if self.references.count(case) > self.answers.count(case):
                    self.violations.append(f"answer call {len(self.answers)}: the reference already ran for its case")
                if self.track_results:
                    where = self._result_in_reach(sys._getframe(1), args, kwargs, case)
                    if where:
                        self.violations.append(f"answer call {len(self.answers)}: a reference result is within "
                                               f"its reach ({where})")
                self.answers.append(case)
            return fn(*args, **kwargs)

        return answer

    def reference(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def reference(*args: Any, **kwargs: Any) -> Any:
            if not self.armed or (self.callers is not None and sys._getframe(1).f_code.co_name not in self.callers):
                return fn(*args, **kwargs)
            case = self._case(args, kwargs, self.references)
            if self.key is None and case not in self.answers:  # by key, a later answer of this case says it
                self.violations.append(f"reference call {len(self.references)}: the answer of its case has not run")
            self.references.append(case)
            result = fn(*args, **kwargs)
            if self.track_results and result is not None:
                self.results.append((case, result))
            return result

        return reference

    def _result_in_reach(self, frame: Any, args: tuple, kwargs: dict, case: Hashable) -> str | None:
        results = [r for c, r in self.results if self.track_results == "any" or c == case]
        ids = {id(r) for r in results}
        ids |= {id(x) for r in results if isinstance(r, (tuple, list)) for x in r}

        def found(value: Any) -> bool:
            if id(value) in ids:
                return True
            if isinstance(value, (list, tuple)):
                return any(id(v) in ids for v in value)
            if isinstance(value, dict):
                return any(id(v) in ids for v in value.values())
            return False

        for i, value in enumerate([*args, *kwargs.values()]):
            if found(value) or any(found(v) for v in getattr(value, "__dict__", {}).values()):
                return f"argument {i}, or an attribute of it"
        while frame is not None:
            for name, value in frame.f_locals.items():
                if found(value):
                    return f"{name!r} in {frame.f_code.co_name} ({frame.f_code.co_filename})"
            frame = frame.f_back
        return None

    def assert_in_order(self, min_cases: int = 1) -> None:
        assert not self.violations, "\n".join(self.violations[:5])
        assert len(self.answers) >= min_cases and len(self.references) >= min_cases, (
            f"{len(self.answers)} answer calls and {len(self.references)} reference calls were watched, expected "
            f"{min_cases} of each at least")
