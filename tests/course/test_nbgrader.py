"""A class run with nbgrader: the course directory built from solutions/, and the real nbgrader on it.

- The source notebooks carry nbgrader's metadata (answer cells, read-only check cells worth the exercise's stars),
  with grade ids that do not change across rebuilds; each chapter's stars add up to the points it states.
- ``nbgrader generate_assignment`` gives student notebooks whose cells equal ``exercises/``.
- Three sample students (solved, unsolved, half-solved) are autograded: full marks, zero, and exactly the points of
  the exercises the half-solved one answered, read from nbgrader's gradebook; the feedback names the first exercise
  the half-solved student left unsolved.
- Cheating students (tests/course/delegating_answers.py ``CHEATS``: an input transformer that rewrites the check cells, a
  patched checker and tripwire, the check's own result read from a global, the package's function captured before
  the check) are autograded on chapters 06 and 10 and score 0 in every cell: the answers run in a process of their
  own, linted first, and the checks in the grading kernel (minillm/course/exercises/grading.py).
- A check cell scores pass or fail, whatever it displays; the capstone's hooks put the student's chapter notebooks
  beside it while it is graded; the classroom extra is pinned with everything it pulls in.

Autograding runs the notebooks. ``make test`` grades chapters 02 and 10 (this file: about 2 minutes on a busy
2-core CPU); ``make test-classroom`` grades every chapter, capstone included, twice, and checks that the two runs
give the same score to every cell (about 16 minutes). ``MINILLM_NBGRADER_CHAPTERS`` chooses: ``all``, or chapter
numbers / names separated by commas (``00,02``). The tests that run nbgrader skip when it is not installed (the
``[classroom]`` extra).
"""
from __future__ import annotations

import html
import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from minillm.course.exercises.__main__ import main
from minillm.course.exercises.nbgrader import (SAMPLE_STUDENTS, autograde_post_convert_hook, autograde_pre_convert_hook,
                                        build_course, cell_scores, gradebook_scores, grade_samples, half_count,
                                        nbgrader, notebook_exercises, siblings_needed, source_notebook,
                                        stated_points)

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
STEMS = [p.stem for p in SOLUTIONS]
# Two quick ones that load no model (10 has a challenge: extra credit); `make test-classroom` grades every chapter.
FAST_CHAPTERS = ["02_paged_kv_cache", "10_engine_core"]


def _chosen_chapters() -> list[str]:
    spec = os.environ.get("MINILLM_NBGRADER_CHAPTERS", "").strip()
    if not spec:
        return FAST_CHAPTERS
    if spec == "all":
        return STEMS
    chosen = [s for s in STEMS if any(s == tok or s.startswith(tok + "_") for tok in spec.split(","))]
    assert chosen, f"MINILLM_NBGRADER_CHAPTERS={spec!r} names no chapter of {STEMS}"
    return chosen


CHAPTERS = _chosen_chapters()
CHOSEN = bool(os.environ.get("MINILLM_NBGRADER_CHAPTERS", "").strip())
# Grading every chapter twice runs every solution notebook six times: minutes, not seconds.
GRADE_TIMEOUT = 3600 if len(CHAPTERS) > len(FAST_CHAPTERS) else 900


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


# --- points and metadata (no nbgrader needed) ---------------------------------------------------------------------

@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_stars_add_up_to_the_stated_points(solution):
    nb = _read(solution)
    exercises = notebook_exercises(nb, solution.name)  # raises ValueError naming the notebook otherwise
    assert exercises
    assert sum(e.points for e in exercises) == stated_points(nb, solution.name)
    for e in exercises:
        what = f"Challenge {e.number[1:]}" if e.challenge else f"Exercise {e.number}"
        heading = next(c.source for c in nb.cells[:e.answer_cell][::-1]
                       if c.cell_type == "markdown" and f"### {what} " in c.source)
        assert f"### {what} {'★' * e.stars} " in heading
        assert nb.cells[e.check_cell].source.lstrip().startswith(f"# Check {what}")


def _toy(points_line: str, stars: str = "★★") -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(f"# Toy\n\n{points_line}"),
        nbformat.v4.new_markdown_cell(f"### Exercise 9.1 {stars} add one\n\nWrite it."),
        nbformat.v4.new_code_cell("# Exercise 9.1: add one\ndef f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n"
                                  "    ### END SOLUTION"),
        nbformat.v4.new_code_cell("# Check Exercise 9.1\nassert f(1) == 2"),
        nbformat.v4.new_code_cell("print(f(2))  # uses the exercise; carries no points"),
    ]
    return nb


