"""``python -m minillm.course.exercises nbgrader DIR``: an nbgrader course directory built from ``solutions/``.

nbgrader (https://nbgrader.readthedocs.io, the ``[classroom]`` extra) hands out, collects and autogrades notebooks.
The solution notebooks stay the single source; this module writes, for each of them,

- ``DIR/source/<stem>/<stem>.ipynb``: the solution notebook with nbgrader's cell metadata. Each exercise cell (the one
  with ``### BEGIN SOLUTION``) becomes an *autograded answer* cell (``grade_id`` ``ex-N-M-answer``); each
  ``# Check Exercise N.M`` cell becomes a read-only *autograder test* cell (``ex-N-M-check``) worth the exercise's
  points. The ids come from the exercise numbers, so they stay the same across rebuilds. Every other cell is left as
  it is (nbgrader does not need ids on them).
- ``DIR/nbgrader_config.py``: the course id, the course root, the assignments, and the settings that make
  ``nbgrader generate_assignment`` write exactly ``exercises/``: its solution-clearing step is replaced by
  :class:`ExerciseClearSolutions` (configured by :func:`generate_assignment_preprocessors`), which writes our stub,
  ``raise NotImplementedError('<the cell's "# Exercise N.M: ..." title>')``, where nbgrader's own writes the same
  ``raise NotImplementedError()`` everywhere; and autograding scores a check cell pass or fail
  (:class:`ExerciseSaveAutoGrades`: an error is 0 points, anything else all of them), where nbgrader's own rule
  would read a number the cell displays as partial credit and output on stderr as a failure.

A chapter's open challenge (``### Challenge N ★★★``, ``# Challenge N: ...``, ``# Check Challenge N``) becomes the
same two cells (``challenge-N-answer``, ``challenge-N-check``); its check is worth 0 points and, when it passes,
gives its stars (★★ or ★★★) as nbgrader's extra credit (added to the score, not to the maximum).

Points come from the difficulty stars of each exercise's heading (``### Exercise N.M ★★ title``: ★ = 1 point,
★★ = 2, ★★★ = 3). Each solution notebook's first markdown cell states its total, ``Points: N (★ = 1, ★★ = 2, ★★★ =
3)``; :func:`notebook_exercises` raises ``ValueError`` naming the notebook when the stars do not add up to it.

The capstone (``08_capstone``) reads the learner's notebooks of chapters 01, 02, 04, 05 and 06 from its own folder
(:func:`minillm.course.exercises.parts.load_learner_parts`). It is graded as its own assignment: before nbgrader runs a
student's capstone, :func:`autograde_pre_convert_hook` puts that student's notebooks of those chapters beside it
(the copies the student submitted with the capstone, else their submissions of those chapters), and
:func:`autograde_post_convert_hook` removes them afterwards.

:func:`run_demo` (``python -m minillm.course.exercises nbgrader DIR --demo 00_warmup``, ``make classroom-demo``) grades
three sample students (a solved, an unsolved and a half-solved copy) with the real nbgrader, as a teacher would.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import nbformat

from minillm.course.exercises.build import _TITLE, BEGIN, END, strip_solutions, with_allowed_imports

COURSE_ID = "minillm"
STAR_POINTS = {"★": 1, "★★": 2, "★★★": 3}
POINTS_LINE = "Points: {total} (★ = 1, ★★ = 2, ★★★ = 3)"
_POINTS = re.compile(r"^Points:\s*(\d+)\s*\(★ = 1, ★★ = 2, ★★★ = 3\)", re.M)
_HEADING = re.compile(r"^###\s+(Exercise\s+\d+\.\d+|Challenge\s+\d+)\s+(★+)(?=\s|$)", re.M)
_CHECK = re.compile(r"^#\s*Check\s+(Exercise\s+\d+\.\d+|Challenge\s+\d+)\b")


def _number(title: str) -> str:
    """``"2.2"`` for ``"Exercise 2.2: ..."`` or ``"Exercise 2.2"``; ``"C2"`` for ``"Challenge 2..."``."""
    m = re.match(r"(Exercise|Challenge)\s+(\d+(?:\.\d+)?)", title.strip())
    if m is None:
        raise ValueError(f"not an exercise or challenge title: {title!r}")
    return m.group(2) if m.group(1) == "Exercise" else f"C{m.group(2)}"
SCHEMA_VERSION = 3  # nbgrader's cell metadata schema (nbgrader 0.9)

# The sample students of :func:`run_demo` and the tests.
SAMPLE_STUDENTS = ("sample_solved", "sample_unsolved", "sample_half")

# Kernels started by nbgrader inherit these (nbgrader_config.py sets them unless already set): one thread, as in
# CI, and nothing downloaded.
KERNEL_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": "false"}


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One exercise of a solution notebook, as nbgrader grades it.

    Attributes:
        number: ``"2.2"``; ``"C2"`` for chapter 2's open challenge (``### Challenge 2 ★★★``, extra credit).
        title: the exercise cell's title line without ``#``: ``"Exercise 2.2: allocate the blocks ..."``.
        stars: 1 to 3, from the heading ``### Exercise 2.2 ★★ ...`` (a challenge's are always ★★★).
        answer_cell: index of the exercise (answer) cell in the notebook's cells.
        check_cell: index of its ``# Check Exercise N.M`` cell.
    """

    number: str
    title: str
    stars: int
    answer_cell: int
    check_cell: int

    @property
    def challenge(self) -> bool:
        return self.number.startswith("C")

    @property
    def points(self) -> int:
        """★ = 1, ★★ = 2, ★★★ = 3; a challenge's check is worth 0 (it gives :attr:`extra_credit` instead)."""
        return 0 if self.challenge else self.stars

    @property
    def extra_credit(self) -> int:
        return self.stars if self.challenge else 0

    @property
    def _id(self) -> str:
        return f"challenge-{self.number[1:]}" if self.challenge else f"ex-{self.number.replace('.', '-')}"

    @property
    def answer_id(self) -> str:
        """nbgrader ``grade_id`` of the answer cell, e.g. ``ex-2-2-answer`` (``challenge-2-answer``)."""
        return f"{self._id}-answer"

    @property
    def check_id(self) -> str:
        """nbgrader ``grade_id`` of the check cell, e.g. ``ex-2-2-check`` (``challenge-2-check``)."""
        return f"{self._id}-check"


