"""A check for figures: which pieces of text land on top of each other once the figure is drawn.

Labels that overlap are the most common way a figure becomes unreadable, and they only show after drawing (the
text's size in pixels depends on the font, the DPI and the figure size). :func:`overlapping_texts` draws the figure
with Agg and compares the window extents of every visible, non-empty text: titles, axis labels, the tick labels
that are actually drawn, annotations, ``ax.text`` labels and legend entries.

    >>> from minillm.course.widgets.figure_check import overlapping_texts
    >>> assert not overlapping_texts(fig), overlapping_texts(fig)
"""
from __future__ import annotations

from matplotlib.figure import Figure


def _drawn_texts(fig: Figure) -> list:
    """The figure's Text artists that a draw shows: visible, non-empty, and (for tick labels) inside the view."""
    from matplotlib.axis import Axis
    from matplotlib.text import Text

    tick_texts: set[int] = set()
    drawn_ticks: list = []
    for axis in fig.findobj(Axis):
        for tick in [*axis.majorTicks, *axis.minorTicks]:
            tick_texts.update((id(tick.label1), id(tick.label2)))
        if axis.get_visible():
            # Only the ticks inside the view limits are drawn. The public get_majorticklabels() also returns the
            # labels of ticks the locator placed just outside the view, which a draw skips; _update_ticks() is
            # the list Axis.draw itself uses.
            if hasattr(axis, "_update_ticks"):
                ticks = axis._update_ticks()
                drawn_ticks += [lab for t in ticks for lab in (t.label1, t.label2) if lab.get_visible()]
            else:  # pragma: no cover - a matplotlib without the private method
                drawn_ticks += [*axis.get_majorticklabels(), *axis.get_minorticklabels()]
    texts = [t for t in fig.findobj(Text) if id(t) not in tick_texts] + drawn_ticks
    out, seen = [], set()
    for t in texts:
        if id(t) in seen or not t.get_visible() or not t.get_text().strip():
            continue
        seen.add(id(t))
        out.append(t)
    return out


def overlapping_texts(fig: Figure, tol: float = 1.0) -> list[tuple[str, str]]:
    """Draw ``fig`` with Agg and return the pairs of visible texts whose boxes overlap by more than ``tol`` pixels.

    Args:
        fig: a matplotlib figure (made with pyplot or without it).
        tol: pixels of overlap (in both x and y) allowed before two texts count as overlapping.

    Returns:
        ``[(text_a, text_b), ...]``, one entry per overlapping pair, in drawing order; empty when nothing overlaps.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)  # attaches itself
    canvas.draw()
    renderer = canvas.get_renderer()
    texts = _drawn_texts(fig)
    boxes = [t.get_window_extent(renderer) for t in texts]
    pairs = []
    for i in range(len(texts)):
        for j in range(i + 1, len(texts)):
            a, b = boxes[i], boxes[j]
            dx = min(a.x1, b.x1) - max(a.x0, b.x0)
            dy = min(a.y1, b.y1) - max(a.y0, b.y0)
            if dx > tol and dy > tol:
                pairs.append((texts[i].get_text(), texts[j].get_text()))
    return pairs
