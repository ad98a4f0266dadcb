"""The engine diagram every lesson opens with (minillm/course/widgets/engine_map.py) and the overlap check for figures
(minillm/course/widgets/figure_check.py)."""
import io

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from PIL import Image

from minillm.course.widgets import engine_map
from minillm.course.widgets.engine_map import BOXES, CHAPTERS, DPI, FIGSIZE, draw_engine_map
from minillm.course.widgets.figure_check import overlapping_texts

KEYS = list(CHAPTERS)


def _patches(fig: Figure) -> dict[str, object]:
    return {p.get_gid()[4:]: p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("box:")}


def _pixels(fig: Figure) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(fig._repr_png_())).convert("RGB"), dtype=np.int16)


def _inside_pixel(fig: Figure, name: str) -> tuple[int, int]:
    """A pixel (row, col) just inside the bottom-right corner of box ``name``: no text and no inner box there."""
    box = next(b for b in BOXES if b.name == name)
    x, y = fig.axes[0].transData.transform((box.x1 - 0.5, box.y0 + 0.5))
    height = fig.bbox.height
    return int(round(height - y)), int(round(x))


def test_keys_are_the_chapters():
    assert KEYS == [f"{i:02d}" for i in range(11)]
    assert {b.chapter for b in BOXES} == set(KEYS)


@pytest.mark.parametrize("key", [None, *KEYS])
def test_each_chapter_draws_without_overlaps(key):
    fig = draw_engine_map(key)
    assert isinstance(fig, Figure)
    assert tuple(fig.get_size_inches()) == FIGSIZE
    png = _pixels(fig)
    assert png.shape[:2] == (round(FIGSIZE[1] * DPI), round(FIGSIZE[0] * DPI))
    assert overlapping_texts(fig) == []


@pytest.mark.parametrize("key", [None, "04", "10"])
def test_labels_stay_inside_their_boxes(key):
    fig = draw_engine_map(key)
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    patches = _patches(fig)
    texts = [t for t in fig.axes[0].texts if (t.get_gid() or "").startswith("text:")]
    assert {t.get_gid()[5:] for t in texts} == set(patches)
    for t in texts:
        inner = t.get_window_extent(renderer)
        outer = patches[t.get_gid()[5:]].get_window_extent(renderer)
        assert outer.x0 < inner.x0 and inner.x1 < outer.x1 - 2, (t.get_text(), inner, outer)
        assert outer.y0 < inner.y0 and inner.y1 < outer.y1, (t.get_text(), inner, outer)


@pytest.mark.parametrize("key", KEYS)
def test_highlight_colours_that_chapter_and_greys_the_rest(key):
    fig = draw_engine_map(key)
    patches = _patches(fig)
    mine = {n for n, p in patches.items() if p.chapter == key}
    assert mine
    colours = {n: to_rgba(p.get_facecolor()) for n, p in patches.items()}
    grey = {colours[n] for n in patches if n not in mine}
    assert len(grey) == 1, "every other chapter's box is the same grey"
    assert all(colours[n] not in grey for n in mine)


@pytest.mark.parametrize("key", ["01", "04", "05"])
def test_highlight_changes_the_pixels_of_that_chapters_box_only(key):
    plain, lit = draw_engine_map(), draw_engine_map(key)
    a, b = _pixels(plain), _pixels(lit)
    grey = b[_inside_pixel(lit, next(n for n, p in _patches(lit).items() if p.chapter != key and n != "beyond"))]
    for box in BOXES:
        r, c = _inside_pixel(lit, box.name)
        if box.chapter == key:
            assert (b[r, c] == a[r, c]).all(), "the highlighted box keeps its chapter colour"
            assert (b[r, c] != grey).any(), box.name
        elif not box.faint:
            assert (b[r, c] == grey).all(), box.name


def test_several_keys_and_none():
    fig = draw_engine_map(["02", "03"])
    lit = {n for n, p in _patches(fig).items() if to_rgba(p.get_facecolor()) != to_rgba("#f4f4f4")}
    assert lit == {"kv_cache", "kernel"}
    fig = draw_engine_map(None)
    assert len({to_rgba(p.get_facecolor()) for p in _patches(fig).values()}) >= 9


