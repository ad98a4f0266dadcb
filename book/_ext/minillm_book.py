"""The course as a website: what Sphinx + MyST-NB need to be told about this repository's notebooks.

Loaded by book/conf.py. Everything happens on the text Sphinx reads (``source-read``), so the files in the
repository are never touched, and after the build (``build-finished``):

- **Landing pages and reading order.** The English landing page is book/index.md (``root_doc``), the Chinese one
  book/index.zh-CN.md; their ``<!-- chapter cards -->`` line becomes a card per chapter (lesson and exercises), in
  the page's language, from book/chapters.toml. The English page gets the site's toctrees appended: the chapters in
  reading order (lesson NN, then exercises NN; the capstone, an exercise notebook only, after chapter 07), titled
  "NN · title · 中文标题" in the sidebar; the reference pages (the glossary, the other docs/ pages, the READMEs); and
  the contributors' pages. A notebook whose number book/chapters.toml does not know is a build error; any other
  page Sphinx reads (``include_patterns`` in conf.py) that no toctree lists fails the build too (Sphinx's "document
  isn't included in any toctree", an error under ``-W``).
- **Lesson → exercises.** Each lesson ends with a link to its exercise notebook; Sphinx's "Next" goes there too.
- **Links to the rest of the repository.** A link to a markdown file or notebook that is not a page of the site
  (``solutions/``, say) leads to a copy of the file (``offsite_links``); other files (``.py``) are MyST's downloads.
- **Cross-notebook links.** ``NN_name.ipynb#cell-id=<id>`` is how the notebooks link into each other (JupyterLab
  scrolls to that cell). On the site the link becomes ``NN_name.ipynb#<slug>``, the anchor MyST gives the first
  heading of that cell, or the heading of that cell that the link text names after a ``§`` ("01 §Learner question
  Q1"); ``myst_heading_anchors`` gives headings their slugs, computed here with MyST's own tokenizer, slug function
  and de-duplication, over the target notebook's headings in order. A cell id that is not in the target notebook, or
  whose cell has no heading, is a build error; a slug MyST does not know is MyST's warning, an error under ``-W``.
- **Test-harness lines.** Comment lines that only steer nbval (``# NBVAL_IGNORE_OUTPUT``) are left out of the code
  shown. (Whole cells that only check the prose carry the cell tags ``remove-cell``, or ``remove-input`` when their
  output is worth reading, in the notebooks themselves; MyST-NB honours them.)
- **Widgets.** An output of MIME type ``application/vnd.jupyter.widget-view+json`` becomes the stored picture of that
  widget: the PNG of the first ``ImageModel`` in the widget's tree, as saved in the notebook's widget state
  (``metadata.widgets``). A markdown cell under it says the widget is interactive in JupyterLab. The widget state is
  then dropped, so MyST-NB loads no widget JavaScript (it would fetch it from a CDN). A widget without a stored
  picture is a build error.
- **Exercises.** Each exercise page gets a line under its title: how to open it locally (``make lab``, then the
  notebook's path). The stored exercise notebooks are unsolved; the solutions are not part of the site.
- **Language.** The page context says which pages have a version in the other language (the landing pages, the
  READMEs) and which are bilingual in place (notebooks, glossary); ``_templates/lang-switch.html`` shows the switch
  or the note, which leads to the Chinese landing page. The glossary's table gets the class ``minillm-glossary``
  (book/_static/minillm-book.css lays it out as one entry per term on a narrow screen).
- **After the build** ``check_site`` (book/_ext/check_site.py) reads every HTML page: each internal link must reach a
  page and, with a fragment, an element of that id; each image must exist (or be a data: URI); every notebook of
  notebooks/ and exercises/ must have its page; no script or stylesheet may come from outside the site. Each
  problem is a warning naming it (an error under ``make book``'s ``-W``) and the build's exit status is 1.
"""
from __future__ import annotations

