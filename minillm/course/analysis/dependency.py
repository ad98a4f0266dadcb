"""The dependency graph of a chunked prefill over (layer, chunk), its valid schedules, and a matplotlib drawing.

Node ``(l, c)`` is "decoder layer ``l`` applied to the tokens of chunk ``c``": its K/V projection, its attention,
its MLP. What it needs:

- ``l == 0``: nothing but the chunk's own tokens (the K/V of layer 0 of any chunk are a function of that chunk's
  token ids and positions alone);
- ``l >= 1``: the output of layer ``l-1`` for its own chunk (its input, the residual stream) **and** for every
  earlier chunk ``c' < c``, because the K/V of layer ``l`` of chunk ``c'`` are computed from that output and the
  queries of chunk ``c`` attend to them.

So the edges are ``(l-1, c') -> (l, c)`` for all ``c' <= c``, and the ancestors of ``(l, c)`` are all ``(l', c')``
with ``l' < l`` and ``c' <= c``. Chunks are not independent from layer 1 on, but layer ``l`` of *all* chunks can run
at once once layer ``l-1`` of all of them is done: that is what context parallelism exploits (chapter 7).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

Node = tuple[int, int]  # (layer, chunk)

SCHEDULES = ("sequential", "pipeline", "context_parallel")


def _check_sizes(num_layers: int, num_chunks: int) -> None:
    if num_layers < 1 or num_chunks < 1:
        raise ValueError(f"num_layers and num_chunks must be >= 1, got {num_layers} and {num_chunks}")


def dependencies(layer: int, chunk: int) -> list[Node]:
    """Direct predecessors of node ``(layer, chunk)``: ``[(layer-1, c') for c' in 0..chunk]`` (none at layer 0)."""
    if layer < 0 or chunk < 0:
        raise ValueError(f"layer and chunk must be >= 0, got ({layer}, {chunk})")
    if layer == 0:
        return []
    return [(layer - 1, c) for c in range(chunk + 1)]


def ancestors(layer: int, chunk: int) -> set[Node]:
    """Every node ``(layer, chunk)`` depends on, directly or not: ``{(l', c') : l' < layer, c' <= chunk}``."""
    seen: set[Node] = set()
    stack = dependencies(layer, chunk)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(dependencies(*node))
    return seen


def schedule_steps(num_layers: int, num_chunks: int, mode: str = "sequential") -> dict[Node, int]:
    """The time step at which each node runs under one of three schedules (each node takes one step).

    - ``"sequential"``: one device runs chunk 0 through all layers, then chunk 1, ...: step ``c * L + l``
      (chunked prefill as a single GPU does it, one chunk per engine step).
    - ``"pipeline"``: one device per layer (pipeline parallelism); chunks stream through: step ``l + c``, a diagonal
      wavefront.
    - ``"context_parallel"``: one device per chunk, exchanging each layer's K/V: step ``l`` for every chunk.
    """
    _check_sizes(num_layers, num_chunks)
    if mode not in SCHEDULES:
        raise ValueError(f"mode must be one of {SCHEDULES}, got {mode!r}")
    steps = {}
    for l in range(num_layers):
        for c in range(num_chunks):
            steps[(l, c)] = {"sequential": c * num_layers + l, "pipeline": l + c, "context_parallel": l}[mode]
    return steps


def validate_schedule(steps: dict[Node, int]) -> None:
    """Raise ``ValueError`` if some node is scheduled no later than one of its dependencies."""
    for (l, c), t in steps.items():
        for dep in dependencies(l, c):
            if dep in steps and steps[dep] >= t:
                raise ValueError(f"node {(l, c)} at step {t} needs {dep}, which runs at step {steps[dep]}")


def plot_dependency_graph(num_layers: int, num_chunks: int, ax: Any = None,
                          highlight: Node | Iterable[Node] | None = None,
                          schedule: str | dict[Node, int] | None = None,
                          kv_only_last_layer: bool = False, title: str | None = None) -> Any:
    """Draw the (layer, chunk) dependency graph with matplotlib; returns the ``Axes``.

    Args:
        num_layers, num_chunks: size of the grid (chunks along x, layers upwards).
        ax: an existing ``Axes`` to draw on (a new figure if ``None``).
        highlight: one node ``(layer, chunk)``, whose ancestors are highlighted with it (what it waits for), or an
            iterable of nodes to highlight as given.
        schedule: a name from :func:`schedule_steps` or a ``{node: step}`` dict: nodes are coloured and labelled
            with their step, so the wavefront is visible.
        kv_only_last_layer: hatch the last-layer nodes of earlier chunks, which only need their K/V.
        title: the axes title.

    Edges: vertical arrows carry a chunk's residual stream up one layer; diagonal arrows are the K/V of earlier
    chunks that the attention of a later chunk reads.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    _check_sizes(num_layers, num_chunks)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 + 1.3 * num_chunks, 1.0 + 0.55 * num_layers))
    hl: set[Node] = set()
    if highlight is not None:
        if (isinstance(highlight, tuple) and len(highlight) == 2 and all(isinstance(x, int) for x in highlight)):
            node = cast(Node, highlight)
            hl = ancestors(*node) | {node}
        else:
            hl = {cast(Node, tuple(n)) for n in cast(Iterable[Iterable[int]], highlight)}  # [l, c] lists too
    steps: dict[Node, int] | None = None
    if isinstance(schedule, str):
        steps = schedule_steps(num_layers, num_chunks, schedule)
    elif schedule is not None:
        steps = dict(schedule)
    cmap = plt.get_cmap("viridis")
    max_step = max(steps.values()) if steps else 0

    for l in range(num_layers):
        for c in range(num_chunks):
            for (dl, dc) in dependencies(l, c):
                on = (l, c) in hl and (dl, dc) in hl
                same = dc == c
                ax.add_patch(FancyArrowPatch(
                    (dc, dl), (c, l), arrowstyle="-|>", mutation_scale=8, shrinkA=9, shrinkB=9,
                    connectionstyle="arc3,rad=0.0" if same else "arc3,rad=-0.12",
                    color=("tab:red" if on else ("0.25" if same else "tab:blue")),
                    alpha=1.0 if on or same else 0.35, lw=1.6 if on else (1.2 if same else 0.8), zorder=1))
    for l in range(num_layers):
        for c in range(num_chunks):
            node = (l, c)
            face = cmap(steps[node] / max(1, max_step)) if steps else ("#ffd6d6" if node in hl else "white")
            hatch = "///" if (kv_only_last_layer and l == num_layers - 1 and c < num_chunks - 1) else None
            ax.scatter([c], [l], s=420, marker="s", facecolor=face, edgecolor="tab:red" if node in hl else "0.2",
                       linewidth=2.0 if node in hl else 1.0, hatch=hatch, zorder=2)
            if steps is not None:
                ax.text(c, l, str(steps[node]), ha="center", va="center", fontsize=7, zorder=3,
                        color="white" if steps[node] < 0.6 * max(1, max_step) else "black")
    ax.set_xticks(range(num_chunks), [f"chunk {c}" for c in range(num_chunks)])
    ax.set_yticks(range(num_layers), [f"layer {l}" for l in range(num_layers)])
    ax.set_xlim(-0.6, num_chunks - 0.4)
    ax.set_ylim(-0.6, num_layers - 0.4)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, fontsize=10)
    return ax