def test_wrong_or_missing_points_name_the_notebook():
    assert [e.points for e in notebook_exercises(_toy("Points: 2 (★ = 1, ★★ = 2, ★★★ = 3)"), "toy.ipynb")] == [2]
    with pytest.raises(ValueError, match=r"toy\.ipynb: its first cell states 'Points: 3'.* = 2"):
        notebook_exercises(_toy("Points: 3 (★ = 1, ★★ = 2, ★★★ = 3)"), "toy.ipynb")
    with pytest.raises(ValueError, match=r"toy\.ipynb: its first markdown cell must state"):
        notebook_exercises(_toy("no points here"), "toy.ipynb")
    with pytest.raises(ValueError, match=r"toy\.ipynb: Exercise 9\.1 needs a markdown heading"):
        notebook_exercises(_toy("Points: 2 (★ = 1, ★★ = 2, ★★★ = 3)", stars="(hard)"), "toy.ipynb")


def _with_challenge(nb: nbformat.NotebookNode, stars: str = "★★★") -> nbformat.NotebookNode:
    nb.cells += [
        nbformat.v4.new_markdown_cell(f"### Challenge 9 {stars} add two (optional, extra credit)\n\nWrite it."),
        nbformat.v4.new_code_cell("# Challenge 9: add two\ndef g(x):\n    ### BEGIN SOLUTION\n    return x + 2\n"
                                  "    ### END SOLUTION"),
        nbformat.v4.new_code_cell("# Check Challenge 9\nassert g(1) == 3"),
    ]
    return nb


def test_a_challenge_is_extra_credit_worth_no_points():
    nb = _with_challenge(_toy("Points: 2 (★ = 1, ★★ = 2, ★★★ = 3)"))
    exercises = notebook_exercises(nb, "toy.ipynb")  # the stated points count the exercises only
    assert [(e.number, e.points, e.extra_credit, e.check_id) for e in exercises] == [
        ("9.1", 2, 0, "ex-9-1-check"), ("C9", 0, 3, "challenge-9-check")]
    meta = source_notebook(nb, "toy.ipynb").cells[-1].metadata["nbgrader"]
    assert meta["grade_id"] == "challenge-9-check" and meta["points"] == 0 and meta["grade"] is True
    with pytest.raises(ValueError, match=r"Challenge 9 is an open challenge: give it ★★ or ★★★"):
        notebook_exercises(_with_challenge(_toy("Points: 2 (★ = 1, ★★ = 2, ★★★ = 3)"), stars="★"), "toy.ipynb")
    two = notebook_exercises(_with_challenge(_toy("Points: 2 (★ = 1, ★★ = 2, ★★★ = 3)"), stars="★★"), "toy.ipynb")
    assert [(e.number, e.points, e.extra_credit) for e in two] == [("9.1", 2, 0), ("C9", 0, 2)]  # its stars


def test_source_notebook_marks_answer_and_check_cells_only():
    nb = source_notebook(_toy("Points: 2 (★ = 1, ★★ = 2, ★★★ = 3)"), "toy.ipynb")
    metas = [c.metadata.get("nbgrader") for c in nb.cells]
    # cell 1: the exercise notebooks' cell on what an answer may import (minillm/course/exercises/build.py)
    assert nb.cells[1].id == "allowed-imports" and "An answer may import:" in nb.cells[1].source
    assert metas[:3] == [None, None, None] and metas[5] is None
    assert metas[3] == {"grade": False, "grade_id": "ex-9-1-answer", "locked": False, "schema_version": 3,
                        "solution": True, "task": False}
    assert metas[4] == {"grade": True, "grade_id": "ex-9-1-check", "locked": True, "points": 2,
                        "schema_version": 3, "solution": False, "task": False}
    assert "### BEGIN SOLUTION" in nb.cells[3].source  # the source keeps the solution


