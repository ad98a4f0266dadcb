"""The course website's build checks (``make test-book``; kept out of ``make test``, which does not build the site).

Two kinds of test:

- **The real site** in ``build/book`` (``make book`` builds it first): the check that ends every build finds
  nothing (book/_ext/check_site.py: links, anchors, images, scripts from outside, a page per notebook); each link of
  notebook 00's question table lands on the section whose heading is the question it names; widgets are their stored
  picture with the note; every exercise page says how to open it locally; the table of contents lists every notebook;
  the landing pages have a card per chapter (lesson and exercises) in their language; "Next" runs lesson NN →
  exercises NN → lesson NN+1 (the capstone after 07) and every lesson ends with a link to its exercises; test-harness
  lines (``# NBVAL_...``) and the cells that only check the prose (tagged ``remove-cell``/``remove-input`` in the
  notebooks, which this checks too) are not on the pages; each page has one menu and one "Contents" button (a second,
  hidden pair is what broke them: pydata-sphinx-theme#2451); the site's Chinese follows docs/glossary.md.
- **Small broken sites.** A minimal course (a landing page, two READMEs, a glossary, two lessons, an exercise) is
  built with the real configuration (book/conf.py) in a temporary folder: as made, it builds; each deliberate fault
  (a link to a missing notebook, a ``#cell-id=`` that is in no cell of the target, a heading anchor that does not
  exist, a missing image, a notebook in no toctree, a chapter book/chapters.toml does not know, a widget without its
  picture) must make ``sphinx-build -W`` fail, with a message that names the fault. ``check_site`` alone is tested on
  hand-written pages.
"""
from __future__ import annotations

import json
import os
import posixpath
import re
import subprocess
import sys
import tomllib
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "build" / "book"
BOOK = ROOT / "book"
sys.path.insert(0, str(BOOK / "_ext"))

from check_site import check_site  # noqa: E402

from tests.chinese_helpers import chinese_problems, punctuation_violations, spacing_violations  # noqa: E402

pytest.importorskip("myst_nb", reason="the [book] extra is not installed (make book installs it)")


def _site():
    if not (SITE / "book" / "index.html").is_file():
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
    landing = (_site() / "book" / "index.html").read_text(encoding="utf-8")
    for nb in sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("exercises/*.ipynb")):
        rel = nb.relative_to(ROOT).with_suffix(".html").as_posix()
        assert (SITE / rel).is_file(), f"{rel} was not built"
        assert f'href="../{rel}"' in landing, f"{rel} is not in the table of contents of the landing page"
    for page in ("docs/glossary.html", "docs/maintaining-the-glossary.html", "README.html", "README.zh-CN.html",
                 "book/index.zh-CN.html", "search.html", "index.html"):
        assert (SITE / page).is_file(), page
    assert 'url=book/index.html' in (SITE / "index.html").read_text(encoding="utf-8")


CHAPTERS = tomllib.loads((BOOK / "chapters.toml").read_text(encoding="utf-8"))["chapter"]


def _notebook(folder: str, number: str) -> str | None:
    """``folder/NN_name`` (no suffix) of chapter ``number``, or None."""
    found = sorted(ROOT.glob(f"{folder}/{number}_*.ipynb"))
    return found[0].relative_to(ROOT).with_suffix("").as_posix() if found else None


def _reading_order() -> list[str]:
    """The pages in the order the landing page's "Next" links lead, from book/index (page names without .html)."""
    order, page = [], "book/index"
    while page and page not in order:
        order.append(page)
        html = (_site() / f"{page}.html").read_text(encoding="utf-8")
        nxt = re.search(r'<a class="right-next"\s+href="([^"#]+)"', html)
        page = (posixpath.normpath(posixpath.join(posixpath.dirname(page), nxt.group(1))).removesuffix(".html")
                if nxt else None)
    return order


