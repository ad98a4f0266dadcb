"""Show the package's own code in a notebook: syntax-highlighted, with the file it lives in and its line numbers.

The lessons put the code that answers a question on the page with :func:`show_source` instead of copying it into a
cell, so what a learner reads is what runs (``show_source(Scheduler.schedule)``). In JupyterLab the listing is HTML
highlighted by Pygments (inline styles, so it needs no stylesheet); as plain text (a terminal, ``print``) it is the
numbered source.
"""
from __future__ import annotations

import html
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[3]  # the directory that holds minillm/ (and kernels/)


@dataclass(frozen=True)
class SourceListing:
    """The source of one function, method or class, as :func:`show_source` found it.

    Attributes:
        name: the qualified name (``"Scheduler.schedule"``).
        path: the file, relative to the directory holding the package (``"minillm/core/sched/scheduler.py"``), or
            its absolute path when it lies elsewhere.
        first_line: the file's line number (1-based) of the listing's first line.
        source: the source, dedented (a method starts at column 0).
    """

    name: str
    path: str
    first_line: int
    source: str

    @property
    def lines(self) -> list[str]:
        """The source's lines, without their line ends."""
        return self.source.splitlines()

    @property
    def last_line(self) -> int:
        """The file's line number of the listing's last line."""
        return self.first_line + len(self.lines) - 1

    def line_of(self, text: str) -> int:
        """The file's line number of the first line that contains ``text``.

        Raises:
            ValueError: no line contains it (the prose that quotes it is out of date).
        """
        for i, line in enumerate(self.lines):
            if text in line:
                return self.first_line + i
        raise ValueError(f"{text!r} is not in the source of {self.name} ({self.path})")

    def __contains__(self, text: str) -> bool:
        return text in self.source

    def header(self) -> str:
        return f"{self.name}  ({self.path}, lines {self.first_line}-{self.last_line})"

    def __repr__(self) -> str:
        width = len(str(self.last_line))
        body = "\n".join(f"{self.first_line + i:>{width}}  {line}" for i, line in enumerate(self.lines))
        return f"{self.header()}\n{body}"

    def _repr_html_(self) -> str:
        head = (f"<div style='font-family: monospace; font-size: 0.9em; margin-bottom: 2px'><b>"
                f"{html.escape(self.name)}</b> &nbsp;<span style='color: #666'>{html.escape(self.path)}, lines "
                f"{self.first_line}&ndash;{self.last_line}</span></div>")
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
        except ImportError:  # pragma: no cover - pygments comes with IPython
            return head + f"<pre>{html.escape(repr(self).split(chr(10), 1)[1])}</pre>"
        formatter = HtmlFormatter(noclasses=True, linenos="inline", linenostart=self.first_line)
        return head + highlight(self.source, PythonLexer(), formatter)


def show_source(obj: Any) -> SourceListing:
    """The source of ``obj`` (a function, method, class or module), to display as a cell's last expression.

    Args:
        obj: anything :func:`inspect.getsourcelines` accepts; a bound method or a ``property`` is unwrapped.

    Returns:
        A :class:`SourceListing`: Jupyter shows it highlighted, ``print`` or ``repr`` gives numbered plain text.

    Raises:
        TypeError: ``obj`` has no Python source (a builtin, a C extension).
    """
    if isinstance(obj, property):
        obj = obj.fget
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    lines, first = inspect.getsourcelines(obj)
    path = Path(inspect.getsourcefile(obj) or "?").resolve()
    try:
        shown = path.relative_to(_ROOT).as_posix()
    except ValueError:
        shown = str(path)
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))
    return SourceListing(name, shown, max(first, 1), textwrap.dedent("".join(lines)).rstrip("\n"))