def stated_points(nb: nbformat.NotebookNode, name: str) -> int:
    """The total stated in the notebook's first markdown cell (``Points: N (★ = 1, ★★ = 2, ★★★ = 3)``).

    Raises:
        ValueError: no such line (the message names the notebook).
    """
    first = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    m = _POINTS.search(first.source) if first is not None else None
    if m is None:
        raise ValueError(f"{name}: its first markdown cell must state the chapter's points, e.g. "
                         f"'{POINTS_LINE.format(total=3)}'")
    return int(m.group(1))


def notebook_exercises(nb: nbformat.NotebookNode, name: str) -> list[Exercise]:
    """The exercises of a solution notebook, in order, with their points checked against the stated total.

    Args:
        nb: a solution notebook.
        name: its name, for error messages.

    Raises:
        ValueError: an exercise without a ``### Exercise N.M ★ title`` heading before it or without a
            ``# Check Exercise N.M`` code cell right after it, a number used twice, a malformed solution region, or
            stars that do not add up to the notebook's ``Points:`` line. Each message names the notebook.
    """
    stars: dict[str, int] = {}
    found: list[Exercise] = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            for m in _HEADING.finditer(cell.source):
                what, number = " ".join(m.group(1).split()), _number(m.group(1))
                if m.group(2) not in STAR_POINTS:
                    raise ValueError(f"{name}: {what} has {len(m.group(2))} stars; use 1 to 3")
                if number.startswith("C") and m.group(2) == "★":
                    raise ValueError(f"{name}: {what} is an open challenge: give it ★★ or ★★★ (its extra credit)")
                stars[number] = STAR_POINTS[m.group(2)]
            continue
        if cell.cell_type != "code" or BEGIN not in cell.source:
            continue
        try:
            strip_solutions(cell.source)  # the same validation as `python -m minillm.course.exercises build`
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        title = next(m.group(1).strip() for m in map(_TITLE.match, cell.source.splitlines()) if m)
        number = _number(title)
        what = f"Challenge {number[1:]}" if number.startswith("C") else f"Exercise {number}"
        if any(e.number == number for e in found):
            raise ValueError(f"{name}: two cells are {what}")
        if number not in stars:
            raise ValueError(f"{name}: {what} needs a markdown heading '### {what} ★ title' "
                             "(★ to ★★★: its points) before its cell")
        check = next((j for j in range(i + 1, len(nb.cells)) if nb.cells[j].cell_type == "code"), None)
        check_line = _CHECK.match(nb.cells[check].source.lstrip()) if check is not None else None
        if check is None or check_line is None or _number(check_line.group(1)) != number:
            raise ValueError(f"{name}: {what} must be followed by a '# Check {what}' cell")
        found.append(Exercise(number, title, stars[number], i, check))
    total = stated_points(nb, name)
    if sum(e.points for e in found) != total:
        detail = " + ".join(f"{e.points} ({e.number})" for e in found if not e.challenge) or "no exercise"
        raise ValueError(f"{name}: its first cell states 'Points: {total}' but its exercises' stars give "
                         f"{detail} = {sum(e.points for e in found)}")
    return found


