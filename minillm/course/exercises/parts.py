"""Load a learner's answers from their exercise notebooks as the engine's parts (chapter 8, the capstone).

The learner never copies code: :func:`load_learner_parts` reads the ``.ipynb`` files of a folder (``exercises/`` for
a learner, ``solutions/`` for the reference answers), runs each notebook's import lines and then its exercise cells
(the cells that start with ``# Exercise N.M:``) in a fresh namespace, and picks the functions the engine needs by
name. Only those cells run: no model is loaded, no check is repeated. A part whose exercise cell still holds the
stub (``raise NotImplementedError("Exercise N.M: ...")``) is reported as not solved.

The parts (:class:`~minillm.engine.parts.EngineParts` fields) and where they come from are listed in
:data:`PART_SOURCES`.
"""
from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import nbformat

from minillm.engine.parts import PART_NAMES, EngineParts

_TITLE = re.compile(r"^#\s*Exercise\s+(\d+\.\d+)\s*:")


@dataclasses.dataclass(frozen=True)
class PartSource:
    """Where one engine part comes from in the learner's notebooks.

    Attributes:
        part: the :class:`EngineParts` field.
        notebook: the notebook's file name (the same in ``exercises/`` and ``solutions/``).
        exercises: the exercise numbers whose answers the part uses (all must be solved).
        names: the names the exercise cells define; one name is the part itself, several are combined (the
            scheduler: one class per exercise, each overriding its own methods).
        what: a few words for reports.
    """

    part: str
    notebook: str
    exercises: tuple[str, ...]
    names: tuple[str, ...]
    what: str


PART_SOURCES: tuple[PartSource, ...] = (
    PartSource("attention", "01_attention_and_chunks.ipynb", ("1.1", "1.2"), ("chunk_attention",),
               "attention of a chunk over its prefix"),
    PartSource("allocate_slots", "02_paged_kv_cache.ipynb", ("2.2",), ("my_allocate_slots",),
               "allocating KV blocks"),
    PartSource("block_hashes", "02_paged_kv_cache.ipynb", ("2.3",), ("my_block_hashes",),
               "chained block hashes"),
    PartSource("num_cached_tokens", "02_paged_kv_cache.ipynb", ("2.4",), ("my_num_cached_tokens",),
               "prefix-cache lookup"),
    PartSource("free", "02_paged_kv_cache.ipynb", ("2.5",), ("my_free",), "freeing a request's blocks"),
    PartSource("scheduler_cls", "04_scheduler.ipynb", ("4.1", "4.2", "4.3"),
               ("RunningLoopScheduler", "AdmissionScheduler", "FCFSPreemptionScheduler"),
               "the scheduler step (running loop, admission, preemption)"),
    PartSource("top_k_top_p", "05_sampler.ipynb", ("5.1",), ("top_k_top_p_mask",), "top-k / top-p masking"),
    PartSource("check_stop", "05_sampler.ipynb", ("5.3",), ("my_check_stop",), "the stop check"),
    PartSource("prepare_inputs", "06_engine.ipynb", ("6.1",), ("my_prepare_inputs",),
               "_prepare_inputs: the flat batch"),
)
assert tuple(s.part for s in PART_SOURCES) == PART_NAMES


@dataclasses.dataclass
class PartStatus:
    """What :func:`load_learner_parts` found for one part."""

    source: PartSource
    solved: bool
    message: str  # "solved", or why not ("Exercise 2.2 is not solved yet (its cell still raises ...)")
    value: Any = None


@dataclasses.dataclass
class LearnerParts:
    """The learner's parts: ``status`` per part (in :data:`PART_NAMES` order) and the folder they came from."""

    folder: Path
    status: list[PartStatus]

    @property
    def missing(self) -> list[PartStatus]:
        return [s for s in self.status if not s.solved]

    def engine_parts(self, use_reference_for: Iterable[str] = ()) -> EngineParts:
        """The :class:`EngineParts` made of the learner's solved parts.

        Args:
            use_reference_for: part names to take from the package instead (for a chapter you skipped).

        Raises:
            AssertionError: a part is not solved (and not in ``use_reference_for``); the message names the first
                one, its exercise and its notebook.
        """
        skip = set(use_reference_for)
        unknown = skip - set(PART_NAMES)
        if unknown:
            raise ValueError(f"use_reference_for: unknown part(s) {sorted(unknown)}; the parts are {list(PART_NAMES)}")
        missing = [s for s in self.status if not s.solved and s.source.part not in skip]
        if missing:
            first = missing[0]
            others = "".join(f"\n  - part {s.source.part!r} ({s.source.what}): {s.message}" for s in missing[1:])
            names = ", ".join(repr(s.source.part) for s in missing)
            raise AssertionError(
                f"part {first.source.part!r} ({first.source.what}) is missing: {first.message}. Solve it in "
                f"{self.folder / first.source.notebook} and save the notebook."
                + (f"\nAlso missing:{others}" if others else "")
                + f"\nTo run the capstone now with the package's own part(s) in their place, set "
                  f"USE_REFERENCE_FOR = {{{names}}}")
        return EngineParts(**{s.source.part: s.value for s in self.status if s.source.part not in skip})

    def table(self) -> str:
        """One line per part: part, exercises, notebook, status."""
        rows = [f"{'part':<18} {'exercises':<14} {'notebook':<30} status"]
        for s in self.status:
            rows.append(f"{s.source.part:<18} {', '.join(s.source.exercises):<14} {s.source.notebook:<30} "
                        f"{'solved' if s.solved else s.message}")
        return "\n".join(rows)


