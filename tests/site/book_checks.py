"""The course website's build checks (``make test-book``; kept out of ``make test``, which does not build the site).

Two kinds of test:

- **The real site** in ``build/book`` (``make book`` builds it first): the check that ends every build finds
  nothing (book/_ext/check_site.py: links, anchors, images, scripts from outside, a page per notebook); each link of
  notebook 00's question table lands on the section whose heading is the question it names; widgets are their stored
  picture with the note; every exercise page says how to open it locally; the table of contents lists every notebook.
- **Small broken sites.** A minimal course (two READMEs, a glossary, two lessons, an exercise) is built with the
  real configuration (book/conf.py) in a temporary folder: as made, it builds; each deliberate fault (a link to a
  missing notebook, a ``#cell-id=`` that is in no cell of the target, a heading anchor that does not exist, a
  missing image, a notebook in no toctree, a widget without its picture) must make ``sphinx-build -W`` fail, with a
  message that names the fault. ``check_site`` alone is tested on hand-written pages.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "build" / "book"
BOOK = ROOT / "book"
sys.path.insert(0, str(BOOK / "_ext"))

from check_site import check_site  # noqa: E402

pytest.importorskip("myst_nb", reason="the [book] extra is not installed (make book installs it)")


def _site():
    if not (SITE / "README.html").is_file():
        pytest.fail(f"{SITE} is not built: run `make book` (make test-book does)")
    return SITE


class _Sections(HTMLParser):
    """id -> text of the first heading inside the element of that id (sections), for one page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []  # ids waiting for their first heading
        self.heading_of: dict[str, str] = {}
        self._in_heading = False
        self._text = ""
        self.links: list[tuple[str, str]] = []
        self._a: str | None = None
        self._a_text = ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.open.append(a["id"])
        if re.fullmatch(r"h[1-6]", tag):
            self._in_heading, self._text = True, ""
        if tag == "a" and a.get("href"):
            self._a, self._a_text = a["href"], ""

    def handle_endtag(self, tag):
        if re.fullmatch(r"h[1-6]", tag) and self._in_heading:
            self._in_heading = False
            for i in self.open:
                self.heading_of.setdefault(i, self._text.strip().rstrip("#").strip())
            self.open = []
        if tag == "a" and self._a is not None:
            self.links.append((self._a, self._a_text.strip()))
            self._a = None

    def handle_data(self, data):
        if self._in_heading:
            self._text += data
        if self._a is not None:
            self._a_text += data


def _sections(page: Path) -> _Sections:
    p = _Sections()
    p.feed(page.read_text(encoding="utf-8"))
    return p


# ---- the real site -----------------------------------------------------------------------------------------------

def test_the_built_site_passes_its_own_check():
    assert check_site(_site(), ROOT) == []


def test_every_notebook_has_a_page_listed_in_the_table_of_contents():
    readme = (_site() / "README.html").read_text(encoding="utf-8")
    for nb in sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("exercises/*.ipynb")):
        rel = nb.relative_to(ROOT).with_suffix(".html").as_posix()
        assert (SITE / rel).is_file(), f"{rel} was not built"
        assert f'href="{rel}"' in readme, f"{rel} is not in the table of contents of the landing page"
    for page in ("docs/glossary.html", "README.zh-CN.html", "search.html", "index.html"):
        assert (SITE / page).is_file(), page


def test_question_table_links_land_on_the_question_they_name():
    """Every ``NN §Learner question QN`` link of notebook 00 reaches the section headed ``Learner question QN``."""
    page = _site() / "notebooks" / "00_welcome.html"
    links = [(href, text) for href, text in _sections(page).links if "§Learner question" in text]
    assert len(links) >= 16, f"expected the 16 links of the question table, found {len(links)}"
    for href, text in links:
        target, _, frag = href.partition("#")
        assert frag, f"{text}: {href} has no anchor"
        headings = _sections(page.parent / target).heading_of
        want = text.split("§", 1)[1].strip()
        assert headings.get(frag) == want, f"{text}: {href} lands on {headings.get(frag)!r}, not {want!r}"


def test_cross_chapter_links_keep_no_cell_id_fragment():
    for page in sorted((_site() / "notebooks").glob("*.html")):
        html = page.read_text(encoding="utf-8")
        assert "#cell-id=" not in html, f"{page.name}: a #cell-id= link was not mapped to its heading"


