"""The course website in a real browser (``make test-book``, after ``make book``; kept out of ``make test``).

``build/book`` is served by ``http.server`` on a free loopback port, in a thread the module fixture stops. Debian's
Chromium is driven by Playwright (``executable_path``, the flags of tests/lab/test_browser.py; never downloaded). Every
request that is not to that server is aborted and recorded: the site must work with the network cut off.

- **Landing pages.** README.html (English) and README.zh-CN.html (``lang="zh-CN"``): each has a language switch to
  the other, and the Chinese title is drawn with a CJK font the site names (Chromium's own record of the platform
  font that drew the glyphs, via the DevTools protocol; a missing font would draw boxes).
- **One page per chapter** (every lesson and every exercise page): no console error, no page error, no request
  leaves the server; every image has loaded (``naturalWidth > 0``); where the page has math, MathJax has typeset
  every formula (an output element per ``.math`` span, no ``merror``, no undefined macro drawn in red).
- **Search** for ``slot_mapping`` lists results (Sphinx's offline index).
- **The Q1 link** of notebook 00's question table, clicked, lands on notebook 01 at the section headed
  ``Learner question Q1``, scrolled into view.

Screenshots of the landing pages and of chapter 04 go to ``$MINILLM_BOOK_SCREENSHOTS`` (default: a folder under
``$TMPDIR``); the path is printed.
"""
from __future__ import annotations

import functools
import http.server
import os
import tempfile
import threading
from pathlib import Path

import pytest

from tests.net_helpers import free_port
from tests.lab.test_browser import CHROMIUM, CHROMIUM_ARGS

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "build" / "book"
CJK_FONTS = ("Noto Sans CJK SC", "Source Han Sans SC", "PingFang SC", "Microsoft YaHei")
SHOTS = Path(os.environ.get("MINILLM_BOOK_SCREENSHOTS") or Path(tempfile.gettempdir()) / "minillm-book-screenshots")
TIMEOUT_MS = 60_000

pytestmark = [pytest.mark.slow]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no line per request in the test output
        pass


@pytest.fixture(scope="module")
def site():
    """The built site over loopback HTTP; yields its base URL."""
    if not (SITE / "README.html").is_file():
        pytest.fail(f"{SITE} is not built: run `make book` (make test-book does)")
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(_Quiet, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser(site):
    pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (it is in the [dev] extra)")
    if CHROMIUM is None:
        pytest.skip("no Chromium found (apt-get install chromium, or set MINILLM_CHROMIUM); the browser test needs it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


class _Watched:
    """A page whose console errors, page errors and requests off the server are recorded."""

    def __init__(self, browser, site: str):
        self.context = browser.new_context(viewport={"width": 1300, "height": 900}, service_workers="block")
        self.offsite: list[str] = []
        self.errors: list[str] = []

        def route(r):
            if r.request.url.startswith(site + "/") or r.request.url.startswith("data:"):
                r.continue_()
            else:
                self.offsite.append(r.request.url)
                r.abort()

        self.context.route("**/*", route)
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(f"console error: {m.text}"))
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))

    def clean(self, what: str) -> None:
        assert not self.offsite, f"{what}: requests left the site: {self.offsite[:5]}"
        assert not self.errors, f"{what}: {self.errors[:5]}"


@pytest.fixture
def watched(browser, site):
    w = _Watched(browser, site)
    yield w
    w.context.close()


def _shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / name))
    print(f"screenshot: {SHOTS / name}")