import base64
import json
import posixpath
import re
import shutil
import tomllib
from pathlib import Path

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
CELL_LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<path>[^)\s#]*\.ipynb)?#cell-id=(?P<id>[A-Za-z0-9_-]+)\)")
NBVAL_LINE = re.compile(r"^[ \t]*#[ \t]*NBVAL_[A-Z_]+[ \t]*(?:\n|$)", re.MULTILINE)  # a comment line only for nbval

LANDING = "book/index"  # conf.py's root_doc
LANDING_ZH = "book/index.zh-CN"
CARDS_MARK = "<!-- chapter cards -->"
REPOSITORY_MARK = {"en": "<the URL of this repository>", "zh-CN": "<本仓库的地址>"}
GLOSSARY = "docs/glossary"
CONTRIBUTOR_DOCS = ("CONTRIBUTING", "docs/maintaining-the-glossary")  # under "Contributors", not "Reference"
# A markdown link to a page: the target of `offsite_links`.
PAGE_LINK = re.compile(r"(?P<open>\]\()(?P<path>[^)\s#:]+\.(?:md|ipynb))(?:#[^)\s]*)?(?=[)\s])")

# Pages with a version in the other language: page -> (its counterpart, the label of the switch).
COUNTERPARTS = {LANDING: (LANDING_ZH, "中文"), LANDING_ZH: (LANDING, "English"),
                "README": ("README.zh-CN", "中文"), "README.zh-CN": ("README", "English")}
PAGE_LANG = {"README.zh-CN": "zh-CN", LANDING_ZH: "zh-CN"}

CARD_WORDS = {"en": ("Lesson", "Exercises", "Capstone exercise"), "zh-CN": ("课程", "练习", "综合项目练习")}

WIDGET_NOTE = ("*The widget above is its stored picture: it is interactive in JupyterLab (`make lab`, then open "
               "`{path}`).* 上图是这个 widget 保存下来的静态图，在 JupyterLab 里可以交互"
               "（`make lab`，然后打开 `{path}`）。")
EXERCISE_NOTE = ("> **Work on this exercise locally:** `make lab`, then open `{path}` in JupyterLab (the exercise "
                 "cells raise `NotImplementedError` until you write them; each check cell says what differs). "
                 "**在本地做这份练习：**`make lab`，然后在 JupyterLab 里打开 `{path}`。")
EXERCISE_LINK = ("```{{container}} minillm-next-exercise\n"
                 "**Now the exercises of this chapter · 本章练习：** [{title}]({href})\n\n"
                 "Write this chapter's pieces yourself; each check cell says what differs. "
                 "在练习里亲手写出本章的部分，检查单元格会指出哪里不同。\n```")


# ---- the chapters: book/chapters.toml and the notebooks of each number --------------------------------------------

def chapters(confdir: Path, docnames) -> tuple[list[dict], list[str]]:
    """The chapters in order, each book/chapters.toml's entry with ``lesson`` and ``exercise`` (docnames, or None),
    and the problems found (a notebook whose number has no entry)."""
    table = tomllib.loads((Path(confdir) / "chapters.toml").read_text(encoding="utf-8"))["chapter"]
    by_number = {c["number"]: dict(c, lesson=None, exercise=None) for c in table}
    problems = []
    for doc in sorted(docnames):
        m = re.fullmatch(r"(notebooks|exercises)/(\d\d)_[^/]+", doc)
        if not m:
            continue
        kind = "lesson" if m.group(1) == "notebooks" else "exercise"
        if m.group(2) not in by_number:
            problems.append(f"{doc}: chapter {m.group(2)} has no entry in book/chapters.toml (its titles and line "
                            "for the sidebar and the landing pages)")
        else:
            by_number[m.group(2)][kind] = doc
    found = [c for c in by_number.values() if c["lesson"] or c["exercise"]]  # an entry without notebooks: skipped
    return sorted(found, key=lambda c: c["number"]), problems