def _imports_of(cells: list[str]) -> str:
    """The top-level ``import`` / ``from ... import`` statements of the notebook's code cells, in order."""
    out: list[str] = []
    for src in cells:
        plain = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())
        try:
            tree = ast.parse(plain)
        except SyntaxError:
            continue  # a learner's half-written cell: its imports are not needed to load the other parts
        out.extend(ast.get_source_segment(plain, node) or "" for node in tree.body
                   if isinstance(node, (ast.Import, ast.ImportFrom)))
    return "\n".join(out)


_CHECK = re.compile(r"^#\s*Check\s+Exercise\s+(\d+\.\d+)\b")


def _exercise_cells(cells: list[str]) -> dict[str, str]:
    """Exercise number -> its answer: the code cell that starts with ``# Exercise N.M:`` and every code cell after
    it up to its ``# Check Exercise N.M`` cell (where a learner may put helpers), joined in order.

    This is the cell contract each exercise cell states in its second line: keep the first line (it is how the
    answer is found), and put helpers in the exercise's cell or in new cells between it and its check.
    """
    found: dict[str, str] = {}
    current: str | None = None
    for src in cells:
        first = src.lstrip().splitlines()[0] if src.strip() else ""
        title, check = _TITLE.match(first), _CHECK.match(first)
        if title:
            current = title.group(1) if title.group(1) not in found else None
            if current is not None:
                found[current] = src
        elif check or current is None:
            current = None
        else:
            found[current] += "\n\n" + src
    return found


def _load_notebook(path: Path) -> tuple[dict[str, Any], dict[str, str], str | None]:
    """Run a notebook's imports and exercise cells. Returns ``(namespace, exercise sources, error or None)``."""
    nb = nbformat.read(path, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    ns: dict[str, Any] = {"__name__": f"learner_{path.stem}"}
    exercises = _exercise_cells(cells)
    from minillm.course.exercises import grading

    if grading.ACTIVE:  # graded: the answers run in a process of their own, and come back as proxies
        ns, error = grading.load_answers(path.stem, _imports_of(cells), exercises)
        return ns, exercises, error
    try:
        exec(compile(_imports_of(cells), f"{path.name}:imports", "exec"), ns)  # noqa: S102
    except Exception as e:  # noqa: BLE001 - reported to the learner, with the notebook's name
        return ns, exercises, f"its import lines failed: {type(e).__name__}: {e}"
    for number, src in exercises.items():
        try:
            exec(compile(src, f"{path.name}:Exercise {number}", "exec"), ns)  # noqa: S102
        except Exception as e:  # noqa: BLE001
            return ns, exercises, f"the cell of Exercise {number} failed to run: {type(e).__name__}: {e}"
    return ns, exercises, None


def _combine_scheduler(classes: list[type]) -> type:
    """One scheduler class from the three exercise classes, each contributing the methods it overrides."""
    from minillm.core.sched.scheduler import Scheduler

    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
            raise TypeError(f"{cls!r} is not a subclass of Scheduler")
    return type("LearnerScheduler", tuple(reversed(classes)), {"__doc__": "The learner's scheduler (exercises "
                                                                         "4.1-4.3), composed for the capstone."})


def load_learner_parts(folder: str | Path = ".") -> LearnerParts:
    """Read the exercise notebooks in ``folder`` and return the learner's parts with their status.

    Never raises for an unsolved or broken exercise: :meth:`LearnerParts.engine_parts` does, naming the first one.
    """
    folder = Path(folder)
    loaded: dict[str, tuple[dict[str, Any], dict[str, str], str | None]] = {}
    status: list[PartStatus] = []
    for source in PART_SOURCES:
        path = folder / source.notebook
        if not path.exists():
            status.append(PartStatus(source, False, f"{path} does not exist"))
            continue
        if source.notebook not in loaded:
            loaded[source.notebook] = _load_notebook(path)
        ns, cells, error = loaded[source.notebook]
        if error is not None:
            status.append(PartStatus(source, False, f"{source.notebook}: {error}"))
            continue
        unsolved = [n for n in source.exercises if n not in cells
                    or f"raise NotImplementedError('Exercise {n}:" in cells[n]
                    or f'raise NotImplementedError("Exercise {n}:' in cells[n]]
        if unsolved:
            n = unsolved[0]
            why = "its cell is missing" if n not in cells else "its cell still raises NotImplementedError"
            status.append(PartStatus(source, False, f"Exercise {n} is not solved yet ({why})"))
            continue
        missing = [name for name in source.names if name not in ns]
        if missing:
            status.append(PartStatus(source, False, f"the exercise cells define no {', '.join(missing)}"))
            continue
        values = [ns[name] for name in source.names]
        try:
            value = _combine_scheduler(values) if source.part == "scheduler_cls" else values[0]
        except TypeError as e:
            status.append(PartStatus(source, False, str(e)))
            continue
        status.append(PartStatus(source, True, "solved", value))
    return LearnerParts(folder, status)
