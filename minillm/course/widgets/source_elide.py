"""Show the package's code with some lines left out: the lines an exercise asks the learner to write.

A lesson shows the code it explains with :func:`minillm.course.widgets.source_view.show_source`, so the page never
drifts from the package. Where that code *is* the answer to an exercise (chapter 3's online-softmax update, the tile
loop of the attention kernel, the block-table lookup), printing it whole would hand the answer to a learner who has not
done the exercise yet. :func:`elide_source` shows the same listing with those lines replaced by one comment::

    elide_source(kv_row_offsets, ("blk = tl.load", "return blk", "exercise 3.3: the block-table lookup"))

shows the function's signature and docstring, then ``# ... exercise 3.3: the block-table lookup (2 lines) ...``.
The cut is found by text, not by line number, and a marker that is no longer in the source raises, so a changed
kernel cannot silently show the answer again.
"""
from __future__ import annotations

import html
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minillm.course.widgets.source_view import SourceListing, show_source


@dataclass(frozen=True)
class ElidedListing:
    """A :class:`SourceListing` with some line ranges replaced by a comment.

    Attributes:
        listing: the whole listing.
        cuts: ``(first, last, note)`` per hidden range: 0-based indices into ``listing.lines`` (both included) and
            the text of the comment shown instead, in source order, not overlapping.
    """

    listing: SourceListing
    cuts: tuple[tuple[int, int, str], ...]

    @property
    def name(self) -> str:
        return self.listing.name

    def _shown(self) -> list[tuple[int | None, str]]:
        """The shown lines with their file line numbers (``None`` for a comment that replaces a cut)."""
        lines = self.listing.lines
        out: list[tuple[int | None, str]] = []
        i = 0
        for first, last, note in self.cuts:
            out += [(self.listing.first_line + k, lines[k]) for k in range(i, first)]
            indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
            count = last - first + 1
            out.append((None, f"{indent}# ... {note} ({count} line{'s' if count != 1 else ''}) ..."))
            i = last + 1
        out += [(self.listing.first_line + k, lines[k]) for k in range(i, len(lines))]
        return out

    @property
    def source(self) -> str:
        """The source as shown: every cut replaced by its comment line."""
        return "\n".join(line for _, line in self._shown())

    @property
    def hidden(self) -> list[str]:
        """The text of each cut, as it is in the package (for asserts that a cut holds what the exercise asks)."""
        lines = self.listing.lines
        return ["\n".join(lines[first:last + 1]) for first, last, _ in self.cuts]

    def __contains__(self, text: str) -> bool:
        return text in self.source

    def header(self) -> str:
        hidden = ", ".join(f"{self.listing.first_line + a}-{self.listing.first_line + b}" for a, b, _ in self.cuts)
        return (f"{self.listing.name}  ({self.listing.path}, lines {self.listing.first_line}-"
                f"{self.listing.last_line}; lines {hidden} left out)")

    def __repr__(self) -> str:
        width = len(str(self.listing.last_line))
        body = "\n".join(f"{'' if n is None else n:>{width}}  {line}" for n, line in self._shown())
        return f"{self.header()}\n{body}"

    def _repr_html_(self) -> str:
        hidden = ", ".join(f"{self.listing.first_line + a}&ndash;{self.listing.first_line + b}"
                           for a, b, _ in self.cuts)
        head = (f"<div style='font-family: monospace; font-size: 0.9em; margin-bottom: 2px'><b>"
                f"{html.escape(self.listing.name)}</b> &nbsp;<span style='color: #666'>"
                f"{html.escape(self.listing.path)}, lines {self.listing.first_line}&ndash;{self.listing.last_line}; "
                f"lines {hidden} left out</span></div>")
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
        except ImportError:  # pragma: no cover - pygments comes with IPython
            return head + f"<pre>{html.escape(self.source)}</pre>"
        return head + highlight(self.source, PythonLexer(), HtmlFormatter(noclasses=True))


def _find(lines: list[str], text: str, start: int, name: str) -> int:
    for k in range(start, len(lines)):
        if text in lines[k]:
            return k
    raise ValueError(f"{text!r} is not in the source of {name} after line {start}: the cut is out of date")


def elide_source(obj: Any, *cuts: Sequence[str]) -> ElidedListing:
    """The source of ``obj`` with the line ranges ``cuts`` left out, to display as a cell's last expression.

    Args:
        obj: a :class:`SourceListing`, or anything :func:`show_source` accepts (a function, a Triton kernel's
            ``.fn``, a method, a class).
        cuts: ``(start, end, note)`` each: the first line containing ``start`` through the first line from there
            on containing ``end`` (both included) are replaced by ``# ... note (N lines) ...`` at the first line's
            indentation. Cuts are searched in order, each after the previous one.

    Returns:
        An :class:`ElidedListing`: Jupyter shows it highlighted, ``repr`` gives it numbered with the file's line
        numbers (the comment line has none).

    Raises:
        ValueError: no cuts, or a ``start`` or ``end`` text that is not found (the source changed).
    """
    if not cuts:
        raise ValueError("give at least one (start, end, note) cut")
    if not isinstance(obj, SourceListing):
        if not (inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isclass(obj)) and hasattr(obj, "fn"):
            obj = obj.fn  # a @triton.jit kernel keeps its Python function in .fn
        obj = show_source(obj)
    lines = obj.lines
    found: list[tuple[int, int, str]] = []
    at = 0
    for cut in cuts:
        start, end, note = cut
        first = _find(lines, start, at, obj.name)
        last = _find(lines, end, first, obj.name)
        found.append((first, last, note))
        at = last + 1
    return ElidedListing(obj, tuple(found))