def offsite_links(text: str, docname: str, srcdir: Path, docnames) -> str:
    """``text`` with each link to a markdown file or notebook of the repository that is not a page of the site
    (``solutions/``, a README of a sub-folder) turned into a link to the file itself (MyST's ``path:``: the site
    carries a copy), instead of a reference to a page that does not exist, which fails the build."""
    here = posixpath.dirname(docname)

    def fix(m: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(here, m.group("path")))
        if target.startswith("..") or not (srcdir / target).is_file() or target.rsplit(".", 1)[0] in docnames:
            return m.group(0)
        return m.group("open") + "path:" + m.group("path")

    return PAGE_LINK.sub(fix, text)


def _rel(from_doc: str, to_doc: str, suffix: str) -> str:
    return posixpath.relpath(to_doc, posixpath.dirname(from_doc) or ".") + suffix


def toctrees(found: list[dict], docnames) -> str:
    """The landing page's hidden toctrees: the chapters in reading order, the reference pages, the contributors'."""
    entries = []
    for c in found:
        for kind in ("lesson", "exercise"):
            if c[kind]:
                title = (f"{c['title']} · {c['title_zh']}" if kind == "lesson" or not c["lesson"]
                         else "Exercises · 练习")
                entries.append(f"{c['number']} · {title} </{c[kind]}>")
    docs = sorted(d for d in docnames if d.startswith("docs/") and d != GLOSSARY and d not in CONTRIBUTOR_DOCS)
    reference = ([f"Glossary · 术语表 </{GLOSSARY}>"] if GLOSSARY in docnames else []) + [f"/{d}" for d in docs]
    reference += [f"{t} </{d}>" for d, t in (("README", "README (the repository's front page)"),
                                              ("README.zh-CN", "README（中文）")) if d in docnames]
    contributors = [f"/{d}" for d in CONTRIBUTOR_DOCS if d in docnames]

    def toctree(caption: str, lines: list[str]) -> str:
        return ("\n\n```{toctree}\n:hidden:\n:maxdepth: 1\n:caption: " + caption + "\n\n" + "\n".join(lines) + "\n```\n"
                if lines else "")

    return (toctree("Chapters · 章节", entries) + toctree("Reference · 参考", reference)
            + toctree("Contributors · 参与贡献", contributors))


def chapter_cards(found: list[dict], docname: str, lang: str) -> str:
    """A card per chapter (MyST containers, styled by minillm-book.css): the title, one line, the links."""
    lesson_word, exercise_word, capstone_word = CARD_WORDS[lang]
    zh = lang == "zh-CN"
    cards = []
    for c in found:
        first = c["lesson"] or c["exercise"]
        title = f"{c['number']} · {c['title_zh'] if zh else c['title']}"
        links = []
        if c["lesson"]:
            links.append(f"[{lesson_word}]({_rel(docname, c['lesson'], '.ipynb')})")
        if c["exercise"]:
            word = exercise_word if c["lesson"] else capstone_word
            links.append(f"[{word}]({_rel(docname, c['exercise'], '.ipynb')})")
        cards.append("````{container} minillm-card\n"
                     f"[**{title}**]({_rel(docname, first, '.ipynb')})\n\n"
                     f"{c['about_zh'] if zh else c['about']}\n\n"
                     + " · ".join(links) + "\n````")
    return "`````{container} minillm-cards\n" + "\n\n".join(cards) + "\n`````"


# ---- headings and their slugs, as MyST computes them ------------------------------------------------------------

def _md_parser():
    from myst_parser.config.main import MdParserConfig
    from myst_parser.mdit_to_docutils.base import DocutilsRenderer
    from myst_parser.parsers.mdit import create_md_parser

    return create_md_parser(MdParserConfig(), DocutilsRenderer)