def test_next_leads_from_each_lesson_to_its_exercises_then_to_the_next_lesson():
    expected = ["book/index"] + [doc for c in CHAPTERS for doc in (_notebook("notebooks", c["number"]),
                                                                    _notebook("exercises", c["number"])) if doc]
    order = _reading_order()
    assert order[:len(expected)] == expected, f"reading order {order}"
    assert order.index("exercises/08_capstone") == order.index("exercises/07_context_parallel") + 1
    assert order[-1] != "book/index.zh-CN", "the Chinese landing page is the last page of the reading order"
    assert "docs/glossary" in order


def test_every_lesson_ends_with_a_link_to_its_exercises():
    for c in CHAPTERS:
        lesson, exercise = _notebook("notebooks", c["number"]), _notebook("exercises", c["number"])
        if not (lesson and exercise):
            continue
        html = (_site() / f"{lesson}.html").read_text(encoding="utf-8")
        box = re.search(r'<div class="minillm-next-exercise[^"]*">(.*?)</div>', html, re.S)
        assert box, f"{lesson}: no link to its exercises at its end"
        assert f'href="../{exercise}.html"' in box.group(1), f"{lesson}: the link does not lead to {exercise}"
        article = html[html.index('<article class="bd-article">'):html.index("</article>")]
        assert article.rstrip().rsplit("minillm-next-exercise", 1)[1].count('<div class="cell') == 0, (
            f"{lesson}: the link to the exercises is not at the lesson's end")


def test_the_landing_pages_have_a_card_per_chapter_in_their_language():
    for page, lang in (("book/index", "title"), ("book/index.zh-CN", "title_zh")):
        html = (_site() / f"{page}.html").read_text(encoding="utf-8")
        cards = re.findall(r'<div class="minillm-card[^"]*">(.*?)</div>', html, re.S)
        assert len(cards) == len(CHAPTERS), f"{page}: {len(cards)} cards for {len(CHAPTERS)} chapters"
        for c, card in zip(CHAPTERS, cards, strict=True):
            assert f"{c['number']} · {c[lang]}" in card, f"{page}: card {c['number']} is not titled {c[lang]!r}"
            for folder in ("notebooks", "exercises"):
                doc = _notebook(folder, c["number"])
                if doc:
                    assert f'href="../{doc}.html"' in card, f"{page}: card {c['number']} does not link {doc}"
        assert "git clone" in re.sub(r"<[^>]+>", "", html), f"{page}: no git clone line"
        assert 'href="../notebooks/00_welcome.html"' in html.split('<div class="minillm-cards')[0], (
            f"{page}: no link to the first lesson before the cards (start here)")
    zh = (_site() / "book" / "index.zh-CN.html").read_text(encoding="utf-8")
    assert '<html lang="zh-CN"' in zh


def test_the_sidebar_names_each_chapter_in_both_languages():
    sidebar = (_site() / "notebooks" / "04_scheduler.html").read_text(encoding="utf-8")
    sidebar = sidebar[sidebar.index('bd-docs-nav'):]
    for c in CHAPTERS:
        assert f"{c['number']} · {c['title']} · {c['title_zh']}" in sidebar, f"chapter {c['number']} in the sidebar"


def _harness_tag(cell) -> str | None:
    """The tag a code cell that only checks the prose must carry: remove-cell, or remove-input when it has output."""
    if cell.cell_type != "code":
        return None
    lines = [line for line in cell.source.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert_only = bool(lines) and lines[0].startswith("assert") and all(
        line.startswith(("assert", " ", "\t", ")", "]", "}")) for line in lines)
    if cell.metadata.get("jupyter", {}).get("source_hidden") or assert_only:
        return "remove-input" if cell.get("outputs") else "remove-cell"
    return None


def test_cells_that_only_check_the_prose_are_tagged_to_stay_off_the_site():
    """A code cell JupyterLab folds away (``source_hidden``: it keeps the text in step with the code) or that holds
    only asserts is left out of the site by its tag: ``remove-cell``, or ``remove-input`` when its output is read."""
    missing = []
    for nb_path in sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("solutions/*.ipynb")):
        for i, cell in enumerate(nbformat.read(nb_path, as_version=4).cells):
            tag = _harness_tag(cell)
            if tag and tag not in cell.metadata.get("tags", []):
                missing.append(f"{nb_path.relative_to(ROOT)} cell {i} ({cell.get('id')}): tag {tag}")
    assert not missing, ("cells that only check the prose, without the tag that keeps them off the site (add it to "
                         "the cell's metadata.tags; exercises/ get it from solutions/ by `make exercises`):\n"
                         + "\n".join(missing))


