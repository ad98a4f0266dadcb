"""Lessons and solutions are stored executed (they must read well without running); exercises are stored blank.

nbval only compares the outputs a notebook stores, so a notebook saved without outputs would pass it while showing
the learner nothing: this test catches that.
"""
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXECUTED = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_stored_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    not_run = [i for i, c in enumerate(code) if c.execution_count is None]
    assert not not_run, f"{path.name}: code cells {not_run} were not executed; run the notebook and save it"
    assert any(c.outputs for c in code), f"{path.name} stores no outputs; run it top to bottom and save it"


@pytest.mark.parametrize("path", sorted((ROOT / "exercises").glob("*.ipynb")), ids=lambda p: p.stem)
def test_exercises_stored_blank(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.outputs for c in nb.cells if c.cell_type == "code"), f"{path.name} must be stored without outputs"