def cell_heading_slugs(cells: list[dict], slug_func=None) -> dict[str, list[tuple[str, str]]]:
    """{cell id: [(heading text, slug MyST gives it), ...] for the headings of that cell} over a notebook, in order.

    The slugs are made as myst_parser's ``compute_unique_slug`` makes them while it renders the notebook: the title
    is the heading's text and inline-code pieces, the slug function is GitHub's (MyST's default), and a slug seen
    before in the same document gets ``-1``, ``-2``, ...
    """
    from markdown_it.tree import SyntaxTreeNode
    from myst_parser.mdit_to_docutils.base import compute_unique_slug

    md = _md_parser()
    seen: dict[str, object] = {}
    headings: dict[str, list[tuple[str, str]]] = {}
    for cell in cells:
        if cell.get("cell_type") != "markdown":
            continue
        src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        tree = SyntaxTreeNode(md.parse(src))
        for node in tree.walk():
            if node.type != "heading":
                continue
            slug = compute_unique_slug(node, seen, slug_func)
            if slug:
                seen[slug] = True
                title = "".join(t.content for t in (node.children[0].children or [])
                                if t.type in ("text", "code_inline")) if node.children else ""
                headings.setdefault(cell.get("id", ""), []).append((title, slug))
    return headings


def pick_heading(headings: list[tuple[str, str]], link_text: str) -> str:
    """The slug a link into a cell lands on: the cell's heading that the link names (``01 §Learner question Q1``
    names ``Learner question Q1``; the longest title found in the link text wins), else the cell's first heading."""
    named = [(len(title), slug) for title, slug in headings if title and title in link_text]
    return max(named)[1] if named else headings[0][1]


# ---- widgets -----------------------------------------------------------------------------------------------------

def widget_png(state: dict, model_id: str) -> bytes | None:
    """The PNG of the first ImageModel under ``model_id`` in a saved widget state (depth first, children in order)."""
    models = state.get("state", {})
    stack, seen = [model_id], set()
    while stack:
        mid = stack.pop(0)
        if mid in seen or mid not in models:
            continue
        seen.add(mid)
        m = models[mid]
        if m.get("model_name") == "ImageModel":
            for buf in m.get("buffers", []):
                if buf.get("path") == ["value"] and buf.get("encoding") == "base64":
                    png = base64.b64decode(buf["data"])
                    if png.startswith(b"\x89PNG"):
                        return png
        children = m.get("state", {}).get("children", [])
        stack[0:0] = [c[len("IPY_MODEL_"):] for c in children if isinstance(c, str) and c.startswith("IPY_MODEL_")]
    return None


def _markdown_cell(text: str, cell_id: str) -> dict:
    return {"cell_type": "markdown", "id": cell_id, "metadata": {}, "source": text}