def test_course_directory_is_the_same_on_every_rebuild(tmp_path):
    written = build_course(tmp_path / "a", ROOT / "solutions")
    build_course(tmp_path / "b", ROOT / "solutions")
    build_course(tmp_path / "b", ROOT / "solutions")  # a rebuild over an existing directory
    assert sorted(p.relative_to(tmp_path / "a").as_posix() for p in written) == sorted(
        [f"source/{s}/{s}.ipynb" for s in STEMS] + ["nbgrader_config.py"])
    for stem in STEMS:
        a = (tmp_path / "a" / "source" / stem / f"{stem}.ipynb").read_text()
        assert a == (tmp_path / "b" / "source" / stem / f"{stem}.ipynb").read_text()
        ids = [c.metadata["nbgrader"]["grade_id"] for c in nbformat.reads(a, as_version=4).cells
               if "nbgrader" in c.metadata]
        exercises = notebook_exercises(_read(ROOT / "solutions" / f"{stem}.ipynb"), stem)
        assert ids == [i for e in exercises for i in (e.answer_id, e.check_id)]
        assert all(re.fullmatch(r"(ex-\d+-\d+|challenge-\d+)-(answer|check)", i) for i in ids), ids
    config = (tmp_path / "a" / "nbgrader_config.py").read_text()
    assert f"c.CourseDirectory.root = {str((tmp_path / 'a').resolve())!r}" in config
    assert "c.CourseDirectory.course_id = 'minillm'" in config


