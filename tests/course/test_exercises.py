"""The exercise mechanism end to end: exercises/ is a fresh build of solutions/, and every check cell of an exercise
notebook fails until the learner writes the code (the solution notebooks themselves are run by nbval)."""
import os
from pathlib import Path

import nbformat
import pytest

from minillm.course.exercises.build import BEGIN, build_all, build_notebook, strip_solutions

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_exercises_equal_a_fresh_build(tmp_path):
    stale = build_all(ROOT / "solutions", ROOT / "exercises", check=True)
    assert not stale, f"exercises/ is out of date; run `python -m minillm.course.exercises build`: {stale}"
    assert sorted(p.name for p in (ROOT / "exercises").glob("*.ipynb")) == [p.name for p in SOLUTIONS]


def test_strip_solutions_keeps_indentation_and_title():
    src = "# Exercise 9.1: add one\ndef f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n"
    assert strip_solutions(src) == ("# Exercise 9.1: add one\ndef f(x):\n"
                                    "    raise NotImplementedError('Exercise 9.1: add one')")
    with pytest.raises(ValueError, match="must start with"):
        strip_solutions("def f():\n    ### BEGIN SOLUTION\n    pass\n    ### END SOLUTION")
    with pytest.raises(ValueError, match="without"):
        strip_solutions("# Exercise 9.2: x\n### BEGIN SOLUTION\npass")


def _check_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"
            and c.source.lstrip().startswith(("# Check Exercise", "# Check Challenge"))]


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_every_exercise_has_a_check_cell(solution):
    nb = nbformat.read(solution, as_version=4)
    exercises = [c for c in nb.cells if c.cell_type == "code" and BEGIN in c.source]
    assert exercises, f"{solution.name} has no exercise"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and BEGIN in cell.source:
            title = strip_solutions(cell.source).splitlines()[0]
            number = title.split(":")[0].replace("#", "").strip()  # "Exercise N.M" or "Challenge N"
            following = next((c for c in nb.cells[i + 1:] if c.cell_type == "code"), None)
            assert following is not None and following.source.lstrip().startswith(f"# Check {number}"), (
                f"{solution.name}: {number} must be followed by a '# Check {number}' cell")
    assert len(_check_cells(nb)) >= len(exercises)


@pytest.mark.slow
@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_exercise_checks_fail_until_solved(solution):
    from nbclient import NotebookClient

    nb = build_notebook(nbformat.read(solution, as_version=4))
    env = dict(os.environ)
    # The kernel is killed with its process group once the last cell ran (as nbval does): a graceful shutdown waited
    # 2.5 s for a notebook that started a process (multiprocessing's resource tracker ignores the SIGTERM ipykernel
    # sends its children), and the outputs are all in by then.
    NotebookClient(nb, timeout=600, allow_errors=True, kernel_name="python3", shutdown_kernel="immediate",
                   resources={"metadata": {"path": str(ROOT / "exercises")}}).execute(env=env)
    for cell in _check_cells(nb):
        errors = [o for o in cell.outputs if o.output_type == "error"]
        name = cell.source.lstrip().splitlines()[0]
        assert errors, f"{solution.name}: '{name}' passed on the unsolved exercise; the stub is not real"
        assert errors[0].ename in ("NotImplementedError", "AssertionError"), (
            f"{solution.name}: '{name}' failed with {errors[0].ename}: {errors[0].evalue}; a check should fail "
            "with NotImplementedError (stub) or AssertionError (wrong answer), not crash")


def test_check_cases_names_the_differing_case_even_with_nan():
    import torch

    from minillm.course.exercises import check_cases

    def ref(x):
        return x + 1

    with pytest.raises(AssertionError, match=r"max abs difference inf at index \(1,\)"):
        check_cases(lambda x: torch.where(x > 1, torch.nan, x + 1), ref, [{"x": torch.tensor([0.0, 2.0])}])
    with pytest.raises(AssertionError, match=r"shape \(1,\) != expected \(2,\)"):
        check_cases(lambda x: x[:1], ref, [{"x": torch.tensor([0.0, 2.0])}])
    assert check_cases(ref, ref, [{"x": torch.tensor([float("nan")])}]) == 1


def test_check_cases_reports_the_real_difference_next_to_matching_infinities():
    """Logits rows hold -inf on masked tokens: equal infinities must not be blamed (inf - inf is NaN), and a real
    infinite difference must read as inf, not as the largest finite float."""
    import torch

    from minillm.course.exercises import check_cases

    def ref(x):
        return x

    x = torch.tensor([float("-inf"), 1.0, 2.0])
    with pytest.raises(AssertionError, match=r"max abs difference 0\.5 at index \(2,\)"):
        check_cases(lambda x: x + torch.tensor([0.0, 0.0, 0.5]), ref, [{"x": x}])
    with pytest.raises(AssertionError, match=r"max abs difference inf at index \(1,\)"):
        check_cases(lambda x: torch.where(x == 1.0, float("inf"), x), ref, [{"x": x}])