def transform_notebook(nb: dict, docname: str, srcdir: Path, exercise: str | None = None,
                       docnames=None) -> tuple[dict, list[str]]:
    """The notebook as the site shows it, and the problems found (each one fails the build). ``exercise``: the
    docname of a lesson's exercise notebook, linked from the lesson's end; ``docnames``: the site's pages (links to
    other files of the repository go to the file, :func:`offsite_links`)."""
    problems: list[str] = []
    rel_path = docname + ".ipynb"
    state = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {})
    here = posixpath.dirname(docname)
    slug_cache: dict[str, dict[str, list[tuple[str, str]]] | None] = {}

    def slugs_of(target: str) -> dict[str, list[tuple[str, str]]] | None:
        if target not in slug_cache:
            path = srcdir / posixpath.normpath(posixpath.join(here, target))
            if not path.is_file():
                slug_cache[target] = None
            else:
                slug_cache[target] = cell_heading_slugs(json.loads(path.read_text(encoding="utf-8"))["cells"])
        return slug_cache[target]

    def relink(m: re.Match) -> str:
        target, cell_id = m.group("path") or "", m.group("id")
        slugs = slugs_of(target or posixpath.basename(rel_path))
        if slugs is None:
            problems.append(f"{rel_path}: link to {target}#cell-id={cell_id}: no such notebook")
            return m.group(0)
        if cell_id not in slugs:
            problems.append(f"{rel_path}: link to {target}#cell-id={cell_id}: that notebook has no cell {cell_id} "
                            "that holds a heading (the site links to the heading of the cell)")
            return m.group(0)
        return f"[{m.group('text')}]({target}#{pick_heading(slugs[cell_id], m.group('text'))})"

    cells = []
    for cell in nb["cells"]:
        src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        cell["source"] = src
        if cell["cell_type"] == "markdown":
            cell["source"] = CELL_LINK.sub(relink, src)
            if docnames is not None:
                cell["source"] = offsite_links(cell["source"], docname, srcdir, docnames)
        elif cell["cell_type"] == "code":
            cell["source"] = NBVAL_LINE.sub("", src)
        cells.append(cell)
        widget_outputs = 0
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW not in data:
                continue
            model_id = data[WIDGET_VIEW].get("model_id", "")
            png = widget_png(state, model_id)
            if png is None:
                problems.append(f"{rel_path}: cell {cell.get('id')}: widget {model_id} has no stored picture "
                                "(no ImageModel with a PNG in metadata.widgets): save the notebook with its "
                                "widget state")
                continue
            out["data"] = {"image/png": base64.b64encode(png).decode("ascii"),
                           "text/plain": data.get("text/plain", "")}
            out.setdefault("metadata", {})
            widget_outputs += 1
        if widget_outputs:
            cells.append(_markdown_cell(WIDGET_NOTE.format(path=rel_path), f"{cell.get('id', 'cell')}-widget-note"))
    if docname.startswith("exercises/"):
        note = _markdown_cell(EXERCISE_NOTE.format(path=rel_path), "book-exercise-note")
        first_md = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"), None)
        cells.insert(0 if first_md is None else first_md + 1, note)
    if exercise is not None:
        path = srcdir / (exercise + ".ipynb")
        title = next((line[2:].strip() for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
                      if c["cell_type"] == "markdown" for line in "".join(c["source"]).splitlines()
                      if line.startswith("# ")), exercise)
        cells.append(_markdown_cell(EXERCISE_LINK.format(title=title, href=_rel(docname, exercise, ".ipynb")),
                                    "book-exercise-link"))
    nb["cells"] = cells
    nb.get("metadata", {}).pop("widgets", None)  # no widget JavaScript (MyST-NB would load it from a CDN)
    return nb, problems


# ---- Sphinx events -------------------------------------------------------------------------------------------------

def _chapters(app: Sphinx) -> list[dict]:
    """book/chapters.toml against the notebooks Sphinx found, once per build; its problems are build errors."""
    if getattr(app, "minillm_chapters", None) is None:  # on the app, not the env: never kept from an earlier build
        found, problems = chapters(Path(app.confdir), app.env.found_docs)
        for p in problems:
            logger.error(p, location="book/chapters.toml")
        app.env.minillm_book_problems = getattr(app.env, "minillm_book_problems", []) + problems
        app.minillm_chapters = found
    return app.minillm_chapters


def _source_read(app: Sphinx, docname: str, source: list[str]) -> None:
    if docname in (LANDING, LANDING_ZH):
        lang = PAGE_LANG.get(docname, "en")
        if CARDS_MARK not in source[0]:
            logger.error(f"{docname}: no {CARDS_MARK} line (where the chapter cards go)", location=docname)
            app.env.minillm_book_problems = getattr(app.env, "minillm_book_problems", []) + [docname]
        text = source[0].replace(CARDS_MARK, chapter_cards(_chapters(app), docname, lang))
        if app.config.minillm_repository_url:
            text = text.replace(REPOSITORY_MARK[lang], app.config.minillm_repository_url)
        if docname == LANDING:
            text += toctrees(_chapters(app), app.env.found_docs)
        source[0] = offsite_links(text, docname, Path(app.srcdir), app.env.found_docs)
        return
    path = Path(app.env.doc2path(docname))
    if path.suffix != ".ipynb":
        source[0] = offsite_links(source[0], docname, Path(app.srcdir), app.env.found_docs)
        return
    exercise = next((c["exercise"] for c in _chapters(app) if c["lesson"] == docname), None)
    nb, problems = transform_notebook(json.loads(source[0]), docname, Path(app.srcdir), exercise,
                                      app.env.found_docs)
    for p in problems:
        logger.error(p, location=docname)
    app.env.minillm_book_problems = getattr(app.env, "minillm_book_problems", []) + problems
    source[0] = json.dumps(nb)