def _fonts_drawing(page, selector: str) -> list[str]:
    """The platform fonts Chromium used to draw the text of the first element matching ``selector``."""
    cdp = page.context.new_cdp_session(page)
    cdp.send("DOM.enable")
    cdp.send("CSS.enable")
    root = cdp.send("DOM.getDocument")["root"]["nodeId"]
    node = cdp.send("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
    assert node, f"no element {selector}"
    fonts = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
    cdp.detach()
    return [f["familyName"] for f in fonts if f["glyphCount"] > 0]


def test_english_landing_page(watched, site):
    page = watched.page
    page.goto(f"{site}/index.html")  # the redirect to README.html
    page.wait_for_url("**/README.html")
    page.locator("article h1").first.wait_for()
    assert "minillm" in page.locator("article h1").first.inner_text()
    assert page.get_attribute("html", "lang") == "en"
    switch = page.locator("a.minillm-lang-switch")
    assert switch.inner_text().strip() == "中文" and switch.get_attribute("href") == "README.zh-CN.html"
    nav = page.locator("nav.bd-docs-nav")
    for name in ("00_welcome", "04_scheduler", "08_capstone"):
        assert nav.locator(f"a[href*='{name}']").count(), f"{name} missing from the table of contents"
    _shot(page, "landing-en.png")
    watched.clean("README.html")


def test_chinese_landing_page_draws_cjk_with_a_named_font(watched, site):
    page = watched.page
    page.goto(f"{site}/README.zh-CN.html")
    h1 = page.locator("article h1").first
    h1.wait_for()
    assert "一章一个 notebook" in h1.inner_text()
    assert page.get_attribute("html", "lang") == "zh-CN"
    switch = page.locator("a.minillm-lang-switch")
    assert switch.inner_text().strip() == "English" and switch.get_attribute("href") == "README.html"
    family = page.evaluate("getComputedStyle(document.querySelector('article h1')).fontFamily")
    assert "Noto Sans CJK SC" in family, family
    for selector in ("article h1", "article section > p"):  # the title, and the first paragraph of text
        drawn = _fonts_drawing(page, selector)
        print(f"{selector} drawn with {drawn}")
        assert any(f in CJK_FONTS or "CJK" in f or "Source Han" in f for f in drawn), (
            f"{selector}: the Chinese text is drawn with {drawn}, none of the named CJK fonts {CJK_FONTS}")
    _shot(page, "landing-zh-CN.png")
    watched.clean("README.zh-CN.html")


def _chapter_pages() -> list[str]:
    return ([p.relative_to(SITE).as_posix() for p in sorted((SITE / "notebooks").glob("*.html"))]
            + [p.relative_to(SITE).as_posix() for p in sorted((SITE / "exercises").glob("*.html"))]
            + ["docs/glossary.html"])


@pytest.mark.parametrize("path", _chapter_pages())
def test_chapter_page(watched, site, path):
    page = watched.page
    page.goto(f"{site}/{path}", wait_until="load")
    page.locator("article h1").first.wait_for()
    # Every image: loaded (scrolling is not needed: Sphinx writes no lazy loading; wait for the slow ones).
    page.wait_for_function("Array.from(document.images).every(i => i.complete)")
    broken = page.evaluate("Array.from(document.images).filter(i => !(i.naturalWidth > 0)).map(i => i.src)")
    assert not broken, f"{path}: images not loaded: {broken[:5]}"
    n_math = page.locator("article .math").count()
    if n_math:
        # MathJax 3 puts an <mjx-container class="MathJax"> inside each .math span or div it typesets.
        done = f"document.querySelectorAll('article .math .MathJax').length >= {n_math}"
        try:
            page.wait_for_function(done)
        except Exception:
            typeset = page.locator("article .math .MathJax").count()
            pytest.fail(f"{path}: MathJax typeset {typeset} of {n_math} formulas (MathJax loaded: "
                        f"{page.evaluate('typeof MathJax')}); {watched.errors[:3]} {watched.offsite[:3]}")
        # A TeX error is an merror node; an undefined macro is drawn as red text (MathJax's noundefined).
        bad = page.evaluate("Array.from(document.querySelectorAll('article .math')).filter(e => e.querySelector("
                            "\"[data-mml-node='merror'], [data-mml-node='mtext'][fill='red']\")).map(e => "
                            "e.querySelector('mjx-assistive-mml, script')?.textContent || e.getAttribute('class'))")
        assert not bad, f"{path}: {len(bad)} formulas with TeX errors or undefined macros"
    if path == "notebooks/04_scheduler.html":
        _shot(page, "chapter-04.png")
        page.locator("text=The widget above is its stored picture").first.scroll_into_view_if_needed()
        _shot(page, "chapter-04-widget.png")
    if path.startswith("exercises/"):
        assert page.locator("text=Work on this exercise locally").count() == 1
    watched.clean(path)


def test_search_finds_slot_mapping(watched, site):
    page = watched.page
    page.goto(f"{site}/search.html?q=slot_mapping")
    results = page.locator("#search-results ul.search li")
    results.first.wait_for()
    hrefs = [results.nth(i).locator("a").first.get_attribute("href") for i in range(results.count())]
    assert any("02_paged_kv_cache" in h for h in hrefs), hrefs
    _shot(page, "search-slot_mapping.png")
    watched.clean("search")


def test_q1_link_of_notebook_00_lands_on_its_section(watched, site):
    page = watched.page
    page.goto(f"{site}/notebooks/00_welcome.html")
    link = page.locator("a", has_text="01 §Learner question Q1").first
    link.scroll_into_view_if_needed()
    link.click()
    page.wait_for_url("**/01_attention_and_chunks.html#*")
    frag = page.evaluate("decodeURIComponent(location.hash.slice(1))")
    target = page.locator(f"[id='{frag}']")
    assert target.count() == 1, f"no element with id {frag!r}"
    heading = target.locator("h1, h2, h3, h4, h5, h6").first.inner_text()
    assert heading.rstrip("#").strip() == "Learner question Q1", heading
    page.wait_for_function("id => { const r = document.getElementById(id).getBoundingClientRect();"
                           " return r.top >= -2 && r.top < window.innerHeight / 2; }", arg=frag)
    _shot(page, "q1-landing.png")
    watched.clean("Q1 link")
