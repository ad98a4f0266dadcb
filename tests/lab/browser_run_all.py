"""Every lesson run top to bottom with Run All in JupyterLab in Chromium, as a learner does after ``make lab``.

About 8 minutes on 2 cores, so it is not collected by ``make test`` (the file name does not match ``test_*.py``);
``make test-browser`` passes it to pytest explicitly, next to tests/lab/test_browser.py, whose JupyterLab and Chromium
fixtures it uses.
"""
import re

import pytest

from tests.lab.test_browser import ROOT, _menu, _open, browser, lab, page  # noqa: F401 - fixtures used by name

# Every lesson, and the capstone solved (it reads the solution notebooks beside it, as a learner's reads theirs).
LESSONS = sorted(f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")) + ["solutions/08_capstone.ipynb"]


@pytest.mark.parametrize("name", LESSONS)
def test_run_all_in_jupyterlab(page, lab, name):
    """Run All, as a learner does after `make lab`: every code cell gets an execution count and none shows an
    error."""
    _open(page, lab, name)
    _menu(page, "Run", "Run All Cells")
    # [prompt text, source] of every code cell whose source is shown; an empty cell never gets an execution count,
    # and a cell whose source is hidden (the prose-assert cells, `source_hidden`) shows neither source nor count.
    state = """() => [...document.querySelectorAll('.jp-CodeCell')].map(c => [
        c.querySelector('.jp-InputPrompt')?.textContent.trim() ?? '',
        c.querySelector('.jp-InputArea-editor')?.textContent ?? ''])"""
    # Done when every shown cell has its count and the kernel is idle (hidden cells after the last shown one ran
    # too), or as soon as an error appears.
    page.wait_for_function(
        f"""() => (({state})().every(([p, src]) => /^\\[\\d+\\]:$/.test(p) || !src.trim())
                   && [...document.querySelectorAll('.jp-StatusBar-Widget')].some(w => w.textContent.includes('| Idle')))
                 || [...document.querySelectorAll('.jp-OutputArea-output')].some(o => o.textContent.includes('Traceback'))""",
        timeout=600_000, polling=1000)
    errors = page.locator(".jp-OutputArea-output", has_text="Traceback")
    assert errors.count() == 0, f"{name}: {errors.first.inner_text()[:2000]}"
    not_run = [i for i, (p, src) in enumerate(page.evaluate(state)) if src.strip() and not re.fullmatch(r"\[\d+\]:", p)]
    assert not not_run, f"{name}: code cells {not_run} did not run"
