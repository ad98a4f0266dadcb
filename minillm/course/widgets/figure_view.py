"""The panel every widget draws into: a status line, a figure and a text block, all plain widget state.

Why not ``with output: plt.show()``: JupyterLab 4.6 sends widget messages to a kernel *subshell* thread
(its ``commsOverSubshells`` setting). After a click, matplotlib-inline's ``flush_figures`` runs on that thread and
draws the pyplot figures that the button callback is drawing at the same moment; the PNG comes out blank or with
bars in the wrong place. Here a figure is a :class:`matplotlib.figure.Figure` made without pyplot, so no other
thread knows of it; it is rendered to PNG bytes by its own Agg canvas and shown in an ``ipywidgets.Image``. The
text goes into ``ipywidgets.HTML`` values, so nothing depends on where the kernel routes printed output.
"""
from __future__ import annotations

import html
import io
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import matplotlib.figure  # imported where a figure is drawn: importing this module draws nothing

# One colour per request, in order of first appearance, shared by every widget's drawing.
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD"]

# Matplotlib is not thread-safe (its font cache is shared); two widgets clicked at once must not draw together.
_RENDER_LOCK = threading.Lock()


def render_png(draw: Callable[[matplotlib.figure.Figure], None], figsize: tuple[float, float],
               dpi: int = 90) -> bytes:
    """Draw a figure with ``draw(fig)`` on a pyplot-free :class:`~matplotlib.figure.Figure` and return it as PNG.

    Args:
        draw: fills the figure (adds axes, plots); its return value is ignored.
        figsize: inches, as for ``plt.figure``.
        dpi: pixels per inch of the PNG.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with _RENDER_LOCK:
        fig = Figure(figsize=figsize, dpi=dpi)
        FigureCanvasAgg(fig)
        draw(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")  # legends outside the axes stay in the picture
    return buf.getvalue()


def _pre(text: str) -> str:
    return f"<pre style='margin:0; font-size:12px; line-height:1.3'>{html.escape(text)}</pre>"


class FigureView:
    """A status line, a figure (PNG) and a text block, stacked; :meth:`show` replaces all three at once.

    ``widget`` is the ``ipywidgets.VBox`` to place in a layout. Its children are ``status`` (``HTML``), ``image``
    (``Image``) and ``text`` (``HTML``); their values are what the browser shows, so tests can read them too.
    """

    def __init__(self) -> None:
        import ipywidgets as w

        self.status = w.HTML()
        self.image = w.Image(format="png", layout=w.Layout(max_width="100%"))
        self.text = w.HTML()
        self.widget = w.VBox([self.status, self.image, self.text])

    def show(self, status: str, png: bytes, text: str) -> None:
        """Replace the status line, the figure (PNG bytes from :func:`render_png`) and the text block."""
        self.status.value = _pre(status)
        self.image.value = png
        self.text.value = _pre(text)