def test_cli_builds_the_course_and_rejects_a_bad_notebook(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the default --solutions is solutions/, relative to the repository root
    assert main(["nbgrader", str(tmp_path / "course")]) == 0
    assert (tmp_path / "course" / "source" / "00_warmup" / "00_warmup.ipynb").exists()
    assert "nbgrader_config.py" in capsys.readouterr().out
    bad = tmp_path / "bad"
    bad.mkdir()
    nbformat.write(_toy("Points: 5 (★ = 1, ★★ = 2, ★★★ = 3)"), bad / "09_toy.ipynb")
    assert main(["nbgrader", str(tmp_path / "c2"), "--solutions", str(bad)]) == 2
    assert "09_toy.ipynb: its first cell states 'Points: 5'" in capsys.readouterr().err
    assert not (tmp_path / "c2").exists()


def test_capstone_hooks_put_the_students_notebooks_beside_it_and_take_them_away(tmp_path):
    needed = siblings_needed()["08_capstone"]
    assert set(needed) == {"01_attention_and_chunks.ipynb", "02_paged_kv_cache.ipynb", "04_scheduler.ipynb",
                           "05_sampler.ipynb", "06_engine.ipynb"}
    sub = tmp_path / "submitted" / "ann" / "08_capstone"
    sub.mkdir(parents=True)
    (sub / "08_capstone.ipynb").write_text("{}")
    (sub / "01_attention_and_chunks.ipynb").write_text("beside")  # copied beside the capstone by the student
    for name in needed[1:]:  # the others only in the student's submissions of those chapters
        chapter = tmp_path / "submitted" / "ann" / Path(name).stem
        chapter.mkdir(parents=True)
        (chapter / name).write_text("chapter")
    (tmp_path / "submitted" / "ann" / "06_engine" / "06_engine.ipynb").unlink()  # one never submitted
    notebooks = [str(sub / "08_capstone.ipynb")]
    copied = autograde_pre_convert_hook(assignment="*", student="*", notebooks=notebooks)
    graded = tmp_path / "autograded" / "ann" / "08_capstone"
    assert sorted(p.name for p in copied) == sorted(set(needed) - {"06_engine.ipynb"})
    assert (graded / "01_attention_and_chunks.ipynb").read_text() == "beside"
    assert (graded / "02_paged_kv_cache.ipynb").read_text() == "chapter"
    (graded / "08_capstone.ipynb").write_text("graded")
    for p in copied:
        p.chmod(0o444)  # nbgrader makes the autograded files read-only
    removed = autograde_post_convert_hook(assignment="*", student="*", notebooks=notebooks)
    assert sorted(removed) == sorted(copied)
    assert [p.name for p in graded.iterdir()] == ["08_capstone.ipynb"]
    # other assignments: nothing to do
    other = tmp_path / "submitted" / "ann" / "02_paged_kv_cache" / "02_paged_kv_cache.ipynb"
    assert autograde_pre_convert_hook(notebooks=[str(other)]) == []


# --- the real nbgrader -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """A course directory built from solutions/ with every assignment generated by ``nbgrader generate_assignment``."""
    pytest.importorskip("nbgrader", reason="nbgrader is not installed (the [classroom] extra: make classroom)")
    course = tmp_path_factory.mktemp("course")
    build_course(course, ROOT / "solutions")
    nbgrader(course, "generate_assignment", "*", "--force")
    return course


@pytest.mark.parametrize("stem", STEMS)
def test_generate_assignment_gives_the_exercise_notebooks(course, stem):
    released = _read(course / "release" / stem / f"{stem}.ipynb")
    exercise = _read(ROOT / "exercises" / f"{stem}.ipynb")
    assert [c.cell_type for c in released.cells] == [c.cell_type for c in exercise.cells]
    for i, (got, want) in enumerate(zip(released.cells, exercise.cells)):
        assert got.source == want.source, f"{stem}: cell {i} differs from exercises/{stem}.ipynb"
    assert all(not c.get("outputs") for c in released.cells)
    locked = [c.metadata["nbgrader"]["grade_id"] for c in released.cells
              if c.metadata.get("editable") is False]
    assert locked == [e.check_id for e in notebook_exercises(_read(ROOT / "solutions" / f"{stem}.ipynb"), stem)]


def _exercises_only(exercises):
    return [e for e in exercises if not e.challenge]


def _expected(stem: str) -> dict[str, dict[str, float]]:
    """student -> check grade id -> the score it must get (computed from the solution notebook, not nbgrader). A
    solved challenge scores its extra credit (its check is worth 0 points)."""
    exercises = notebook_exercises(_read(ROOT / "solutions" / f"{stem}.ipynb"), stem)
    solved = {"sample_solved": exercises, "sample_unsolved": [],
              "sample_half": _exercises_only(exercises)[:half_count(exercises)]}
    return {student: {e.check_id: float(e.points + e.extra_credit if e in solved[student] else 0) for e in exercises}
            for student in SAMPLE_STUDENTS}


DELEGATING_STUDENT = "sample_delegating"
# make test grades the delegating student on chapter 02 (no model to load: seconds); make test-classroom on all.
DELEGATING_CHAPTERS = CHAPTERS if CHOSEN else ["02_paged_kv_cache"]


def _submit_delegating(course: Path, assignment: str) -> None:
    """A student who answers every exercise by calling the package's own implementation of its part
    (tests/course/delegating_answers.py); for the capstone, the chapter notebooks beside it are answered the same way."""
    from minillm.course.exercises.nbgrader import learner_notebook
    from tests.course.delegating_answers import answer_cell

    def delegate(nb):
        for cell in nb.cells:
            m = re.match(r"# Exercise (\d+\.\d+):", cell.source) if cell.cell_type == "code" else None
            if m:
                cell.source = answer_cell(m.group(1))
        return nb

    folder = course / "submitted" / DELEGATING_STUDENT / assignment
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(delegate(_read(course / "release" / assignment / f"{assignment}.ipynb")),
                   folder / f"{assignment}.ipynb")
    for name in siblings_needed().get(assignment, ()):
        nbformat.write(delegate(learner_notebook(_read(ROOT / "solutions" / name), set())), folder / name)


def _cheats() -> dict[str, dict[str, dict[str, str]]]:
    """The cheating students graded here: on the chapters of ``CHEATS`` being graded (``make test-classroom``: all),
    at least on chapter 10 (``make test``: no model to load). Chapter 10's checks meet every trick of both students
    under nbgrader; the one cell of chapter 06 that only its check can catch (6.1 returning the check's own ``want``)
    is run in-process in tests/course/test_exercises_06.py."""
    from tests.course.delegating_answers import CHEATS

    return {a: s for a, s in CHEATS.items() if a in CHAPTERS} or {"10_engine_core": CHEATS["10_engine_core"]}


def _submit_cheats(course: Path) -> dict[str, list[str]]:
    """The cheating students of tests/course/delegating_answers.py (``CHEATS``), each with their answer cells in the
    released notebook; returns assignment -> students."""
    from tests.course.delegating_answers import cheat_cell

    submitted: dict[str, list[str]] = {}
    for assignment, students in _cheats().items():
        for student, cells in students.items():
            nb = _read(course / "release" / assignment / f"{assignment}.ipynb")
            for cell in nb.cells:
                m = (re.match(r"# (?:Exercise (\d+\.\d+)|Challenge (\d+)):", cell.source)
                     if cell.cell_type == "code" else None)
                number = m and (m.group(1) or f"C{m.group(2)}")
                if number in cells:
                    cell.source = cheat_cell(number, cells[number])
            folder = course / "submitted" / student / assignment
            folder.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, folder / f"{assignment}.ipynb")
            submitted.setdefault(assignment, []).append(student)
    return submitted