def _corners(box) -> list[tuple[float, float]]:
    return [(box.x0, box.y0), (box.x0, box.y1), (box.x1, box.y0), (box.x1, box.y1)]


def test_chapter_10_draws_the_engine_core_process_around_the_core_and_the_client_in_the_front_end():
    """The engine-core process (a polygon) holds the scheduler, the KV cache manager and the model runner with
    everything inside it, and leaves out the entry points, whose box holds the client."""
    from matplotlib.path import Path

    boxes = {b.name: b for b in BOXES}
    fig = draw_engine_map("10")
    patches = _patches(fig)
    assert {n for n, p in patches.items() if p.chapter == "10"} == {"core_process", "client"}
    region = Path(boxes["core_process"].outline)
    inside = ["scheduler", "kv_cache", "capstone", "model_runner", "prepare_inputs", "model", "attention", "kernel",
              "sampler"]
    for name in inside:
        assert region.contains_points(_corners(boxes[name])).all(), name
    for name in ("entry", "client", "context_parallel", "beyond"):
        assert not region.contains_points(_corners(boxes[name])).any(), name
    entry, client = boxes["entry"], boxes["client"]
    assert entry.x0 < client.x0 < client.x1 < entry.x1 and entry.y0 < client.y0 < client.y1 < entry.y1
    # the requests and outputs arrows cross the process boundary
    crossings = [pts for pts, label, _, _ in engine_map._ARROWS if label in ("requests", "outputs")]
    assert len(crossings) == 2
    for pts in crossings:
        inside_flags = region.contains_points(pts)
        assert inside_flags.any() and not inside_flags.all()


@pytest.mark.parametrize("bad", ["4", "11", "ch04", ["04", "x"]])
def test_bad_key_raises_and_names_the_allowed_keys(bad):
    with pytest.raises(ValueError, match="allowed keys: 00, 01, 02, 03, 04, 05, 06, 07, 08, 09, 10"):
        draw_engine_map(bad)


def test_displays_as_png_in_jupyter():
    from IPython.core.formatters import PNGFormatter

    png = PNGFormatter()(draw_engine_map("00"))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_overlapping_texts_finds_an_overlap():
    fig = Figure(figsize=(4, 3))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title("a title")
    ax.text(0.5, 0.5, "first label", fontsize=12)
    ax.text(0.52, 0.51, "second label", fontsize=12)
    ax.text(0.1, 0.9, "far away")
    ax.text(0.1, 0.1, "   ")  # empty text is ignored
    hidden = ax.text(0.5, 0.5, "hidden")
    hidden.set_visible(False)
    assert overlapping_texts(fig) == [("first label", "second label")]


def test_overlapping_texts_sees_crowded_tick_labels_only_in_view():
    fig = Figure(figsize=(2, 2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xticks(range(20), [f"label {i}" for i in range(20)])
    assert overlapping_texts(fig)
    ax.set_xticks([0, 19], ["a", "b"])
    assert overlapping_texts(fig) == []


def test_overlapping_texts_ignores_tick_labels_outside_the_view():
    # The locator places a tick at -5 on an axis from -1.5 to 30 (and a minor one on a log axis): not drawn, so
    # it cannot overlap anything, although Axis.get_majorticklabels() lists it.
    fig = Figure(figsize=(4, 2.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(range(30), [10 ** (-2 + i / 20) for i in range(30)])
    ax.set_yscale("log")
    fig.canvas.draw()
    assert any(t.get_text() == "\N{MINUS SIGN}5" for t in ax.xaxis.get_majorticklabels())
    assert overlapping_texts(fig) == []


def test_overlapping_texts_on_a_pyplot_figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], label="one")
    ax.plot([1, 0], label="two")
    ax.legend()
    ax.set_xlabel("x")
    try:
        assert overlapping_texts(fig) == []
    finally:
        plt.close(fig)