def test_widgets_are_their_stored_picture_with_a_note():
    for name in ("02_paged_kv_cache", "04_scheduler"):
        html = (_site() / "notebooks" / f"{name}.html").read_text(encoding="utf-8")
        assert "The widget above is its stored picture: it is interactive in JupyterLab" in html, name
        before_note = html.split("The widget above is its stored picture")[0]
        last_cell = before_note.rsplit('<div class="cell', 1)[-1]
        assert re.search(r'<img[^>]+src="[^"]+\.png"', last_cell), f"{name}: no picture in the widget's cell"
        assert "widget-view+json" not in html and "embed-amd" not in html and "require.min.js" not in html, name


def test_exercise_pages_say_how_to_open_them_locally():
    for nb in sorted(ROOT.glob("exercises/*.ipynb")):
        html = (_site() / "exercises" / f"{nb.stem}.html").read_text(encoding="utf-8")
        assert "Work on this exercise locally" in html and f"exercises/{nb.name}" in html, nb.name


def test_math_is_served_from_the_site():
    html = (_site() / "notebooks" / "01_attention_and_chunks.html").read_text(encoding="utf-8")
    src = re.search(r'<script[^>]+src="([^"]*tex-svg\.js[^"]*)"', html)
    assert src, "the page does not load MathJax (tex-svg.js)"
    assert not re.match(r"(https?:)?//", src.group(1)), f"MathJax must load from the site itself, not {src.group(1)}"
    assert (SITE / "_static" / "mathjax" / "tex-svg.js").is_file()
    assert (SITE / "_static" / "mathjax" / "input" / "tex" / "extensions").is_dir()  # what tex-svg.js may load
    assert 'class="math' in html


# ---- small broken sites ------------------------------------------------------------------------------------------

def _nb(cells: list[tuple[str, str, str]], widgets: dict | None = None) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for kind, cid, src in cells:
        cell = nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
        cell.id = cid
        nb.cells.append(cell)
    if widgets:
        nb.metadata["widgets"] = widgets
    return nb


def _course(root: Path) -> Path:
    """A minimal course with everything the site shows; builds cleanly."""
    (root / "docs").mkdir(parents=True)
    (root / "notebooks").mkdir()
    (root / "exercises").mkdir()
    (root / "README.md").write_text("# Mini course\n\n[中文说明](README.zh-CN.md)\n\nRead [00](notebooks/00_a.ipynb).\n")
    (root / "README.zh-CN.md").write_text("# 迷你课程\n\n[English](README.md) · [术语表](docs/glossary.md)\n")
    (root / "docs" / "glossary.md").write_text("# Glossary · 术语表\n\n| term | 中文 |\n|---|---|\n| chunk | chunk |\n")
    nbformat.write(_nb([("md", "t00", "# 00 · Start\n\nSee [01 §Learner question Q1](01_b.ipynb#cell-id=q1cell)."),
                        ("code", "c00", "x = 1")]), root / "notebooks" / "00_a.ipynb")
    nbformat.write(_nb([("md", "t01", "# 01 · Next\n\nMath: $\\ell + 1$."),
                        ("md", "q1cell", "## 1. Chunks\n\n### Learner question Q1\n\nThe answer.")]),
                   root / "notebooks" / "01_b.ipynb")
    nbformat.write(_nb([("md", "e00", "# Exercise 0\n\n### Exercise 0.1"),
                        ("code", "e01", "raise NotImplementedError")]), root / "exercises" / "00_a.ipynb")
    return root


def _build(src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-c", str(BOOK),
                           "-d", str(out.parent / "doctrees"), str(src), str(out)],
                          capture_output=True, text=True, timeout=600)


def _edit_notebook(path: Path, cell_id: str, source: str) -> None:
    nb = nbformat.read(path, as_version=4)
    next(c for c in nb.cells if c.id == cell_id).source = source
    nbformat.write(nb, path)


@pytest.fixture
def course(tmp_path):
    return _course(tmp_path / "src"), tmp_path / "out" / "book"


def test_the_minimal_course_builds_and_its_link_lands_on_the_named_heading(course):
    src, out = course
    r = _build(src, out)
    assert r.returncode == 0, r.stdout + r.stderr
    html = (out / "notebooks" / "00_a.html").read_text(encoding="utf-8")
    assert 'href="01_b.html#learner-question-q1"' in html  # the heading the link names, not the cell's first one
    assert "Work on this exercise locally" in (out / "exercises" / "00_a.html").read_text(encoding="utf-8")