@pytest.fixture(scope="module")
def graded(course):
    """The sample students graded on CHAPTERS, a student whose answers delegate to the package, and the cheating
    students (chapters 06 and 10): returns assignment -> student -> grade id -> score, per run."""
    for assignment in DELEGATING_CHAPTERS:
        _submit_delegating(course, assignment)
    cheats = _submit_cheats(course)
    # autograde grades every submission not yet graded: the cheats' chapters too
    grade_samples(course, CHAPTERS, ROOT / "solutions", also=sorted(cheats))
    scores = {a: {s: cell_scores(course, a, s)
                  for s in (*SAMPLE_STUDENTS, *([DELEGATING_STUDENT] if a in DELEGATING_CHAPTERS else []))}
              for a in CHAPTERS}
    for assignment, students in cheats.items():
        scores.setdefault(assignment, {}).update({s: cell_scores(course, assignment, s) for s in students})
    return scores


@pytest.mark.slow
@pytest.mark.timeout(GRADE_TIMEOUT)
def test_every_cheat_scores_zero(graded):
    """tests/course/delegating_answers.py's CHEATS: an input transformer that rewrites the check cells, a patched checker
    and tripwire, a rebound guard, the check's own answer read from a global or the caller's frame, the package's
    function captured in a default argument, an alias, a container, a partial, a copied code object, the module
    loaded again, getsource + exec, unwrap and gc. Each student scores 0 in every cell."""
    cheats = _cheats()
    assert cheats, "no cheating student is graded"
    for assignment, students in cheats.items():
        for student in students:
            cells = graded[assignment][student]
            assert cells, f"{assignment}, {student}: no graded cell"
            assert all(score == 0.0 for score, _ in cells.values()), f"{assignment}, {student}: {cells}"


@pytest.mark.slow
@pytest.mark.timeout(GRADE_TIMEOUT)
def test_autograde_gives_full_zero_and_the_exact_partial_score(course, graded):
    for stem in CHAPTERS:
        expected = _expected(stem)
        cheats = set(graded.get(stem, {})) - set(SAMPLE_STUDENTS) - {DELEGATING_STUDENT}  # test_every_cheat_...
        scores = {s: v for s, v in gradebook_scores(course, stem).items() if s not in cheats}
        exercises = notebook_exercises(_read(ROOT / "solutions" / f"{stem}.ipynb"), stem)
        total = float(sum(e.points for e in exercises))  # the maximum: challenges add extra credit above it
        with_extra = sum(expected["sample_solved"].values())
        half = sum(expected["sample_half"].values())
        if len(_exercises_only(exercises)) > 1:  # the capstone has one exercise: its half-solved copy solves none
            assert 0 < half < total, f"{stem}: the half-solved student must score between 0 and {total}"
        assert with_extra == total + sum(e.extra_credit for e in exercises)
        delegating = {DELEGATING_STUDENT: (0.0, total)} if stem in DELEGATING_CHAPTERS else {}
        assert scores == {"sample_solved": (with_extra, total), "sample_unsolved": (0.0, total),
                          "sample_half": (half, total), **delegating}, stem
        if delegating:
            delegated = graded[stem][DELEGATING_STUDENT]
            assert delegated and all(score == 0.0 for score, _ in delegated.values()), f"{stem}: {delegated}"
        for student in SAMPLE_STUDENTS:
            got = {gid: score for gid, (score, _) in graded[stem][student].items()}
            assert got == expected[student], f"{stem}, {student}: cell scores {got}"


def _text(path: Path) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", path.read_text())).split())


@pytest.mark.slow
@pytest.mark.timeout(GRADE_TIMEOUT)
def test_feedback_names_the_first_exercise_left_unsolved(course, graded):
    for stem in CHAPTERS:
        exercises = notebook_exercises(_read(ROOT / "solutions" / f"{stem}.ipynb"), stem)
        first_unsolved = _exercises_only(exercises)[half_count(exercises)]
        text = _text(course / "feedback" / "sample_half" / stem / f"{stem}.html")
        half = sum(e.points for e in _exercises_only(exercises)[:half_count(exercises)])
        assert f"{stem} (Score: {half}.0 / {sum(e.points for e in exercises)}.0)" in text
        start = text.index(f"Grade cell: {first_unsolved.check_id} Score: 0.0 / {first_unsolved.points}.0")
        cell = text[start:text.find("Grade cell:", start + 1)]
        assert f"# Check Exercise {first_unsolved.number}" in cell
        if stem in siblings_needed():
            # the capstone stops before the learner's loop runs: the first missing part is named
            assert f"Exercise {first_unsolved.number}" in cell and "AssertionError" in cell, cell[:2000]
        else:
            assert re.search(rf"NotImplementedError\s*:\s*Exercise {re.escape(first_unsolved.number)}:", cell), \
                f"{stem}: the feedback of {first_unsolved.check_id} does not show the stub's error:\n{cell[:2000]}"
        total = sum(e.points for e in exercises)
        extra = sum(e.extra_credit for e in exercises)
        solved = _text(course / "feedback" / "sample_solved" / stem / f"{stem}.html")
        assert f"{stem} (Score: {total + extra}.0 / {total}.0)" in solved
        if stem in DELEGATING_CHAPTERS:
            delegating = _text(course / "feedback" / DELEGATING_STUDENT / stem / f"{stem}.html")
            assert f"{stem} (Score: 0.0 / {total}.0)" in delegating
            assert "asks you to write this yourself" in delegating


