"""The engine on one page: every part the course builds, the chapter that builds it, and one step's data flow.

:func:`draw_engine_map` draws the diagram each lesson opens with, the lesson's own part in colour and the rest in
grey, so a learner always sees where the piece in front of them sits in the engine. The names are vLLM V1's (see
``vllm/v1/engine/llm_engine.py``, ``vllm/v1/core/sched/scheduler.py``, ``vllm/v1/worker/gpu_model_runner.py``), so
the map is also a map of the real thing.

The figure is a :class:`matplotlib.figure.Figure` made without pyplot (as :mod:`minillm.course.widgets.figure_view`
does, so no other thread draws it), with a ``_repr_png_``: returned as a cell's last expression, Jupyter shows it.
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from matplotlib.figure import Figure

#: The chapter keys :func:`draw_engine_map` accepts, with what each chapter builds.
CHAPTERS: dict[str, str] = {
    "00": "model, GGUF loader, tokenizer",
    "01": "attention over a prefix, chunk by chunk",
    "02": "KVCacheManager, BlockPool, block table, prefix cache",
    "03": "Triton prefill kernel: unified_attention, reshape_and_cache",
    "04": "Scheduler: waiting/running, token budget, preemption",
    "05": "Sampler and stop check",
    "06": "ModelRunner._prepare_inputs, LLMEngine step loop, LLM and the OpenAI server",
    "07": "context parallelism across ranks",
    "08": "capstone: your parts in the engine via EngineParts",
    "09": "beyond one engine: disaggregated prefill with a KV connector, tensor parallelism",
    "10": "the engine as vLLM runs it: the engine-core process and its client, async scheduling, request slots",
}

# One light fill and one edge colour per chapter (a colour-blind-safe palette, lightened for the fills).
_FILL = {"00": "#dbe6f4", "01": "#fbe3d0", "02": "#d8eedc", "03": "#f5d6d7", "04": "#e4def0",
         "05": "#eadfd8", "06": "#f6e1f0", "07": "#e6e6e6", "08": "#f2eed5", "09": "#d9eef3", "10": "#d5efec"}
_EDGE = {"00": "#4C72B0", "01": "#DD8452", "02": "#55A868", "03": "#C44E52", "04": "#8172B3",
         "05": "#937860", "06": "#DA8BC3", "07": "#6f6f6f", "08": "#B5A33B", "09": "#4C9DB5", "10": "#2A9D8F"}
_GREY_FILL, _GREY_EDGE, _GREY_TEXT = "#f4f4f4", "#c8c8c8", "#a0a0a0"
_ARROW = "#404040"

FIGSIZE = (10.0, 4.5)  # inches; the drawing uses data units of 0.1 inch (x 0..100, y 0..45)
DPI = 100


@dataclass(frozen=True)
class _Box:
    name: str
    chapter: str
    x0: float
    y0: float
    x1: float
    y1: float
    title: str
    body: str = ""
    frame: bool = False  # a frame holds other boxes: its title sits at its bottom-left corner
    faint: bool = False  # drawn dashed and pale unless highlighted (a chapter that is not built)
    # A region that is not a rectangle (chapter 10's process around other boxes): its corners, and the top-left
    # corner of its title and body. (x0, y0, x1, y1) is then its bounding box.
    outline: tuple[tuple[float, float], ...] = ()
    label_at: tuple[float, float] = (0.0, 0.0)


BOXES: tuple[_Box, ...] = (
    _Box("entry", "06", 0.5, 33.5, 20.5, 44.5, "06 Entry points",
         "LLM.generate · OpenAI server\nLLMEngine.step() loop"),
    _Box("scheduler", "04", 27.0, 33.5, 50.0, 44.5, "04 Scheduler",
         "waiting / running queues\ntoken budget · preemption"),
    _Box("kv_cache", "02", 57.0, 33.5, 81.0, 44.5, "02 KVCacheManager + BlockPool",
         "block table · prefix cache\nallocate_slots · free"),
    _Box("capstone", "08", 85.5, 33.5, 99.5, 44.5, "08 Capstone",
         "your parts in the\nengine, passed in\nvia EngineParts"),
    _Box("model_runner", "06", 0.5, 11.5, 99.5, 29.5, "06 ModelRunner: one forward pass per step", frame=True),
    _Box("prepare_inputs", "06", 2.0, 14.0, 19.5, 28.0, "06 _prepare_inputs",
         "input_ids, positions\nblock_table,\nslot_mapping,\nquery_start_loc,\nseq_lens"),
    _Box("model", "00", 24.0, 14.0, 71.0, 28.0, "00 Model: Llama + GGUF loader + tokenizer"),
    _Box("attention", "01", 25.5, 15.0, 46.5, 24.5, "01 Attention",
         "each chunk's queries attend\nto the cached prefix\nand to themselves"),
    _Box("kernel", "03", 48.5, 15.0, 69.5, 24.5, "03 Triton prefill kernel",
         "unified_attention\nreshape_and_cache\nover the paged K/V cache"),
    _Box("sampler", "05", 79.0, 14.0, 98.0, 28.0, "05 Sampler",
         "logits → token ids\n(greedy, top-k, top-p)\nstop check"),
    _Box("context_parallel", "07", 0.5, 0.5, 33.0, 9.5, "07 Context parallelism",
         "one prompt's chunks prefilled\nat once on several ranks"),
    _Box("beyond", "09", 36.5, 0.5, 70.0, 9.5, "09 Beyond one engine",
         "prefill engine → KV connector → decode engine\ntensor parallelism: one model on several ranks"),
    # Chapter 10: the engine core's own process holds the scheduler, the KV cache manager and the model runner (behind
    # the executor); the entry points keep the client. The process runs behind every other box, out of the entry
    # points' corner, down to a pocket at the bottom right that carries its name.
    _Box("core_process", "10", 0.2, 3.9, 99.8, 44.8, "10 Engine-core process",
         "EngineCoreProc: busy loop,\ninput and output socket threads,\nExecutor → ModelRunner (model thread)",
         frame=True, outline=((26.2, 44.8), (99.8, 44.8), (99.8, 3.9), (72.0, 3.9), (72.0, 10.5), (0.2, 10.5),
                              (0.2, 32.9), (26.2, 32.9)), label_at=(73.0, 11.2)),
    _Box("client", "10", 1.5, 33.9, 19.5, 38.4, "10 EngineCoreClient", "ZMQ sockets · msgpack"),
)

# (points of the path in data units, label, label position, label alignment); each path ends with an arrow head.
_ARROWS: tuple[tuple[tuple[tuple[float, float], ...], str, tuple[float, float], str], ...] = (
    (((20.5, 41.0), (27.0, 41.0)), "requests", (23.75, 41.4), "bottom"),
    (((27.0, 37.0), (20.5, 37.0)), "outputs", (23.75, 37.4), "bottom"),
    (((32.0, 33.5), (32.0, 31.0), (10.0, 31.0), (10.0, 28.0)), "SchedulerOutput", (21.0, 31.3), "bottom"),
    (((19.5, 21.0), (24.0, 21.0)), "", (0, 0), ""),
    (((50.0, 39.0), (57.0, 39.0)), "blocks", (53.5, 39.4), "bottom"),
    (((71.0, 21.0), (79.0, 21.0)), "logits", (75.0, 21.4), "bottom"),
    (((90.0, 28.0), (90.0, 31.0), (44.0, 31.0), (44.0, 33.5)),
     "sampled tokens → Scheduler.update_from_output", (67.0, 31.3), "bottom"),
)


class EngineMapFigure(Figure):
    """A :class:`~matplotlib.figure.Figure` that Jupyter displays as PNG without pyplot (``_repr_png_``)."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=self.dpi)
        return buf.getvalue()