def _nbgrader_meta(grade_id: str, *, solution: bool, grade: bool, locked: bool,
                   points: int | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": SCHEMA_VERSION,
                            "solution": solution, "task": False}
    if points is not None:
        meta["points"] = points
    return meta


def source_notebook(nb: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """The nbgrader source version of a solution notebook: the same cells, with nbgrader metadata on each exercise
    cell (autograded answer) and each check cell (read-only autograder test worth the exercise's points), and
    the exercise notebooks' cell on what an answer may import (so the released notebooks equal ``exercises/``)."""
    nb = with_allowed_imports(nbformat.from_dict(nb))
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # run timestamps: they would reach the students' notebooks
    for ex in notebook_exercises(nb, name):
        nb.cells[ex.answer_cell].metadata["nbgrader"] = _nbgrader_meta(
            ex.answer_id, solution=True, grade=False, locked=False)
        nb.cells[ex.check_cell].metadata["nbgrader"] = _nbgrader_meta(
            ex.check_id, solution=False, grade=True, locked=True, points=ex.points)
    return nb


def siblings_needed() -> dict[str, tuple[str, ...]]:
    """Assignment -> the other chapters' notebooks it reads from its own folder (the capstone's parts)."""
    from minillm.course.exercises.parts import PART_SOURCES

    return {"08_capstone": tuple(sorted({s.notebook for s in PART_SOURCES}))}


_CONFIG = '''\
"""nbgrader settings of the minillm course: written by `python -m minillm.course.exercises nbgrader`, rewritten on every
rebuild. Put your own settings (the exchange directory, the students, late penalties, ...) in
nbgrader_config_local.py beside this file: it is loaded at the end, and rebuilds never touch it."""
import os

from minillm.course.exercises.nbgrader import KERNEL_ENV, autograde_preprocessors, generate_assignment_preprocessors

c = get_config()  # noqa: F821 (provided by traitlets when it loads this file)

c.CourseDirectory.course_id = {course_id!r}
c.CourseDirectory.root = {root!r}

# The assignments, one per solution notebook (source/<assignment>/<assignment>.ipynb), with their points:
{assignments}

# `nbgrader generate_assignment` writes the stubs of `python -m minillm.course.exercises build`:
# raise NotImplementedError('Exercise N.M: ...'), so the student notebooks equal the repository's exercises/.
c.GenerateAssignment.preprocessors = generate_assignment_preprocessors()
c.ClearSolutions.begin_solution_delimeter = "### BEGIN SOLUTION"
c.ClearSolutions.end_solution_delimeter = "### END SOLUTION"

# A check cell passes (all its points) or fails by raising (0): see ExerciseSaveAutoGrades.
c.Autograde.autograde_preprocessors = autograde_preprocessors()

# Autograding runs whole notebooks: the model loads in a setup cell, the capstone's check runs an engine for about
# a minute. nbgrader's default is 30 s per cell.
c.Execute.timeout = 600
# Kernels inherit these: one thread as in CI (the same answers on every machine), and nothing is downloaded.
for _key, _value in KERNEL_ENV.items():
    os.environ.setdefault(_key, _value)

# The capstone reads the student's notebooks of chapters 01, 02, 04, 05 and 06 from its folder: put them there
# while it is graded (see minillm/course/exercises/nbgrader.py).
c.Autograde.pre_convert_hook = "minillm.course.exercises.nbgrader.autograde_pre_convert_hook"
c.Autograde.post_convert_hook = "minillm.course.exercises.nbgrader.autograde_post_convert_hook"

load_subconfig("nbgrader_config_local.py")  # noqa: F821
'''


def build_course(course_dir: str | Path, solutions: str | Path = "solutions",
                 course_id: str = COURSE_ID) -> list[Path]:
    """Write the nbgrader course directory: ``source/<stem>/<stem>.ipynb`` per solution notebook, and
    ``nbgrader_config.py``. Releases, submissions and the gradebook already there are left alone.

    Returns:
        the files written.

    Raises:
        ValueError: a solution notebook whose exercises or points are malformed (see :func:`notebook_exercises`);
            nothing is written then.
    """
    course_dir, solutions = Path(course_dir).resolve(), Path(solutions)
    paths = sorted(solutions.glob("*.ipynb"))
    if not paths:
        raise ValueError(f"no solution notebooks in {solutions}")
    built = {p.stem: source_notebook(nbformat.read(p, as_version=4), p.name) for p in paths}  # validate all first
    written = []
    lines = []
    for stem, nb in built.items():
        dest = course_dir / "source" / stem / f"{stem}.ipynb"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(nbformat.writes(nb) + "\n")
        written.append(dest)
        exercises = notebook_exercises(nb, stem)
        points = ", ".join(f"{e.number}: {e.points}" if not e.challenge else
                           f"challenge {e.number[1:]}: +{e.extra_credit} extra credit" for e in exercises)
        total = sum(e.points for e in exercises)
        lines.append(f"#   {stem:<28} {total:>2} point{'' if total == 1 else 's'} ({points})")
    config = course_dir / "nbgrader_config.py"
    config.write_text(_CONFIG.format(course_id=course_id, root=str(course_dir), assignments="\n".join(lines)))
    written.append(config)
    return written


def generate_assignment_preprocessors() -> list[type]:
    """nbgrader's ``GenerateAssignment.preprocessors`` with ``ClearSolutions`` replaced by
    :class:`ExerciseClearSolutions` (needs nbgrader)."""
    from nbgrader.converters import GenerateAssignment
    from nbgrader.preprocessors import ClearSolutions

    return _replace(GenerateAssignment.class_traits()["preprocessors"].default(), ClearSolutions,
                    _nbgrader_classes()["ExerciseClearSolutions"])


def autograde_preprocessors() -> list[type]:
    """nbgrader's ``Autograde.autograde_preprocessors`` with ``SaveAutoGrades`` replaced by
    :class:`ExerciseSaveAutoGrades`, and ``Execute`` run between :class:`GradingPrepare` and
    :class:`GradingRestore`: the kernel runs the teacher's notebook with each answer sent to a process of its own
    (:mod:`minillm.course.exercises.grading`), and the student's notebook gets the outputs (needs nbgrader)."""
    from nbgrader.converters import Autograde
    from nbgrader.preprocessors import Execute, SaveAutoGrades

    classes = _nbgrader_classes()
    out = _replace(Autograde.class_traits()["autograde_preprocessors"].default(), SaveAutoGrades,
                   classes["ExerciseSaveAutoGrades"])
    at = out.index(Execute)
    return out[:at] + [classes["GradingPrepare"], Execute, classes["GradingRestore"]] + out[at + 1:]


def _replace(preprocessors: list[type], old: type, new: type) -> list[type]:
    assert old in preprocessors, (f"nbgrader no longer uses {old.__name__}; minillm.course.exercises.nbgrader must "
                                  f"follow")
    return [new if pp is old else pp for pp in preprocessors]


@functools.cache
def _nbgrader_classes() -> dict[str, type]:
    from nbgrader import utils
    from nbgrader.preprocessors import ClearSolutions, SaveAutoGrades

    class ExerciseClearSolutions(ClearSolutions):
        """nbgrader's ``ClearSolutions`` writing the course's stub: each solution region of a code cell becomes
        ``raise NotImplementedError('<the cell's "# Exercise N.M: ..." title>')`` at the region's indentation, as
        ``python -m minillm.course.exercises build`` writes it (nbgrader's ``code_stub`` is one text per language)."""

        def _replace_solution_region(self, cell: nbformat.NotebookNode, language: str) -> bool:
            if cell.cell_type == "code" and BEGIN in cell.source:
                cell.source = strip_solutions(cell.source)
                return True
            return super()._replace_solution_region(cell, language)

    class ExerciseSaveAutoGrades(SaveAutoGrades):
        """nbgrader's ``SaveAutoGrades`` with the course's rule for check cells: a check passes or fails. It fails
        by raising (an error output: 0 points) and passes otherwise (all the points).

        nbgrader's own rule reads a number the cell displays as partial credit (chapter 05's checks display how
        many cases they compared, which nbgrader rejects as more than the cell's points) and gives 0 to a cell that
        wrote anything to stderr (a warning from a passing check).
        """

        def _add_score(self, cell: nbformat.NotebookNode, resources: dict) -> None:
            if cell.cell_type != "code" or utils.is_solution(cell):
                return super()._add_score(cell, resources)
            grade = self.gradebook.find_grade(cell.metadata["nbgrader"]["grade_id"], self.notebook_id,
                                              self.assignment_id, self.student_id)
            # Fail closed: a check that did not run here, under grading (GradingPrepare/GradingRestore), earns nothing
            ran = resources.get(_GRADED_KEY) is True and cell.get("execution_count") is not None
            if not ran:
                self.log.error("%s: check cell %s did not run under grading out of the answer's reach: 0 points",
                               self.notebook_id, cell.metadata["nbgrader"]["grade_id"])
            failed = not ran or any(out.output_type == "error" for out in cell.outputs)
            grade.auto_score = 0.0 if failed else float(cell.metadata["nbgrader"]["points"])
            grade_id = cell.metadata["nbgrader"]["grade_id"]
            if grade_id.startswith("challenge-"):  # an open challenge: its stars as extra credit
                credit = resources.get(_CREDIT_KEY, {}).get(grade_id, 0)
                grade.extra_credit = 0.0 if failed else float(credit)
            grade.needs_manual_grade = grade.manual_score is not None  # a grader's own score stands out for review
            self.gradebook.db.commit()

    from nbconvert.preprocessors import Preprocessor
    from traitlets import Bool

    class GradingPrepare(Preprocessor):
        """Before ``Execute``: the notebook the kernel runs becomes the teacher's own (``source/``), each answer
        cell a call of :func:`minillm.course.exercises.grading.answer`, after a first cell that turns grading mode
        on; the student's answers (each ``# Exercise N.M`` cell and the student's cells up to its check) go into a
        plan file for the answer's process. The student's notebook waits in ``resources`` for
        :class:`GradingRestore`."""

        enabled = Bool(True).tag(config=True)  # nbconvert's preprocessors are off unless enabled

        def preprocess(self, nb: nbformat.NotebookNode, resources: dict) -> tuple[nbformat.NotebookNode, dict]:
            return grading_notebook(nb, resources, Path(self.config.CourseDirectory.root or "."))

    class GradingRestore(Preprocessor):
        """After ``Execute``: the student's notebook again, each cell with the outputs of its counterpart in the
        notebook that ran (check cells and answer cells by grade id, the teacher's cells by cell id)."""

        enabled = Bool(True).tag(config=True)

        def preprocess(self, nb: nbformat.NotebookNode, resources: dict) -> tuple[nbformat.NotebookNode, dict]:
            return restored_notebook(nb, resources)

    classes: dict[str, type] = {"ExerciseClearSolutions": ExerciseClearSolutions,
                                "ExerciseSaveAutoGrades": ExerciseSaveAutoGrades,
                                "GradingPrepare": GradingPrepare, "GradingRestore": GradingRestore}
    for name, cls in classes.items():
        cls.__module__, cls.__qualname__ = __name__, name
    return classes


def __getattr__(name: str) -> Any:
    # ExerciseClearSolutions and ExerciseSaveAutoGrades subclass nbgrader classes: built on first use, so this
    # module imports without the [classroom] extra.
    if name in ("ExerciseClearSolutions", "ExerciseSaveAutoGrades", "GradingPrepare", "GradingRestore"):
        return _nbgrader_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- grading out of the answer's reach (minillm/course/exercises/grading.py) ----------------------------------------

_STUDENT_KEY = "minillm_student_notebook"
_PLAN_KEY = "minillm_grading_plan"
_CREDIT_KEY = "minillm_extra_credit"  # challenge check's grade id -> its extra credit (its stars), from source/
_GRADED_KEY = "minillm_graded"   # set by restored_notebook: the check cells ran with the answers out of reach


def _grade_id(cell: nbformat.NotebookNode) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def answer_regions(student: nbformat.NotebookNode, exercises: list[Exercise]) -> dict[str, str]:
    """Exercise number -> the student's answer: their answer cell (found by its grade id) and every code cell they
    put after it, up to the exercise's check cell, joined as the capstone's loader joins them. A missing answer
    cell gives ``""``."""
    index = {_grade_id(c): i for i, c in enumerate(student.cells) if _grade_id(c)}
    found: dict[str, str] = {}
    for ex in exercises:
        a, c = index.get(ex.answer_id), index.get(ex.check_id)
        if a is None:
            found[ex.number] = ""
            continue
        end = c if c is not None and c > a else a + 1
        found[ex.number] = "\n\n".join(cell.source for cell in student.cells[a:end] if cell.cell_type == "code")
    return found


def grading_notebook(student: nbformat.NotebookNode, resources: dict,
                     course_root: Path) -> tuple[nbformat.NotebookNode, dict]:
    """The notebook the grading kernel runs (see :class:`GradingPrepare`), and ``resources`` holding the student's
    notebook and the plan's path."""
    import copy
    import json
    import tempfile

    info = resources.get("nbgrader", {})
    assignment, notebook = info.get("assignment"), info.get("notebook")
    source_path = course_root / "source" / str(assignment) / f"{notebook}.ipynb"
    if not source_path.exists():
        raise FileNotFoundError(f"grading needs the teacher's notebook {source_path} (the course directory's source/)")
    teacher = nbformat.read(source_path, as_version=4)
    exercises = notebook_exercises(teacher, f"{notebook}.ipynb")
    answers = answer_regions(student, exercises)
    by_cell = {ex.answer_cell: ex for ex in exercises}
    checks = {ex.check_cell for ex in exercises}
    plan: list[dict[str, Any]] = []
    graded = copy.deepcopy(teacher)
    for i, cell in enumerate(graded.cells):
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        if i in by_cell:
            ex = by_cell[i]
            plan.append({"kind": "answer", "exercise": ex.number, "source": answers[ex.number]})
            cell.source = (f"# {ex.title}\n# (graded: your answer runs in a process of its own)\n"
                           f"_minillm_grading.answer({len(plan) - 1})")
        elif i in checks:
            plan.append({"kind": "check", "exercise": None, "source": ""})
        else:
            plan.append({"kind": "setup", "exercise": None, "source": cell.source})
    folder = Path(tempfile.mkdtemp(prefix="minillm-grading-"))
    plan_path = folder / "plan.json"
    plan_path.write_text(json.dumps({"notebook": notebook, "cells": plan}))
    start = nbformat.v4.new_code_cell(
        "from minillm.course.exercises import grading as _minillm_grading\n"
        f"_minillm_grading.start({str(plan_path)!r}, globals())")
    start.metadata["minillm_grading"] = "start"
    graded.cells.insert(0, start)
    resources[_STUDENT_KEY] = student
    resources[_PLAN_KEY] = str(folder)
    resources[_CREDIT_KEY] = {ex.check_id: ex.extra_credit for ex in exercises if ex.challenge}
    return graded, resources


def restored_notebook(graded: nbformat.NotebookNode, resources: dict) -> tuple[nbformat.NotebookNode, dict]:
    """The student's notebook with the outputs of the notebook that ran (see :class:`GradingRestore`)."""
    student = resources.pop(_STUDENT_KEY)
    resources[_GRADED_KEY] = True
    folder = resources.pop(_PLAN_KEY, None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    by_grade = {_grade_id(c): c for c in graded.cells if _grade_id(c)}
    by_id = {c.get("id"): c for c in graded.cells if c.get("id")}
    start = next((c for c in graded.cells if c.get("metadata", {}).get("minillm_grading") == "start"), None)
    for cell in student.cells:
        if cell.cell_type != "code":
            continue
        ran = by_grade.get(_grade_id(cell)) if _grade_id(cell) else by_id.get(cell.get("id"))
        if ran is not None and ran.cell_type == "code":
            cell.outputs, cell.execution_count = ran.outputs, ran.execution_count
        else:
            cell.outputs, cell.execution_count = [], None
    if start is not None and any(o.get("output_type") == "error" for o in start.outputs):
        first = next((c for c in student.cells if c.cell_type == "code"), None)
        if first is not None:
            first.outputs = list(start.outputs) + list(first.outputs)
    return student, resources


# --- the capstone's siblings, during `nbgrader autograde` ---------------------------------------------------------

def _submission_of(notebooks: list[str]) -> tuple[Path, str, str] | None:
    """(course root, student, assignment) of the submission nbgrader is about to autograde, from its notebooks'
    paths (``<root>/submitted/<student>/<assignment>/<notebook>.ipynb``, nbgrader's default layout)."""
    if not notebooks:
        return None
    folder = Path(notebooks[0]).resolve().parent
    if folder.parent.parent.name != "submitted":
        return None
    return folder.parent.parent.parent, folder.parent.name, folder.name


def autograde_pre_convert_hook(assignment: str = "", student: str = "", notebooks: list[str] | None = None,
                               **_: Any) -> list[Path]:
    """nbgrader ``Autograde.pre_convert_hook``: before a student's capstone runs, put beside it (in
    ``autograded/<student>/<assignment>/``) the notebooks it reads: the student's copies submitted with the
    capstone, else their submission of that chapter. A notebook found in neither place is left out, and the
    capstone's check then names it as missing.

    nbgrader passes the ids it was called with (``*`` for all students), so the student and the assignment are read
    from the notebooks' paths. Returns the files copied.
    """
    where = _submission_of(notebooks or [])
    if where is None:
        return []
    root, student_id, assignment_id = where
    copied = []
    for name in siblings_needed().get(assignment_id, ()):
        candidates = (root / "submitted" / student_id / assignment_id / name,
                      root / "submitted" / student_id / Path(name).stem / name)
        found = next((p for p in candidates if p.exists()), None)
        if found is None:
            continue
        dest = root / "autograded" / student_id / assignment_id / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            dest.chmod(0o644)
            dest.unlink()
        shutil.copyfile(found, dest)
        copied.append(dest)
    return copied


def autograde_post_convert_hook(assignment: str = "", student: str = "", notebooks: list[str] | None = None,
                                **_: Any) -> list[Path]:
    """nbgrader ``Autograde.post_convert_hook``: remove what :func:`autograde_pre_convert_hook` put beside the
    capstone, so feedback and the formgrader see only the graded notebook. Returns the files removed."""
    where = _submission_of(notebooks or [])
    if where is None:
        return []
    root, student_id, assignment_id = where
    graded = {Path(p).name for p in notebooks or []}
    removed = []
    for name in siblings_needed().get(assignment_id, ()):
        dest = root / "autograded" / student_id / assignment_id / name
        if name not in graded and dest.exists():
            dest.chmod(0o644)
            dest.unlink()
            removed.append(dest)
    return removed


# --- sample students and the demo ----------------------------------------------------------------------------------

def solved_source(answer_source: str) -> str:
    """An answer cell as a student who solved it would hand it in: the solution, without nbgrader's markers."""
    return "\n".join(line for line in answer_source.splitlines() if line.strip() not in (BEGIN, END))


def half_count(exercises: list[Exercise]) -> int:
    """How many exercises the half-solved sample student solves: the first half, by count (rounded down), of the
    exercises that are not open challenges."""
    return len([e for e in exercises if not e.challenge]) // 2


def _first_half(exercises: list[Exercise]) -> list[Exercise]:
    return [e for e in exercises if not e.challenge][:half_count(exercises)]


def learner_notebook(solution: nbformat.NotebookNode, solved: set[str]) -> nbformat.NotebookNode:
    """A learner's notebook made from a solution notebook: the exercises in ``solved`` answered, the others stubs,
    outputs cleared (what a learner saves; the capstone reads such notebooks)."""
    nb = nbformat.from_dict(solution)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if BEGIN in cell.source:
            title = next(m.group(1) for m in map(_TITLE.match, cell.source.splitlines()) if m)
            number = _number(title)
            cell.source = solved_source(cell.source) if number in solved else strip_solutions(cell.source)
        cell.outputs, cell.execution_count = [], None
    return nb


def write_sample_submissions(course_dir: str | Path, assignment: str,
                             solutions: str | Path = "solutions") -> dict[str, float]:
    """Submit the assignment for the three sample students, from its released notebook (run
    ``nbgrader generate_assignment`` first): ``sample_solved`` answers every exercise with the solution code,
    ``sample_unsolved`` hands the released notebook in as it is, ``sample_half`` answers the first half of the
    exercises (by count, see :func:`half_count`). For an assignment that reads other chapters' notebooks (the
    capstone), each student's copies of them go beside it, solved to the same degree.

    Returns:
        the score each student must get: the points of the exercises they answered.
    """
    course_dir = Path(course_dir)
    source = nbformat.read(course_dir / "source" / assignment / f"{assignment}.ipynb", as_version=4)
    release = nbformat.read(course_dir / "release" / assignment / f"{assignment}.ipynb", as_version=4)
    exercises = notebook_exercises(source, assignment)
    answers = {e.answer_id: solved_source(source.cells[e.answer_cell].source) for e in exercises}
    plans = {"sample_solved": exercises, "sample_unsolved": [],
             "sample_half": _first_half(exercises)}
    expected = {}
    for student, solved in plans.items():
        ids = {e.answer_id for e in solved}
        nb = nbformat.from_dict(release)
        for cell in nb.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if grade_id in ids:
                cell.source = answers[grade_id]
        folder = course_dir / "submitted" / student / assignment
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / f"{assignment}.ipynb")
        for name in siblings_needed().get(assignment, ()):
            sibling = nbformat.read(Path(solutions) / name, as_version=4)
            its = notebook_exercises(sibling, name)
            done = {"sample_solved": its, "sample_unsolved": [], "sample_half": _first_half(its)}[student]
            nbformat.write(learner_notebook(sibling, {e.number for e in done}), folder / name)
        expected[student] = float(sum(e.points + e.extra_credit for e in solved))
    return expected


def nbgrader(course_dir: str | Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``python -m nbgrader ARGS`` in the course directory with this interpreter (so its kernels run in this
    environment), its bin folder first on PATH. Returns its log; raises ``RuntimeError`` with the log's end when it
    fails."""
    run_env = dict(os.environ if env is None else env)
    for key, value in KERNEL_ENV.items():
        run_env.setdefault(key, value)
    # nbgrader runs the `alembic` command of its environment when it opens the gradebook: this interpreter's bin
    # folder goes first on PATH, as if the environment were activated.
    run_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), run_env.get("PATH", "")])
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course_dir, env=run_env,
                          capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        first_error = log.find("| ERROR]")  # the first failure's traceback, not only the summary at the end
        shown = log[first_error:][:8000] if first_error >= 0 else log[-8000:]
        raise RuntimeError(f"nbgrader {' '.join(args)} failed ({proc.returncode}):\n{shown}")
    return log


def gradebook_scores(course_dir: str | Path, assignment: str,
                     course_id: str = COURSE_ID) -> dict[str, tuple[float, float]]:
    """Student -> (score, max score) of the assignment, read from the course's gradebook (``gradebook.db``)."""
    from nbgrader.api import Gradebook

    scores = {}
    with Gradebook(f"sqlite:///{Path(course_dir).resolve() / 'gradebook.db'}", course_id=course_id) as gb:
        for sub in gb.find_assignment(assignment).submissions:
            scores[sub.student.id] = (float(sub.score), float(sub.max_score))
    return scores


def cell_scores(course_dir: str | Path, assignment: str, student: str,
                course_id: str = COURSE_ID) -> dict[str, tuple[float, float]]:
    """grade_id -> (score, max score) of one student's graded cells."""
    from nbgrader.api import Gradebook

    out = {}
    with Gradebook(f"sqlite:///{Path(course_dir).resolve() / 'gradebook.db'}", course_id=course_id) as gb:
        for grade in gb.find_submission_notebook(assignment, assignment, student).grades:
            out[grade.name] = (float(grade.score), float(grade.max_score))
    return out


def grade_samples(course_dir: str | Path, assignments: list[str], solutions: str | Path = "solutions",
                  also: list[str] | tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """Submit the three sample students' copies of ``assignments`` (:func:`write_sample_submissions`; their
    earlier grading and feedback are removed first), then ``nbgrader autograde`` and ``nbgrader
    generate_feedback``. The assignments must have been generated (``nbgrader generate_assignment``).

    With several assignments, autograde and feedback run once over all of them (``*``: one nbgrader start instead
    of one per assignment); they then also grade any other submission of the course directory not graded yet, so
    give the samples a course directory of their own.

    ``also``: more assignments whose submissions (already in place) are graded in the same run.

    Returns:
        assignment -> student -> the score the student must get (the points of the exercises they answered).
    """
    course_dir = Path(course_dir)
    expected = {}
    for assignment in assignments:
        for student in SAMPLE_STUDENTS:
            for step in ("autograded", "feedback"):
                shutil.rmtree(course_dir / step / student / assignment, ignore_errors=True)
        expected[assignment] = write_sample_submissions(course_dir, assignment, solutions)
    which = assignments[0] if len(set(assignments) | set(also)) == 1 else "*"
    nbgrader(course_dir, "autograde", which)
    nbgrader(course_dir, "generate_feedback", which)
    return expected


def run_demo(course_dir: str | Path, assignments: list[str], solutions: str | Path = "solutions",
             log=print) -> dict[str, dict[str, tuple[float, float]]]:
    """What a teacher does, with three sample students: build the course directory, ``nbgrader
    generate_assignment`` for every assignment (it only rewrites notebooks), then :func:`grade_samples` on
    ``assignments``, and print the gradebook.

    Returns:
        assignment -> student -> (score, max score), from the gradebook.

    Raises:
        AssertionError: a sample student's score differs from the points of the exercises they answered.
    """
    course_dir = Path(course_dir)
    build_course(course_dir, solutions)
    log(f"built {course_dir}/source/ and nbgrader_config.py from {solutions}/")
    log("nbgrader generate_assignment '*'")
    nbgrader(course_dir, "generate_assignment", "*", "--force")
    log(f"submitted {', '.join(SAMPLE_STUDENTS)} for {', '.join(assignments)}; nbgrader autograde, "
        "nbgrader generate_feedback (the notebooks run: about a minute per chapter)")
    expected = grade_samples(course_dir, assignments, solutions)
    results = {}
    for assignment in assignments:
        scores = gradebook_scores(course_dir, assignment)
        results[assignment] = scores
        log(assignment)
        for student, want in expected[assignment].items():
            got, top = scores[student]
            log(f"    {student:<16} {got:g} / {top:g}   (expected {want:g})")
            assert got == want, f"{assignment}: {student} scored {got}, expected {want}"
    log(f"gradebook: {course_dir / 'gradebook.db'}; feedback: {course_dir / 'feedback'}/<student>/<assignment>/")
    return results