def _glossary_table(app: Sphinx, doctree) -> None:
    """The glossary's table gets a class of its own (minillm-book.css: one entry per term on a narrow screen)."""
    if app.env.docname == GLOSSARY:
        for table in doctree.findall(nodes.table):
            table["classes"].append("minillm-glossary")


def _page_context(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    other = COUNTERPARTS.get(pagename)
    context["minillm_counterpart"] = (app.builder.get_relative_uri(pagename, other[0]), other[1]) if other else None
    context["minillm_bilingual_in_place"] = (pagename.startswith(("notebooks/", "exercises/"))
                                             or pagename == GLOSSARY)
    context["minillm_zh_landing"] = app.builder.get_relative_uri(pagename, LANDING_ZH)
    if pagename in PAGE_LANG:
        context["language"] = PAGE_LANG[pagename]


MATHJAX_PARTS = ("tex-svg.js", "input", "output", "ui", "a11y", "sre", "adaptors")  # tex-svg and what it may load


def _copy_mathjax(app: Sphinx, exception) -> None:
    """MathJax 3 into _static/mathjax: the files sphinx-mathjax-offline ships (its Sphinx extension is not used)."""
    if exception is not None or app.builder.format != "html":
        return
    import importlib.metadata

    src = Path(importlib.metadata.distribution("sphinx-mathjax-offline").locate_file(
        "sphinx-mathjax-offline/static/mathjax"))
    dst = Path(app.outdir) / "_static" / "mathjax"
    dst.mkdir(parents=True, exist_ok=True)
    for part in MATHJAX_PARTS:
        if (src / part).is_dir():
            shutil.copytree(src / part, dst / part, dirs_exist_ok=True)
        else:
            shutil.copy2(src / part, dst / part)


def _redirect_index(app: Sphinx, exception) -> None:
    """index.html: the English landing page (book/index.html) for a server that serves the folder."""
    if exception is not None or app.builder.format != "html":
        return
    index = Path(app.outdir) / "index.html"
    if app.config.root_doc != "index":
        target = app.config.root_doc + ".html"
        index.write_text(f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                         f'<meta http-equiv="refresh" content="0; url={target}"><title>minillm</title></head>'
                         f'<body><a href="{target}">minillm</a></body></html>\n', encoding="utf-8")


def _check(app: Sphinx, exception) -> None:
    """Run check_site over the finished site; each problem is a warning (an error under -W) and fails the build."""
    if exception is not None or app.builder.format != "html":
        return
    from check_site import check_site

    problems = check_site(Path(app.outdir), Path(app.srcdir))
    for p in problems:
        logger.warning(p, type="minillm_book", subtype="site")
    if problems or getattr(app.env, "minillm_book_problems", []):
        app.statuscode = 1  # fails even without -W


def setup(app: Sphinx) -> dict:
    app.add_config_value("minillm_repository_url", "", "env")
    app.connect("source-read", _source_read)
    app.connect("doctree-read", _glossary_table)
    app.connect("html-page-context", _page_context)
    app.connect("build-finished", _copy_mathjax)
    app.connect("build-finished", _redirect_index)
    app.connect("build-finished", _check, priority=900)  # after the copies above
    return {"version": "1", "parallel_read_safe": False, "parallel_write_safe": True}