@pytest.mark.slow
def test_the_demo_grades_a_check_cell_pass_or_fail_whatever_it_displays(tmp_path, capsys):
    """``python -m minillm.course.exercises nbgrader DIR --demo`` (what ``make classroom-demo`` runs) on a one-exercise
    notebook whose check displays 7 and writes a warning to stderr. nbgrader's own rule would read the 7 as partial
    credit (more than the cell's 2 points: an error) and the warning as a failure; the course's rule gives all the
    points to a check that ran through."""
    pytest.importorskip("nbgrader", reason="nbgrader is not installed (the [classroom] extra: make classroom)")
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    nb = _toy("Points: 2 (★ = 1, ★★ = 2, ★★★ = 3)")
    nb.cells[3].source = ("# Check Exercise 9.1\nimport sys\nassert f(1) == 2\n"
                          "print('a warning', file=sys.stderr)\n7")
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nbformat.write(nb, solutions / "09_toy.ipynb")
    course = tmp_path / "course"
    assert main(["nbgrader", str(course), "--solutions", str(solutions), "--demo", "09_toy"]) == 0
    assert gradebook_scores(course, "09_toy") == {"sample_solved": (2.0, 2.0), "sample_unsolved": (0.0, 2.0),
                                                   "sample_half": (0.0, 2.0)}
    assert "sample_solved    2 / 2   (expected 2)" in capsys.readouterr().out
    assert (course / "feedback" / "sample_unsolved" / "09_toy" / "09_toy.html").exists()


@pytest.mark.slow
@pytest.mark.timeout(GRADE_TIMEOUT)
def test_scores_are_the_same_when_graded_again(course, graded):
    if CHOSEN:  # make test-classroom: every sample student again on every chapter it graded
        grade_samples(course, CHAPTERS, ROOT / "solutions")
        again = {a: {s: cell_scores(course, a, s) for s in SAMPLE_STUDENTS} for a in CHAPTERS}
        assert again == {a: {s: graded[a][s] for s in SAMPLE_STUDENTS} for a in CHAPTERS}
        return
    # make test: the half-solved student (some cells full, some zero) on chapter 02 (no model to load), its grading
    # and feedback removed first so that nbgrader runs the notebook again rather than skip it.
    assignment, student = "02_paged_kv_cache", "sample_half"
    for step in ("autograded", "feedback"):
        shutil.rmtree(course / step / student / assignment)
    nbgrader(course, "autograde", assignment, "--student", student)
    nbgrader(course, "generate_feedback", assignment, "--student", student)
    assert (course / "feedback" / student / assignment / f"{assignment}.html").exists()
    assert cell_scores(course, assignment, student) == graded[assignment][student]


def test_the_classroom_extra_and_everything_it_pulls_in_are_pinned():
    """requirements/constraints.txt pins nbgrader and every package it needs, at the versions installed here."""
    pytest.importorskip("nbgrader", reason="nbgrader is not installed (the [classroom] extra: make classroom)")
    import tomllib
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (ROOT / "requirements" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["classroom"]
    assert [Requirement(r).name for r in extra] == ["nbgrader"]
    todo, seen, unpinned = [Requirement(r) for r in extra], set(), []
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            continue  # an optional dependency for another platform
        if pins.get(key[0]) != dist.version:
            unpinned.append(f"{req.name}=={dist.version} (pinned: {pins.get(key[0])})")
        for child in map(Requirement, dist.requires or []):
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                todo.append(child)
    assert not unpinned, f"requirements/constraints.txt must pin: {sorted(set(unpinned))}"
    assert ".[classroom]" in (ROOT / "environment.yml").read_text(), "environment.yml must say how to add the extra"
