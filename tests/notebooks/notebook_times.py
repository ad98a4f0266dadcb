"""A pytest plugin (registered by the repository's root conftest.py): the notebooks' run times under nbval."""
from __future__ import annotations

import os
import re


# -- notebook run times ---------------------------------------------------------------------------------------------
# Every lesson and exercise notebook states its run time on a 2-core CPU ("Run time: about N min"). Under nbval, the
# controller adds up the time of each notebook's cells (kernel start included) and fails the session when a notebook
# takes over NOTEBOOK_LIMIT_S or is far from what it states. make test runs each notebook single-threaded on one of
# CI's 2 cores: what a learner's laptop gives a kernel, give or take.
NOTEBOOK_LIMIT_S = 180.0
_RUN_TIME = re.compile(r"Run time:\**\s*[^\n]*?about (\d+(?:\.\d+)?)\s*(s|min)\b")
_notebook_seconds: dict[str, float] = {}
_notebook_cells: dict[str, int] = {}


def stated_run_time(path: str) -> float | None:
    """The run time a notebook states in its markdown ("Run time: about 2 min" -> 120.0), or None."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = _RUN_TIME.search(cell.source)
            if m:
                return float(m.group(1)) * (60.0 if m.group(2) == "min" else 1.0)
    return None


def run_time_problem(path: str, seconds: float, stated: float | None) -> str | None:
    """Why a notebook's measured time is not acceptable, or None. Stated times are rounded ("about 1 min"), so
    a measurement within [stated / 3 - 20 s, 2 x stated + 30 s] agrees with it."""
    if stated is None:
        return f"{path}: no 'Run time: about N s|min' line in its markdown"
    if seconds > NOTEBOOK_LIMIT_S:
        return f"{path}: ran {seconds:.0f} s, over the {NOTEBOOK_LIMIT_S:.0f} s every notebook must stay under"
    if seconds > 2 * stated + 30 or seconds < stated / 3 - 20:
        return f"{path}: ran {seconds:.0f} s but states about {stated:.0f} s"
    return None


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        _notebook_seconds[path] = _notebook_seconds.get(path, 0.0) + report.duration
        if report.when == "call":
            _notebook_cells[path] = _notebook_cells.get(path, 0) + (1 if report.passed else 0)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput") or not _notebook_seconds:
        return  # an xdist worker: the controller sees every report and checks
    import nbformat

    problems, lines = [], []
    for path, seconds in sorted(_notebook_seconds.items()):
        full = os.path.join(str(session.config.rootpath), path)
        code_cells = sum(c.cell_type == "code" for c in nbformat.read(full, as_version=4).cells)
        if _notebook_cells.get(path, 0) < code_cells:
            continue  # not every cell ran and passed (a -k selection, or a failure already reported)
        stated = stated_run_time(full)
        lines.append(f"{path}: {seconds:.0f} s (states {stated:.0f} s)" if stated else f"{path}: {seconds:.0f} s")
        problem = run_time_problem(path, seconds, stated)
        if problem:
            problems.append(problem)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and lines:
        reporter.write_sep("-", "notebook run times")
        for line in lines:
            reporter.write_line(line)
        for p in problems:
            reporter.write_line(f"RUN TIME PROBLEM: {p}", red=True)
    if problems and session.exitstatus == 0:
        session.exitstatus = 1
