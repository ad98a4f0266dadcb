"""The run-time statements of the notebooks: each has one, the conftest check reads it, and rejects what it must."""
from pathlib import Path

import pytest

from tests.notebooks.notebook_times import NOTEBOOK_LIMIT_S, run_time_problem, stated_run_time

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_notebook_states_a_run_time_under_the_limit(path):
    stated = stated_run_time(str(path))
    assert stated is not None, f"{path.name}: add 'Run time: about N min on a 2-core CPU' to its opening"
    assert stated <= NOTEBOOK_LIMIT_S


def test_the_run_time_check_accepts_rounding_and_rejects_the_rest():
    assert run_time_problem("x", 70, 60.0) is None          # "about 1 min"
    assert run_time_problem("x", 20, 60.0) is None          # a fast machine
    assert "states about 60 s" in run_time_problem("x", 160, 60.0)
    assert "states about 120 s" in run_time_problem("x", 5, 120.0)
    assert "over the 180 s" in run_time_problem("x", 200, 120.0)
    assert "no 'Run time" in run_time_problem("x", 10, None)
