"""Check a built site: every internal link reaches a page and its anchor, every image exists, every notebook has a page.

``check_site(outdir, srcdir)`` returns the problems as lines (empty: all good). The build runs it at its end
(minillm_book.py) and fails on any problem; ``python book/_ext/check_site.py build/book`` runs it alone.

- **Links.** Every ``<a href>`` of every page that is not an absolute URL (``scheme:`` or ``//``): its path, taken
  relative to the page, must be a file of the site, and a fragment must be the ``id`` of an element of that page.
  Sphinx's own links (``_sources/``, ``genindex.html``, ``search.html``, the theme's) are checked the same way.
- **Images.** Every ``<img src>`` is a ``data:`` URI or a file of the site. (Sphinx already fails under ``-W`` on a
  markdown image it cannot read; this also covers raw HTML in markdown and notebook outputs.)
- **Offline.** No ``<script src>`` or stylesheet comes from outside the site, and each one exists.
- **Pages.** Every ``notebooks/*.ipynb`` and ``exercises/*.ipynb`` of the source has its ``.html`` page.
"""
from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.images: list[str] = []
        self.fetched: list[str] = []  # scripts and stylesheets the page loads

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        if tag == "a" and a.get("href") is not None:
            self.links.append(a["href"])
        if tag == "img":
            self.images.append(a.get("src") or "")
        if tag == "script" and a.get("src"):
            self.fetched.append(a["src"])
        if tag == "link" and a.get("href") and a.get("rel") in ("stylesheet", "preload", "modulepreload", "icon"):
            self.fetched.append(a["href"])


def _parse(path: Path) -> _Page:
    p = _Page()
    p.feed(path.read_text(encoding="utf-8", errors="replace"))
    return p


def _external(url: str) -> bool:
    parts = urlsplit(url)
    return bool(parts.scheme) or url.startswith("//")


def check_site(outdir: Path, srcdir: Path | None = None) -> list[str]:
    outdir = Path(outdir)
    problems: list[str] = []
    pages = {p: None for p in sorted(outdir.rglob("*.html"))
             if "_static" not in p.relative_to(outdir).parts and "_sources" not in p.relative_to(outdir).parts}
    if not pages:
        return [f"{outdir}: no HTML pages"]
    for page in pages:
        pages[page] = _parse(page)

    def ids_of(path: Path) -> set[str]:
        if path not in pages or pages[path] is None:
            pages[path] = _parse(path)
        return pages[path].ids

    for page, parsed in list(pages.items()):
        rel = page.relative_to(outdir).as_posix()
        for href in parsed.links:
            if _external(href):
                continue
            parts = urlsplit(href)
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if parts.path.endswith("/"):
                target = target / "index.html"
            try:
                target.relative_to(outdir.resolve())
            except ValueError:
                if target != page:
                    problems.append(f"{rel}: link {href!r} leaves the site")
                    continue
            if target != page and not target.is_file():
                problems.append(f"{rel}: link {href!r}: no file {target.relative_to(outdir.resolve()).as_posix()}")
                continue
            frag = unquote(parts.fragment)
            if frag and target.suffix == ".html" and frag not in ids_of(target if target != page else page):
                problems.append(f"{rel}: link {href!r}: no element with id {frag!r} in "
                                f"{(target if target != page else page).relative_to(outdir.resolve()).as_posix()}")
        for src in parsed.fetched:
            if _external(src):
                problems.append(f"{rel}: loads {src[:80]!r} from outside the site (the site must work offline)")
            elif not (page.parent / unquote(urlsplit(src).path)).is_file():
                problems.append(f"{rel}: loads {src!r}, which is missing")
        for src in parsed.images:
            if src.startswith("data:") or _external(src):
                if _external(src) and not src.startswith("data:"):
                    problems.append(f"{rel}: image {src[:80]!r} is not part of the site (it would be fetched)")
                continue
            if not src or not (page.parent / unquote(urlsplit(src).path)).is_file():
                problems.append(f"{rel}: image {src!r} is missing")
    if srcdir is not None:
        for nb in sorted(list(Path(srcdir).glob("notebooks/*.ipynb")) + list(Path(srcdir).glob("exercises/*.ipynb"))):
            html = outdir / nb.relative_to(srcdir).with_suffix(".html")
            if not html.is_file():
                problems.append(f"{nb.relative_to(srcdir).as_posix()} has no page in the site ({html.name} missing)")
    return problems


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "build/book")
    found = check_site(out, Path(sys.argv[2]) if len(sys.argv) > 2 else None)
    print("\n".join(found) if found else f"{out}: all links, anchors and images resolve")
    sys.exit(1 if found else 0)