BROKEN = {
    "link to a missing notebook": (
        lambda s: _edit_notebook(s / "notebooks" / "00_a.ipynb", "t00", "# 00\n\nSee [99](99_missing.ipynb)."),
        "99_missing"),
    "cell id in no cell of the target": (
        lambda s: _edit_notebook(s / "notebooks" / "00_a.ipynb", "t00", "# 00\n\n[Q1](01_b.ipynb#cell-id=deadbeef)."),
        "cell-id=deadbeef"),
    "cell id of a cell without a heading": (
        lambda s: _edit_notebook(s / "notebooks" / "00_a.ipynb", "t00", "# 00\n\n[x](00_a.ipynb#cell-id=c00)."),
        "cell-id=c00"),
    "heading anchor that does not exist": (
        lambda s: _edit_notebook(s / "notebooks" / "00_a.ipynb", "t00",
                                 "# 00\n\n[Q9](01_b.ipynb#learner-question-q9)."),
        "learner-question-q9"),
    "missing image": (
        lambda s: _edit_notebook(s / "notebooks" / "01_b.ipynb", "t01", "# 01\n\n![a figure](figures/missing.png)"),
        "missing.png"),
    "missing image in raw HTML": (
        lambda s: _edit_notebook(s / "notebooks" / "01_b.ipynb", "t01", '# 01\n\n<img src="figures/gone.png">\n'),
        "gone.png"),
    "notebook in no toctree": (
        lambda s: nbformat.write(_nb([("md", "s0", "# A stray page")]), s / "docs" / "stray.ipynb"),
        "stray"),
    "lesson in a sub-folder, in no toctree": (
        lambda s: ((s / "notebooks" / "extra").mkdir(),
                   nbformat.write(_nb([("md", "s1", "# Extra")]), s / "notebooks" / "extra" / "10_x.ipynb")),
        "10_x"),
    "widget without a stored picture": (
        lambda s: _add_widget_without_picture(s / "notebooks" / "01_b.ipynb"),
        "no stored picture"),
}


def _add_widget_without_picture(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    cell = nbformat.v4.new_code_cell("w.ui()")
    cell.id = "w0"
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": {"model_id": "abc", "version_major": 2, "version_minor": 0},
        "text/plain": "VBox()"})]
    nb.cells.append(cell)
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {
        "state": {"abc": {"model_name": "VBoxModel", "state": {"children": []}}}, "version_major": 2,
        "version_minor": 0}}
    nbformat.write(nb, path)


@pytest.mark.parametrize("fault", list(BROKEN))
def test_the_build_fails_on(course, fault):
    src, out = course
    make_fault, needle = BROKEN[fault]
    make_fault(src)
    r = _build(src, out)
    log = r.stdout + r.stderr
    assert r.returncode != 0, f"{fault}: the build passed\n{log[-3000:]}"
    assert needle in log, f"{fault}: the build failed without naming it ({needle!r}):\n{log[-3000:]}"


# ---- check_site on hand-written pages --------------------------------------------------------------------------

def test_check_site_reports_each_kind_of_problem(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "pic.png").write_bytes(b"\x89PNG")
    (tmp_path / "index.html").write_text(
        '<a href="a/b.html#there">ok</a> <a href="a/b.html#nowhere">bad anchor</a> <a href="gone.html">bad page</a>'
        '<a href="#self">self</a><p id="self"></p><img src="pic.png"><img src="nope.png">'
        '<img src="data:image/png;base64,AAAA"><a href="https://example.org/">external link: fine</a>'
        '<script src="https://cdn.example.org/x.js"></script><link rel="stylesheet" href="missing.css">')
    (tmp_path / "a" / "b.html").write_text('<section id="there"><h2>There</h2></section><a href="../index.html">up</a>')
    problems = check_site(tmp_path)
    text = "\n".join(problems)
    assert len(problems) == 5, text
    for needle in ("'nowhere'", "gone.html", "nope.png", "cdn.example.org", "missing.css"):
        assert needle in text, f"{needle} not reported:\n{text}"
    src = tmp_path / "src"
    (src / "notebooks").mkdir(parents=True)
    (src / "notebooks" / "05_x.ipynb").write_text(json.dumps({}))
    assert any("05_x.ipynb has no page" in p for p in check_site(tmp_path, src))
