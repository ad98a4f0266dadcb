"""The course in a real JupyterLab, in a real browser: what nbval cannot see because it clicks nothing.

JupyterLab is started on a free loopback port over a temporary copy of notebooks/, exercises/ and solutions/ (so
autosave cannot touch the repository), with its default settings, comms over subshells included (the setting under which
the old widgets raced matplotlib-inline and drew blank or garbled figures). Debian's Chromium is driven by
Playwright; it is never downloaded (``playwright install`` cannot reach its servers here).

- Notebooks 04 and 02 run their set-up cell and their widget cell; the widget is clicked 10 times. After every click the figure shown in
  the page must be exactly the figure the same widget draws headless after the same clicks (a twin driven in this
  process), not blank, and different from the one before whenever the state drawn changed.
- exercises/00_warmup.ipynb runs and the page shows ``NotImplementedError: Exercise 0.1: ...``.

Without Chromium or Playwright the test skips with a one-line reason; CI installs both (.ci/run, the [dev] extra).
Screenshots of a failure go to the test's temporary directory.
"""
from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import numpy as np
import pytest

from tests.net_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = next((p for p in (os.environ.get("MINILLM_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser")) if p), None)
# Flags for a closed network and a root container (CI): no sandbox, and no background calls to Google's hosts.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
CLICKS = 10
CELL_TIMEOUT_MS = 240_000  # the exercise notebook's Run All: seconds; 240 s leaves room for a busy 2-core machine

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server over a copy of notebooks/, exercises/ and solutions/; yields its base URL and token."""
    pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (it is in the [dev] extra)")
    if CHROMIUM is None:
        pytest.skip("no Chromium found (apt-get install chromium, or set MINILLM_CHROMIUM); the browser test needs it")
    root = tmp_path_factory.mktemp("lab")
    for d in ("notebooks", "exercises", "solutions"):
        shutil.copytree(ROOT / d, root / d)
    settings, app_settings = root / ".settings", root / ".app-settings"
    # All cells in the DOM (no virtual scrolling), so a cell can be found by its text.
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    news = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))  # no pop-up over the cells
    app_settings.mkdir()  # an empty app settings dir: JupyterLab's defaults, not make lab's overrides.json
    port, token = free_port(), "minillm-browser-test"
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(root / ".jupyter"), OMP_NUM_THREADS="2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--allow-root",
         f"--LabApp.user_settings_dir={settings}", f"--LabApp.app_settings_dir={app_settings}",
         f"--LabApp.workspaces_dir={root / '.workspaces'}"],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5)
                break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail(f"JupyterLab did not start: {proc.stdout.read(4000) if proc.poll() is not None else ''}")
        yield base, token
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def _shutdown_kernels(lab) -> None:
    """Stop every kernel the server runs (each lesson loads the model: they must not pile up)."""
    base, token = lab
    for k in json.loads(urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=10).read()):
        req = urllib.request.Request(f"{base}/api/kernels/{k['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(req, timeout=30)


@pytest.fixture
def page(browser, lab, tmp_path, request):
    pg = browser.new_page(viewport={"width": 1400, "height": 1000})
    yield pg
    call = getattr(request.node, "rep_call", None)  # set by tests/conftest.py's pytest_runtest_makereport
    if call is None or call.failed:
        pg.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
        print(f"screenshot of the page: {tmp_path / 'failure.png'}")
    pg.close()
    _shutdown_kernels(lab)


def _open(page, lab, path: str):
    base, token = lab
    page.goto(f"{base}/lab/tree/{path}?reset&token={token}")  # reset: only this notebook open, no restored tabs
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
    # The status bar shows the current notebook's kernel; menus act on it only once it is ready.
    page.locator(".jp-StatusBar-Widget", has_text="| Idle").first.wait_for(timeout=60_000)
    page.locator(".jp-Notebook .jp-Cell").first.click()  # focus the notebook


def _menu(page, menu: str, item: str):
    page.locator(".lm-MenuBar-itemLabel", has_text=menu).first.click()
    page.locator(".lm-Menu-itemLabel", has_text=item).first.click()


def _run_cell(page, cell) -> None:
    cell.locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("Shift+Enter")


def _run_to(page, needle: str):
    """Run the notebook's set-up cell (its first code cell after the engine map: imports, seeds, thread count), then
    the code cell whose source contains ``needle``. The widget cells are self-contained after the imports; running the whole lesson above
    them is what make test-browser's Run All does, and would tie this test to the lesson's timing claims on a machine
    shared with the other test worker."""
    setup = page.locator(".jp-CodeCell").filter(
        has_not=page.locator(".jp-InputArea-editor", has_text="# Where we are")).first  # after the engine map
    _run_cell(page, setup)
    cell = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea-editor", has_text=needle)).first
    _run_cell(page, cell)
    return cell


def _wait_for_output(page, target, what: str) -> None:
    """Wait for ``target`` to be visible; fail at once, quoting it, if any cell shows an error instead."""
    error = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                         has_text="Error").first
    deadline = time.time() + CELL_TIMEOUT_MS / 1000
    while time.time() < deadline:
        if target.is_visible():
            return
        if error.count() and error.is_visible():
            pytest.fail(f"a cell failed before {what} appeared:\n{error.inner_text()[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"{what} did not appear within {CELL_TIMEOUT_MS / 1000:.0f} s")


def _shown_png(img) -> bytes:
    """The bytes behind an <img> (a blob URL that ipywidgets made from the kernel's PNG), read in the page."""
    data = img.evaluate("""async (el) => {
        const buf = await (await fetch(el.src)).arrayBuffer();
        let s = ''; new Uint8Array(buf).forEach(b => s += String.fromCharCode(b)); return btoa(s); }""")
    return base64.b64decode(data)


def _rgb(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def _find(root, kind: str, description: str | None = None):
    stack = [root]
    while stack:
        w = stack.pop()
        if type(w).__name__ == kind and (description is None or getattr(w, "description", None) == description):
            return w
        stack.extend(getattr(w, "children", ()))
    raise LookupError(f"no {kind} {description!r} in the twin widget")


class _Checker:
    """Compares the page's widget figure with the headless twin's after each click."""

    def __init__(self, cell, twin_ui, tmp_path: Path):
        self.cell, self.twin_ui, self.tmp = cell, twin_ui, tmp_path
        self.img = cell.locator(".widget-image").first
        _wait_for_output(cell.page, self.img, "the widget's figure")
        self.last_src, self.last_expected = None, None
        self.check("first draw")

    def check(self, what: str) -> None:
        expected_png = bytes(_find(self.twin_ui, "Image").value)
        if self.last_expected is not None and expected_png != self.last_expected:  # the state drawn changed
            deadline = time.time() + 30
            while self.img.get_attribute("src") == self.last_src and time.time() < deadline:
                time.sleep(0.05)
            assert self.img.get_attribute("src") != self.last_src, f"{what}: the figure was not redrawn"
        self.last_src, self.last_expected = self.img.get_attribute("src"), expected_png
        shown = _rgb(_shown_png(self.img))
        expected = _rgb(expected_png)
        on_screen = _rgb(self.img.screenshot())
        if shown.shape != expected.shape or np.abs(shown - expected).max() > 0:
            from PIL import Image

            Image.fromarray(shown.astype(np.uint8)).save(self.tmp / "shown.png")
            Image.fromarray(expected.astype(np.uint8)).save(self.tmp / "expected.png")
            pytest.fail(f"{what}: the page's figure differs from the widget's own drawing "
                        f"(saved shown.png and expected.png in {self.tmp})")
        ink = float((on_screen.min(axis=2) < 250).mean())
        assert ink > 0.02, f"{what}: the figure on screen is blank ({ink:.1%} of its pixels are not white)"


def _click(cell, twin_ui, name: str) -> None:
    cell.get_by_role("button", name=name, exact=True).click()
    _find(twin_ui, "Button", name).click()


def _widget_in_lab(page, lab, notebook: str, needle: str, var: str, tmp_path: Path):
    """Open ``notebook`` in the page and run it up to its widget cell (the one containing ``needle``); build the same
    widget in this process by running that cell's code (``var`` names the widget object). Returns
    ``(cell, twin, twin_ui, checker)``."""
    import matplotlib

    _open(page, lab, f"notebooks/{notebook}")
    cell = _run_to(page, needle)
    matplotlib.use("Agg")
    nb = nbformat.read(ROOT / "notebooks" / notebook, as_version=4)
    src = next(c.source for c in nb.cells if c.cell_type == "code" and needle in c.source)
    ns: dict = {}
    exec("from minillm.config import SchedulerConfig\nfrom minillm.course.widgets import *\n"  # noqa: S102
         + src.replace(needle, ""), ns)
    twin = ns[var]
    twin_ui = twin.ui()
    return cell, twin, twin_ui, _Checker(cell, twin_ui, tmp_path)


def test_scheduler_stepper_in_jupyterlab(page, lab, tmp_path):
    cell, twin, twin_ui, chk = _widget_in_lab(page, lab, "04_scheduler.ipynb", "stepper.ui()", "stepper", tmp_path)
    for i in range(CLICKS):
        if i == 3:  # a request arrives mid-run: the status line says so; the figure (steps so far) stays the same
            _click(cell, twin_ui, "add request")
            cell.get_by_text("12-token prompt").first.wait_for(timeout=30_000)
            chk.check(f"click {i + 1} (add request)")
        else:
            _click(cell, twin_ui, "step")
            chk.check(f"click {i + 1} (step)")
    assert twin.step_index == 4 + CLICKS - 1  # 4 steps in the cell, then the clicks


def test_block_table_widget_in_jupyterlab(page, lab, tmp_path):
    cell, twin, twin_ui, chk = _widget_in_lab(page, lab, "02_paged_kv_cache.ipynb", "widget.ui()", "widget",
                                              tmp_path)
    prompt_box, req_box = cell.locator("select").nth(0), cell.locator("select").nth(1)

    def choose(box, description: str, label: str) -> None:
        box.select_option(label=label)
        _find(twin_ui, "Dropdown", description).value = label

    clicks = [("prompt", "A", "add request"), ("prompt", "A'", "add request"), ("prompt", "B", "add request"),
              ("request", "A0", "append tokens"), ("request", "A'1", "append tokens"), ("request", "A0", "free"),
              ("prompt", "A", "add request"), ("request", "B2", "append tokens"), ("request", "B2", "free"),
              (None, None, "reset")]
    assert len(clicks) == CLICKS
    cell.locator("input[type=number]").first.fill("5")  # 5 tokens per append: appends fill and open blocks
    _find(twin_ui, "BoundedIntText").value = 5
    for i, (which, label, button) in enumerate(clicks):
        if which == "prompt":
            choose(prompt_box, "prompt", label)
        elif which == "request":
            req_box.locator(f"option:text-is(\"{label}\")").wait_for(state="attached", timeout=30_000)
            choose(req_box, "request", label)
        _click(cell, twin_ui, button)
        chk.check(f"click {i + 1} ({button} {label or ''})")
    assert twin.manager.num_free_blocks == twin.num_blocks - 1  # reset: an empty pool again


def test_exercise_stub_shows_its_message(page, lab):
    _open(page, lab, "exercises/00_warmup.ipynb")
    _menu(page, "Run", "Run All Cells")
    err = page.locator(".jp-OutputArea-output", has_text="NotImplementedError").first
    err.wait_for(timeout=CELL_TIMEOUT_MS)
    assert "Exercise 0.1" in err.inner_text()