def test_the_pages_show_no_test_harness():
    for page in sorted((_site() / "notebooks").glob("*.html")) + sorted((_site() / "exercises").glob("*.html")):
        html = page.read_text(encoding="utf-8")
        assert "NBVAL_" not in html, f"{page.name}: an nbval comment line is shown"
        assert "overlapping_texts(fig)" not in html, f"{page.name}: a figure-check cell is shown"
    nb01 = (_site() / "notebooks" / "01_attention_and_chunks.html").read_text(encoding="utf-8")
    assert "def pct_range" not in nb01 and "chunks 1-3, layers 1-29: K off by" in nb01, (
        "a remove-input cell: its source must be gone and its output kept")


def test_each_page_has_one_menu_button_and_one_contents_button():
    """Two ``.primary-toggle`` (or ``.secondary-toggle``) buttons on a page and the themes' scripts bind the first,
    hidden one: the visible buttons do nothing (pydata-sphinx-theme#2451; conf.py's navbar_persistent)."""
    for page in ("book/index.html", "notebooks/04_scheduler.html", "exercises/04_scheduler.html", "docs/glossary.html"):
        html = (_site() / page).read_text(encoding="utf-8")
        assert len(re.findall(r'<button[^>]*class="[^"]*\bprimary-toggle\b', html)) == 1, page
        assert len(re.findall(r'<button[^>]*class="[^"]*\bsecondary-toggle\b', html)) <= 1, page


def test_the_sites_chinese_follows_the_glossary():
    problems = chinese_problems((BOOK / "index.zh-CN.md").read_text(encoding="utf-8"))
    for c in CHAPTERS:
        problems += [f"chapters.toml {c['number']}: {p}" for p in chinese_problems(f"{c['title_zh']}：{c['about_zh']}")]
    import minillm_book

    for name in ("EXERCISE_LINK", "WIDGET_NOTE", "EXERCISE_NOTE"):
        problems += [f"{name}: {p}" for p in chinese_problems(getattr(minillm_book, name))]
    maintaining = (ROOT / "docs" / "maintaining-the-glossary.md").read_text(encoding="utf-8")  # names the bad forms
    problems += spacing_violations(maintaining) + punctuation_violations(maintaining)
    assert not problems, "\n".join(problems)


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
    (root / "book").mkdir()
    (root / "book" / "index.md").write_text("# Mini course\n\n<!-- chapter cards -->\n\n`git clone <the URL of this "
                                            "repository>`\n\n[中文](index.zh-CN.md)\n")
    (root / "book" / "index.zh-CN.md").write_text("---\norphan: true\n---\n\n# 迷你课程\n\n<!-- chapter cards -->\n")
    (root / "README.md").write_text("# Mini course\n\n[中文说明](README.zh-CN.md)\n\n"
                                    "Read [00](notebooks/00_a.ipynb).\n")
    (root / "README.zh-CN.md").write_text("# 迷你课程\n\n[English](README.md) · [术语表](docs/glossary.md)\n")
    (root / "docs" / "glossary.md").write_text("# Glossary · 术语表\n\n| term | 中文 |\n|---|---|\n"
                                               "| chunk | chunk |\n")
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
    # The reading order: lesson 00, its exercises, lesson 01; lesson 00 ends with a link to its exercises.
    assert re.search(r'class="right-next"\s+href="\.\./exercises/00_a\.html"', html)
    assert re.search(r'class="right-next"\s+href="\.\./notebooks/01_b\.html"',
                     (out / "exercises" / "00_a.html").read_text(encoding="utf-8"))
    assert 'minillm-next-exercise' in html and 'href="../exercises/00_a.html"' in html
    landing = (out / "book" / "index.html").read_text(encoding="utf-8")
    # A card per chapter, titled from book/chapters.toml.
    assert landing.count('class="minillm-card docutils') == 2 and "00 · Welcome" in landing
    assert "00 · 欢迎" in (out / "book" / "index.zh-CN.html").read_text(encoding="utf-8")


