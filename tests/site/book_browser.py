"""The course website in a real browser (``make test-book``, after ``make book``; kept out of ``make test``).

``build/book`` is served by ``http.server`` on a free loopback port, in a thread the module fixture stops. Debian's
Chromium is driven by Playwright (``executable_path``, the flags of tests/lab/test_browser.py; never downloaded). Every
request that is not to that server is aborted and recorded: the site must work with the network cut off.

- **Landing pages.** book/index.html (English; index.html leads there) and book/index.zh-CN.html
  (``lang="zh-CN"``): each has a language switch to the other and a card per chapter; the Chinese title is drawn with
  a CJK font the site names (Chromium's own record of the platform font that drew the glyphs, via the DevTools
  protocol; a missing font would draw boxes). **The Chinese path**: from the Chinese landing page, a chapter's card
  leads to its lesson, whose sidebar names the chapters in Chinese too.
- **One page per chapter** (every lesson and every exercise page): no console error, no page error, no request
  leaves the server; every image has loaded (``naturalWidth > 0``); where the page has math, MathJax has typeset
  every formula (an output element per ``.math`` span, no ``merror``, no undefined macro drawn in red); at most 5 %
  of the code cells' blocks (source and output) scroll sideways (the fraction is printed); every lesson ends with a
  link to its exercises.
- **A phone** (390 × 844), on the landing page and a lesson: the menu button opens the site's menu and the
  "Contents" button the page's contents (each a dialog, closed with Escape), every button of the header lies on the
  screen, and the page does not scroll sideways. At 800 px the same buttons open the same dialogs; at 1300 px the
  menu button folds the sidebar away and back. "Next" at the bottom of lesson 01 leads to exercises 01, and "Next"
  of exercises 07 to the capstone (08).
- **Search** for ``slot_mapping`` lists results (Sphinx's offline index).
- **The Q1 link** of notebook 00's question table, clicked, lands on notebook 01 at the section headed
  ``Learner question Q1``, scrolled into view.

Screenshots of the landing pages, of chapter 04 and of the phone's menu and contents go to
``$MINILLM_BOOK_SCREENSHOTS`` (default: a folder under ``$TMPDIR``); the path is printed.
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
    if not (SITE / "book" / "index.html").is_file():
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

    def __init__(self, browser, site: str, width: int = 1300, height: int = 900):
        self.context = browser.new_context(viewport={"width": width, "height": height}, service_workers="block")
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
    page.goto(f"{site}/index.html")  # the redirect to the landing page
    page.wait_for_url("**/book/index.html")
    page.locator("article h1").first.wait_for()
    assert "minillm" in page.locator("article h1").first.inner_text()
    assert page.get_attribute("html", "lang") == "en"
    switch = page.locator("a.minillm-lang-switch")
    assert switch.inner_text().strip() == "中文" and switch.get_attribute("href") == "index.zh-CN.html"
    nav = page.locator("nav.bd-docs-nav")
    for name in ("00_welcome", "04_scheduler", "08_capstone"):
        assert nav.locator(f"a[href*='{name}']").count(), f"{name} missing from the table of contents"
    cards = page.locator("article .minillm-card")
    assert cards.count() == len(list((SITE / "notebooks").glob("*.html"))) + 1  # a card per chapter, the capstone too
    assert cards.nth(0).locator("a[href='../notebooks/00_welcome.html']").count() >= 1
    assert cards.nth(0).locator("a[href='../exercises/00_warmup.html']").count() == 1
    start = page.locator("article a[href='../notebooks/00_welcome.html']").first  # "Start here", before the cards
    assert start.bounding_box()["y"] < cards.nth(0).bounding_box()["y"]
    assert "git clone" in page.locator("article").inner_text()
    _shot(page, "landing-en.png")
    watched.clean("book/index.html")


def test_chinese_landing_page_draws_cjk_and_leads_into_the_chapters(watched, site):
    page = watched.page
    page.goto(f"{site}/book/index.zh-CN.html")
    h1 = page.locator("article h1").first
    h1.wait_for()
    assert "一章一个 notebook" in h1.inner_text()
    assert page.get_attribute("html", "lang") == "zh-CN"
    switch = page.locator("a.minillm-lang-switch")
    assert switch.inner_text().strip() == "English" and switch.get_attribute("href") == "index.html"
    family = page.evaluate("getComputedStyle(document.querySelector('article h1')).fontFamily")
    assert "Noto Sans CJK SC" in family, family
    for selector in ("article h1", "article section > p"):  # the title, and the first paragraph of text
        drawn = _fonts_drawing(page, selector)
        print(f"{selector} drawn with {drawn}")
        assert any(f in CJK_FONTS or "CJK" in f or "Source Han" in f for f in drawn), (
            f"{selector}: the Chinese text is drawn with {drawn}, none of the named CJK fonts {CJK_FONTS}")
    _shot(page, "landing-zh-CN.png")
    # The Chinese path: the card of chapter 04 (its Chinese title) leads to the lesson, whose sidebar is bilingual.
    page.locator("article .minillm-card a", has_text="04 · 调度器").first.click()
    page.wait_for_url("**/notebooks/04_scheduler.html")
    page.locator("article h1").first.wait_for()
    current = page.locator("nav.bd-docs-nav li.current > a").first.inner_text()
    assert current.strip() == "04 · The scheduler · 调度器", current
    assert page.locator("nav.bd-docs-nav a", has_text="02 · The paged KV cache · 分页 KV cache").count() == 1
    watched.clean("book/index.zh-CN.html → notebooks/04_scheduler.html")


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
    exercise = _exercise_of(path)
    if exercise:  # the lesson ends with a link to its exercises
        link = page.locator(f".minillm-next-exercise a[href='../{exercise}']")
        assert link.count() == 1, f"{path}: no link to {exercise} at its end"
    scrolling, blocks = _sideways(page)
    print(f"{path}: {scrolling} of {blocks} code blocks scroll sideways")
    assert scrolling <= 0.05 * blocks, f"{path}: {scrolling} of {blocks} code blocks scroll sideways"
    watched.clean(path)


def _exercise_of(path: str) -> str | None:
    """exercises/NN_*.html of the lesson ``notebooks/NN_*.html``, or None."""
    if not path.startswith("notebooks/"):
        return None
    found = sorted((SITE / "exercises").glob(path.split("/")[1][:3] + "*.html"))
    return found[0].relative_to(SITE).as_posix() if found else None


def _sideways(page) -> tuple[int, int]:
    """(code blocks of the article's cells that scroll sideways, all of them): source and output ``pre``s."""
    return tuple(page.evaluate("""() => {
        const pres = [...document.querySelectorAll('article div.cell pre')].filter(p => p.clientWidth > 0);
        return [pres.filter(p => p.scrollWidth > p.clientWidth + 1).length, pres.length];
    }"""))


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


# ---- a phone, a tablet, a desktop ---------------------------------------------------------------------------------

PHONE = (390, 844)


def _no_sideways_scroll(page, what: str) -> None:
    width, inner = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert width <= inner, f"{what}: the page scrolls sideways ({width} px wide in a {inner} px window)"


def _header_buttons_on_screen(page, what: str) -> None:
    """Every visible control of the article's header lies inside the window (the bilingual note must not push the
    search and contents buttons off a phone's screen)."""
    boxes = page.evaluate("""() => [...document.querySelectorAll('.bd-header-article .btn, .bd-header-article a')]
        .filter(e => e.offsetParent !== null).map(e => {
            const r = e.getBoundingClientRect(); return [e.className, r.left, r.right]; })""")
    inner = page.evaluate("window.innerWidth")
    off = [b for b in boxes if b[1] < 0 or b[2] > inner + 0.5]
    assert boxes and not off, f"{what}: header controls off the screen ({inner} px): {off}"


def _open_dialog(page, toggle: str, dialog: str) -> None:
    """Click the visible ``toggle`` button; ``dialog`` must open, show links, and close again on Escape."""
    buttons = [b for b in page.locator(toggle).all() if b.is_visible()]
    assert len(buttons) == 1, f"{len(buttons)} visible {toggle} buttons"
    buttons[0].click()
    page.wait_for_function(f"document.querySelector('{dialog}')?.open === true", timeout=5_000)
    links = page.locator(f"{dialog} a")
    assert links.count() and any(links.nth(i).is_visible() for i in range(min(links.count(), 10))), (
        f"{dialog} opened without a visible link")
    page.keyboard.press("Escape")
    page.wait_for_function(f"!document.querySelector('{dialog}').open", timeout=5_000)


@pytest.mark.parametrize("path", ["book/index.html", "notebooks/04_scheduler.html"])
def test_on_a_phone_the_menu_and_the_contents_open_and_nothing_scrolls_sideways(browser, site, path):
    w = _Watched(browser, site, *PHONE)
    try:
        page = w.page
        page.goto(f"{site}/{path}", wait_until="load")
        page.locator("article h1").first.wait_for()
        _no_sideways_scroll(page, path)
        _header_buttons_on_screen(page, path)
        _open_dialog(page, ".primary-toggle", "#pst-primary-sidebar-modal")
        page.locator(".primary-toggle").first.click()
        page.wait_for_function("document.querySelector('#pst-primary-sidebar-modal').open")
        assert page.locator("#pst-primary-sidebar-modal nav.bd-docs-nav a[href*='08_capstone']").is_visible()
        _shot(page, f"phone-menu-{path.replace('/', '-')}.png")
        page.keyboard.press("Escape")
        page.wait_for_function("!document.querySelector('#pst-primary-sidebar-modal').open")
        _open_dialog(page, ".secondary-toggle", "#pst-secondary-sidebar-modal")
        page.locator(".secondary-toggle").first.click()
        page.wait_for_function("document.querySelector('#pst-secondary-sidebar-modal').open")
        assert page.locator("#pst-secondary-sidebar-modal .page-toc a").first.is_visible()
        _shot(page, f"phone-contents-{path.replace('/', '-')}.png")
        page.keyboard.press("Escape")
        scrolling, blocks = _sideways(page)
        assert scrolling <= 0.05 * blocks, f"{path}: {scrolling} of {blocks} code blocks scroll sideways on a phone"
        w.clean(f"{path} on a phone")
    finally:
        w.context.close()


def test_the_menu_button_works_on_a_tablet_and_on_a_desktop(browser, site):
    w = _Watched(browser, site, 800, 900)
    try:
        w.page.goto(f"{site}/notebooks/01_attention_and_chunks.html", wait_until="load")
        _open_dialog(w.page, ".primary-toggle", "#pst-primary-sidebar-modal")
        _open_dialog(w.page, ".secondary-toggle", "#pst-secondary-sidebar-modal")
        _no_sideways_scroll(w.page, "800 px")
        w.clean("800 px")
    finally:
        w.context.close()
    w = _Watched(browser, site, 1300, 900)
    try:
        page = w.page
        page.goto(f"{site}/notebooks/01_attention_and_chunks.html", wait_until="load")
        sidebar = page.locator("#pst-primary-sidebar")
        assert sidebar.is_visible()
        hidden = "getComputedStyle(document.querySelector('#pst-primary-sidebar')).visibility === 'hidden'"
        page.locator(".primary-toggle").first.click()  # folds the sidebar away (sphinx-book-theme: visibility hidden)
        page.wait_for_function(hidden, timeout=5_000)
        page.locator(".primary-toggle").first.click()
        page.wait_for_function(f"!({hidden})", timeout=5_000)
        assert sidebar.is_visible()
        assert not page.evaluate("document.querySelector('#pst-primary-sidebar-modal').open")
        assert page.locator("#pst-secondary-sidebar .page-toc a").first.is_visible()  # the contents, always shown
        w.clean("1300 px")
    finally:
        w.context.close()


def test_next_leads_from_a_lesson_to_its_exercises_on_a_phone(browser, site):
    w = _Watched(browser, site, *PHONE)
    try:
        page = w.page
        for start, lands in (("notebooks/01_attention_and_chunks.html", "exercises/01_attention_and_chunks.html"),
                             ("exercises/07_context_parallel.html", "exercises/08_capstone.html")):
            page.goto(f"{site}/{start}", wait_until="load")
            nxt = page.locator("a.right-next")
            nxt.scroll_into_view_if_needed()
            nxt.click()
            page.wait_for_url(f"**/{lands}")
        w.clean("Next")
    finally:
        w.context.close()