def _chapters(highlight: str | Sequence[str] | None) -> set[str]:
    if highlight is None:
        return set()
    keys = [highlight] if isinstance(highlight, str) else list(highlight)
    bad = [k for k in keys if k not in CHAPTERS]
    if bad:
        raise ValueError(f"unknown chapter key(s) {bad!r}; allowed keys: {', '.join(CHAPTERS)}")
    return set(keys)


class BoxStyle(TypedDict):
    fill: str
    edge: str
    text: str
    linewidth: float


def box_style(box: _Box, highlighted: set[str]) -> BoxStyle:
    """Fill, edge and text colours of ``box`` when the chapters in ``highlighted`` are coloured (none: all are)."""
    on = box.chapter in highlighted if highlighted else not box.faint
    if on:
        return {"fill": _FILL[box.chapter], "edge": _EDGE[box.chapter], "text": "#1a1a1a",
                "linewidth": 2.2 if highlighted else 1.2}
    return {"fill": _GREY_FILL, "edge": _GREY_EDGE, "text": _GREY_TEXT, "linewidth": 1.0}


def draw_engine_map(highlight: str | Sequence[str] | None = None) -> Figure:
    """Draw the engine: one box per part, labelled with its vLLM name and the chapter that builds it, and the arrows
    of one engine step (requests → Scheduler → SchedulerOutput → ModelRunner → logits → Sampler → tokens →
    Scheduler.update_from_output → outputs).

    Args:
        highlight: a chapter key (``"00"`` … ``"10"``) or several; its boxes are coloured and the others grey.
            ``None`` colours every chapter.

    Returns:
        A 10 x 4.5 inch :class:`EngineMapFigure` (a matplotlib ``Figure``; Jupyter shows it as PNG). Every box's
        patch has the gid ``"box:<name>"`` and its chapter in ``patch.chapter``; its texts have the gid
        ``"text:<name>"`` (for tests).

    Raises:
        ValueError: a key that is not a chapter; the message lists the allowed keys.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Polygon
    from matplotlib.path import Path

    highlighted = _chapters(highlight)
    fig = EngineMapFigure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 45)
    ax.set_axis_off()

    for box in BOXES:
        st = box_style(box, highlighted)
        style: dict[str, Any] = dict(facecolor=st["fill"], edgecolor=st["edge"], linewidth=st["linewidth"],
                                     linestyle="--" if box.faint else "-")
        patch: Polygon | FancyBboxPatch
        if box.outline:  # behind the frames it holds
            patch = Polygon(box.outline, closed=True, joinstyle="round", zorder=0.5, **style)
        else:
            patch = FancyBboxPatch((box.x0, box.y0), box.x1 - box.x0, box.y1 - box.y0,
                                   boxstyle="round,pad=0,rounding_size=0.8", zorder=1 if box.frame else 2, **style)
        patch.set_gid(f"box:{box.name}")
        patch.chapter = box.chapter  # type: ignore[union-attr]  # our own tag on matplotlib's patch (tests read it)
        ax.add_patch(patch)
        if box.outline:
            x, y = box.label_at
            ax.text(x, y, box.title, fontsize=8.5, fontweight="bold", color=st["text"], ha="left", va="top",
                    zorder=3, gid=f"text:{box.name}")
            ax.text(x, y - 2.1, box.body, fontsize=8, color=st["text"], ha="left", va="top", linespacing=1.25,
                    zorder=3, gid=f"text:{box.name}")
            continue
        if box.frame:
            ax.text(box.x0 + 1.0, box.y0 + 0.6, box.title, fontsize=8.5, fontweight="bold", color=st["text"],
                    ha="left", va="bottom", zorder=3, gid=f"text:{box.name}")
            continue
        ax.text(box.x0 + 1.0, box.y1 - 0.8, box.title, fontsize=8.5, fontweight="bold", color=st["text"],
                ha="left", va="top", zorder=3, gid=f"text:{box.name}")
        if box.body:
            ax.text(box.x0 + 1.0, box.y1 - 2.9, box.body, fontsize=8, color=st["text"], ha="left", va="top",
                    linespacing=1.25, zorder=3, gid=f"text:{box.name}")

    for points, label, (lx, ly), va in _ARROWS:
        codes = [Path.MOVETO] + [Path.LINETO] * (len(points) - 1)
        arrow = "<|-|>" if label == "blocks" else "-|>"  # the scheduler asks for blocks and frees them
        ax.add_patch(FancyArrowPatch(path=Path(points, codes), arrowstyle=f"{arrow},head_length=4,head_width=2.2",
                                     color=_ARROW, linewidth=1.1, zorder=4, shrinkA=0, shrinkB=0))
        if label:
            ax.text(lx, ly, label, fontsize=7.5, color=_ARROW, ha="center", va=va, style="italic", zorder=5)
    # 07 runs the ModelRunner on several ranks: a dotted link, no arrow (it is not a step of the loop)
    ax.plot([16.0, 16.0], [9.5, 11.5], linestyle=":", color=_ARROW, linewidth=1.2, zorder=4)

    note = "arrows: one engine step"
    if highlighted:
        note += "\ncoloured: chapter " + ", ".join(sorted(highlighted))
    ax.text(99.0, 1.0, note, fontsize=7.5, color="#555555", ha="right", va="bottom", style="italic", zorder=5)
    return fig
