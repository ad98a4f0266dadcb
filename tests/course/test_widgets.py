"""The widgets' click path, without a browser: every click redraws the figure as a PNG in an ``ipywidgets.Image`` and
never touches pyplot, so nothing is left for matplotlib-inline's ``flush_figures`` to draw on another thread (the
race that gave blank or garbled figures in JupyterLab 4.6; see minillm/course/widgets/figure_view.py). The real-browser
check of the same widgets is tests/lab/test_browser.py."""
import io

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from minillm.config import SchedulerConfig  # noqa: E402
from minillm.course.widgets import BlockTableWidget, SchedulerStepper  # noqa: E402
from minillm.course.widgets.figure_view import FigureView, render_png  # noqa: E402


def _find(root, kind: str, description: str | None = None) -> list:
    """All widgets of class ``kind`` (by name) under ``root``, optionally with this ``description``."""
    found, stack = [], [root]
    while stack:
        w = stack.pop()
        if type(w).__name__ == kind and (description is None or getattr(w, "description", None) == description):
            found.append(w)
        stack.extend(getattr(w, "children", ()))
    return found


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def _ink(png: bytes) -> float:
    """Fraction of pixels that are not white."""
    return float((_pixels(png).min(axis=2) < 250).mean())


def test_render_png_leaves_pyplot_alone():
    plt.close("all")
    png = render_png(lambda fig: fig.add_subplot().bar([0, 1], [1, 2]), (3, 2), dpi=50)
    h, w, c = _pixels(png).shape  # about 3 x 2 inches at 50 dpi: the tight bounding box trims the white margin
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and c == 3 and 85 <= h <= 100 and 130 <= w <= 150
    assert _ink(png) > 0.05
    assert plt.get_fignums() == []


def test_figure_view_shows_escaped_text():
    view = FigureView()
    view.show("a < b", b"png", "x & y")
    assert "a &lt; b" in view.status.value and "x &amp; y" in view.text.value and view.image.value == b"png"


@pytest.mark.parametrize("clicks", [10])
def test_scheduler_stepper_clicks_redraw_without_pyplot(clicks):
    plt.close("all")
    config = SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=64)
    st = SchedulerStepper(config, num_gpu_blocks=17, block_size=4, requests=[("A", 20, 6, 0), ("B", 6, 8, 0)])
    ui = st.ui()
    (image,), (step,), (add,) = _find(ui, "Image"), _find(ui, "Button", "step"), _find(ui, "Button", "add request")
    status = [h for h in _find(ui, "HTML") if "press" in h.value]
    assert status, "the status line asks for a first step"
    seen = [bytes(image.value)]
    for i in range(clicks):
        if i == 4:
            add.click()  # queues a request: the status line says so
            assert "12-token prompt" in "".join(h.value for h in _find(ui, "HTML"))
            continue
        step.click()
        assert bytes(image.value) != seen[-1], f"click {i}: the figure did not change"
        assert _ink(image.value) > 0.02, f"click {i}: the figure is blank"
        seen.append(bytes(image.value))
    assert st.step_index == clicks - 1
    assert plt.get_fignums() == [], "a click left a pyplot figure for the inline backend to flush"


def test_block_table_clicks_redraw_without_pyplot():
    plt.close("all")
    w = BlockTableWidget(num_blocks=16, block_size=4)
    ui = w.ui()
    (image,) = _find(ui, "Image")
    (add,), (append,), (free,) = (_find(ui, "Button", d) for d in ("add request", "append tokens", "free"))
    blank = bytes(image.value)
    for _ in range(3):
        add.click()
    assert bytes(image.value) != blank and len(w.requests) == 3
    (req,) = [d for d in _find(ui, "Dropdown") if d.description == "request"]
    (tokens,) = _find(ui, "BoundedIntText")
    before = bytes(image.value)
    req.value, tokens.value = req.options[0], 5  # 5 more tokens need a new block: the grid changes
    append.click()
    assert bytes(image.value) != before
    free.click()
    assert len(w.requests) == 2 and _ink(image.value) > 0.02
    text = "".join(h.value for h in _find(ui, "HTML"))
    assert "freed" in text and "free queue" in text
    assert plt.get_fignums() == []


def test_render_png_keeps_a_legend_outside_the_axes():
    """The block-table widget puts its legend right of the axes: the PNG must grow to hold it, not cut it off."""
    def draw(fig):
        ax = fig.add_subplot()
        ax.bar([0, 1], [1, 2], label="free, cached")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    assert _pixels(render_png(draw, (3, 2), dpi=50)).shape[1] > 150