def test_links_to_the_rest_of_the_repository_keep_the_site_building(course):
    """The READMEs and docs link files that are not pages of the site: a solution notebook, a README of a sub-folder,
    source files. They lead to a copy of the file; CONTRIBUTING.md and the docs/ pages are pages of their own."""
    src, out = course
    (src / "solutions").mkdir()
    nbformat.write(_nb([("md", "s0", "# 00 · solved")]), src / "solutions" / "00_a.ipynb")
    (src / "kernels").mkdir()
    (src / "kernels" / "README.md").write_text("# kernels\n")
    (src / "kernels" / "attention.py").write_text("x = 1\n")
    (src / "CONTRIBUTING.md").write_text("# Contributing\n\nSee [the glossary](docs/glossary.md).\n")
    (src / "docs" / "teaching.md").write_text("# Teaching\n\n[solved](../solutions/00_a.ipynb)\n")
    (src / "README.md").write_text("# Mini\n\n[c](CONTRIBUTING.md) · [t](docs/teaching.md) · "
                                  "[s](solutions/00_a.ipynb) · [k](kernels/README.md) · [a](kernels/attention.py)\n")
    _edit_notebook(src / "notebooks" / "00_a.ipynb", "t00", "# 00 · Start\n\n[the solution](../solutions/00_a.ipynb)")
    r = _build(src, out)
    assert r.returncode == 0, r.stdout + r.stderr
    readme = (out / "README.html").read_text(encoding="utf-8")
    assert 'href="CONTRIBUTING.html"' in readme and 'href="docs/teaching.html"' in readme
    for copied in ("00_a.ipynb", "README.md"):
        assert re.search(rf'href="_downloads/[^"]+/{re.escape(copied)}"', readme), f"no link to a copy of {copied}"
    landing = (out / "book" / "index.html").read_text(encoding="utf-8")
    assert 'href="../CONTRIBUTING.html"' in landing and 'href="../docs/teaching.html"' in landing  # in the toctrees


def test_the_clone_line_names_the_repository_where_the_build_knows_it(course):
    src, out = course
    r = subprocess.run([sys.executable, "-m", "sphinx", "-q", "-b", "html", "-c", str(BOOK), "-d",
                        str(out.parent / "doctrees"), str(src), str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "GITHUB_REPOSITORY": "someone/minillm",
                            "GITHUB_SERVER_URL": "https://github.com"})
    assert r.returncode == 0, r.stdout + r.stderr
    landing = (out / "book" / "index.html").read_text(encoding="utf-8")
    text = re.sub(r"<[^>]+>", "", landing)
    assert "git clone https://github.com/someone/minillm" in text and "the URL of this repository" not in text


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
        lambda s: nbformat.write(_nb([("md", "s0", "# A stray page")]), s / "notebooks" / "stray.ipynb"),
        "stray"),
    "chapter that book/chapters.toml does not know": (
        lambda s: nbformat.write(_nb([("md", "s2", "# 99 · New")]), s / "notebooks" / "99_new.ipynb"),
        "chapter 99 has no entry in book/chapters.toml"),
    "landing page without its chapter cards": (
        lambda s: (s / "book" / "index.zh-CN.md").write_text("---\norphan: true\n---\n\n# 迷你课程\n"),
        "chapter cards"),
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
