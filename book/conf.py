"""Sphinx configuration of the course website (``make book``: ``sphinx-build -c book . build/book``).

The source directory is the repository root, so the notebooks' and READMEs' relative links work unchanged; only
the files of ``include_patterns`` are read. Notebooks are never executed: the site shows their stored outputs.
The landing pages are book/index.md and book/index.zh-CN.md; the chapters' titles, in both languages, are in
book/chapters.toml. What is specific to this course (toctrees and reading order, cross-notebook links, widgets,
exercise notes, the checks after the build) is in ``_ext/minillm_book.py``.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "minillm"
author = "the minillm authors"
copyright = "the minillm authors, Apache-2.0"
html_title = "minillm · build an LLM inference engine like vLLM"

extensions = ["myst_nb", "sphinx.ext.mathjax", "sphinx.ext.githubpages", "minillm_book"]  # githubpages: .nojekyll

root_doc = "book/index"  # the English landing page; book/index.zh-CN.md is the Chinese one
include_patterns = ["book/index.md", "book/index.zh-CN.md", "README.md", "README.zh-CN.md", "CONTRIBUTING.md",
                    "docs/**", "notebooks/**", "exercises/**"]
exclude_patterns = ["**/.ipynb_checkpoints", ".venv", "build", ".git", "**/*.py", "**/*.json", "**/*.txt"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

language = "en"
html_search_language = "en"  # Sphinx's offline index; "slot_mapping" and other identifiers are words in it

# ---- MyST / MyST-NB ------------------------------------------------------------------------------------------------
nb_execution_mode = "off"  # never execute: the stored outputs are the book
nb_merge_streams = True
nb_output_stderr = "show"
nb_ipywidgets_js = {}  # widgets are shown as their stored picture (minillm_book.py); no widget JavaScript from a CDN
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 6  # every heading gets its GitHub-style slug: the target of the cross-notebook links

# ---- math: MathJax 3.2.2 (SVG output: no web fonts) from the sphinx-mathjax-offline package, copied under
# _static/mathjax by minillm_book.py (no CDN). Sphinx's default MathJax comes from a CDN.
mathjax_path = "mathjax/tex-svg.js"
mathjax3_config = {"options": {"enableMenu": False}}

# ---- HTML ----------------------------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["minillm-book.css"]
html_favicon = "_static/favicon.svg"
html_copy_source = True  # the download button gives the notebook itself
# The landing pages' `git clone` line names the repository where the build knows it (GitHub Actions sets
# GITHUB_REPOSITORY; .github/workflows/book.yml builds there); elsewhere they say "clone this repository".
_github_repository = os.environ.get("GITHUB_REPOSITORY", "")
minillm_repository_url = (f"{os.environ.get('GITHUB_SERVER_URL', 'https://github.com')}/{_github_repository}"
                          if _github_repository else "")
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "use_download_button": True,
    "use_fullscreen_button": False,
    "article_header_end": ["lang-switch.html", "article-header-buttons.html"],
    "navigation_with_keys": False,
    "show_toc_level": 2,
    # No top navbar at all (sphinx-book-theme leaves navbar_start/center/end empty; pydata-sphinx-theme 0.20 fills
    # navbar_persistent with the search field unless it is set). With a navbar, pydata-sphinx-theme 0.20 renders a
    # second, hidden pair of .primary-toggle/.secondary-toggle buttons before the article header's, and both themes'
    # scripts bind only the first match (document.querySelector): the menu and "Contents" buttons then do nothing
    # (pydata-sphinx-theme#2451, sphinx-book-theme#988; tests/site/book_browser.py clicks them at phone width).
    "navbar_persistent": [],
}
# Light by default: the notebook figures are drawn on white. (Left empty, the theme logs a console error.)
html_context = {"default_mode": "light"}
html_last_updated_fmt = None
html_show_sphinx = False

# The exercise notebooks go from their title (H1) straight to exercise headings (H3): a matter of style, not a broken
# page, so MyST's note about it is not an error. Every other warning is (make book runs sphinx-build -W).
suppress_warnings = ["myst.header"]
