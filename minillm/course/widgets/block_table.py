"""A view of a :class:`~minillm.core.KVCacheManager`: who owns which block, what is cached, what is evicted next.

- :func:`describe_kv_cache`: the state as deterministic text (block tables, ref counts, hashes, free queue order).
- :func:`plot_block_pool`: the blocks as a coloured grid (colour = owner; hatched = shared; grey = free but cached).
- :class:`BlockTableWidget`: buttons a learner drives (add a request, append tokens, free it) on a small manager;
  the same actions are plain methods, so a notebook can drive it headless and show the result statically.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from minillm.core.kv_cache_manager import KVCacheManager
from minillm.course.widgets.figure_view import COLORS as _COLORS
from minillm.course.widgets.figure_view import FigureView, render_png
from minillm.request import Request


def _short(h: bytes | None) -> str:
    return h.hex()[:6] if h is not None else "-"


def _holders(manager: KVCacheManager) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for rid, blocks in manager.req_to_blocks.items():
        for b in blocks:
            out.setdefault(b.block_id, []).append(rid)
    return out


def describe_kv_cache(manager: KVCacheManager, requests: Sequence[Request] = ()) -> str:
    """The manager's state as text: each request's block table and slots, each block's owners, ref count and hash,
    and the free queue from next-evicted to last."""
    bs = manager.block_size
    lines = [f"blocks: {manager.num_blocks} (block 0 = null), block_size {bs}, free {manager.num_free_blocks}, "
             f"usage {manager.usage:.0%}"]
    by_id = {r.request_id: r for r in requests}
    for rid in manager.req_to_blocks:
        ids = manager.get_block_ids(rid)
        req = by_id.get(rid)
        extra = ""
        if req is not None:
            n = req.num_computed_tokens
            extra = f", {n} tokens, last slot {ids[(n - 1) // bs] * bs + (n - 1) % bs}" if n else ""
            toks = req.all_token_ids[:n]
            extra += "\n      tokens by block: " + " | ".join(
                " ".join(map(str, toks[i:i + bs])) for i in range(0, len(toks), bs))
        lines.append(f"  {rid}: block_table {ids}{extra}")
    lines.append("  block  ref  hash    owners")
    holders = _holders(manager)
    for b in manager.block_pool.blocks[1:]:
        if b.ref_cnt or b.block_hash is not None:
            held_by = ",".join(holders.get(b.block_id, []))
            lines.append(f"  {b.block_id:5d}  {b.ref_cnt:3d}  {_short(b.block_hash)}  {held_by}")
    free = manager.block_pool.free_block_queue.get_all_free_blocks()
    lines.append("  free queue (evicted first -> last): "
                 + " ".join(f"{b.block_id}{'*' if b.block_hash is not None else ''}" for b in free)
                 + "   (* = still cached)")
    s = manager.prefix_cache_stats
    lines.append(f"  prefix cache: {s.hits} of {s.queries} looked-up tokens hit")
    return "\n".join(lines)


def block_pool_figsize(num_blocks: int, cols: int = 8) -> tuple[float, float]:
    """The figure size (inches) that :func:`plot_block_pool` uses for ``num_blocks`` cells in ``cols`` columns."""
    return 1.1 * cols, 0.9 * -(-num_blocks // cols) + 0.8


def plot_block_pool(manager: KVCacheManager, ax=None, title: str | None = None, cols: int = 8):
    """Draw every block as a cell: colour = owning request (hatched when shared), light grey = free but cached
    (reusable by hash), white = free and empty, black = the null block. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    n = manager.num_blocks
    rows = -(-n // cols)
    if ax is None:
        _, ax = plt.subplots(figsize=block_pool_figsize(n, cols))
    order = list(manager.req_to_blocks)
    color_of = {rid: _COLORS[i % len(_COLORS)] for i, rid in enumerate(order)}
    holders = _holders(manager)
    free_pos = {b.block_id: i for i, b in enumerate(manager.block_pool.free_block_queue.get_all_free_blocks())}
    for b in manager.block_pool.blocks:
        r, c = divmod(b.block_id, cols)
        y = rows - 1 - r
        owners = holders.get(b.block_id, [])
        if b.is_null:
            face, hatch, label = "black", None, "null"
        elif owners:
            face, hatch = color_of[owners[0]], ("//" if len(owners) > 1 else None)
            label = f"ref {b.ref_cnt}"
        elif b.block_hash is not None:
            face, hatch, label = "#DDDDDD", None, f"free #{free_pos[b.block_id]}"
        else:
            face, hatch, label = "white", None, f"free #{free_pos[b.block_id]}"
        ax.add_patch(Rectangle((c, y), 0.92, 0.85, facecolor=face, edgecolor="black", hatch=hatch, linewidth=0.8))
        txt = "white" if b.is_null else "black"
        ax.text(c + 0.46, y + 0.6, str(b.block_id), ha="center", va="center", fontsize=9, color=txt, weight="bold")
        ax.text(c + 0.46, y + 0.38, label, ha="center", va="center", fontsize=7, color=txt)
        if b.block_hash is not None:
            ax.text(c + 0.46, y + 0.15, _short(b.block_hash), ha="center", va="center", fontsize=6, family="monospace")
    ax.set_xlim(-0.1, cols)
    ax.set_ylim(-0.1, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    handles = [Patch(facecolor=color_of[r], label=r) for r in order]
    handles += [Patch(facecolor="#DDDDDD", edgecolor="black", label="free, cached"),
                Patch(facecolor="white", edgecolor="black", label="free")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or f"{manager.num_free_blocks} free blocks, usage {manager.usage:.0%}", fontsize=10)
    return ax


class BlockTableWidget:
    """A small KV cache manager a learner can drive: add requests, append tokens (decode), free them.

    Args:
        num_blocks: blocks in the pool (block 0 is the null block).
        block_size: tokens per block.
        prompts: named prompts (token id lists) offered by the "add" button; requests built from the same prompt
            share their full blocks through prefix caching.
        enable_caching: prefix caching on or off.

    Methods :meth:`add_request`, :meth:`append_tokens` and :meth:`free` do what the buttons do and return a status
    line; :meth:`state_text` and :meth:`plot` show the state without any widget front-end.
    """

    def __init__(self, num_blocks: int = 16, block_size: int = 4, prompts: dict[str, list[int]] | None = None,
                 enable_caching: bool = True) -> None:
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self.prompts = dict(prompts or {"A": list(range(1, 11)), "B": list(range(1, 7)) + [50, 51, 52]})
        self.reset()
        self._ui: dict[str, Any] = {}  # the widgets, once ui() has built them

    def reset(self) -> str:
        """Start over with an empty pool."""
        self.manager = KVCacheManager(self.num_blocks, self.block_size, self.enable_caching)
        self.requests: dict[str, Request] = {}
        self._next = 0
        self._next_token = 1000  # "sampled" tokens get fresh ids, so they never match a prompt by accident
        return "reset"

    def add_request(self, prompt: str | list[int]) -> str:
        """Admit a request and prefill its whole prompt (after a prefix-cache lookup)."""
        tokens = self.prompts[prompt] if isinstance(prompt, str) else list(prompt)
        name = prompt if isinstance(prompt, str) else "req"
        req = Request(f"{name}{self._next}", tokens)
        self._next += 1
        blocks, hit = self.manager.get_computed_blocks(req)
        if self.manager.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
            return f"{req.request_id}: not enough free blocks for {req.num_tokens} tokens; free a request first"
        self.manager.record_prefix_cache_stats(req, hit)  # admitted: counted once, as the scheduler does
        req.num_computed_tokens = req.num_tokens
        self.requests[req.request_id] = req
        return f"{req.request_id}: {req.num_tokens} prompt tokens, {hit} from the prefix cache"

    def append_tokens(self, request_id: str, n: int = 1) -> str:
        """Decode ``n`` tokens for ``request_id``: append a token, allocate its slot, one at a time."""
        if request_id not in self.requests:
            raise ValueError(f"no running request {request_id!r}; running: {sorted(self.requests)}")
        req = self.requests[request_id]
        for i in range(n):
            req.append_output_token_ids(self._next_token)
            self._next_token += 1
            if self.manager.allocate_slots(req, 1) is None:
                req.output_token_ids.pop()
                req.all_token_ids.pop()
                return f"{request_id}: pool full after {i} tokens (a scheduler would preempt a request now)"
            req.num_computed_tokens += 1
        return f"{request_id}: {req.num_tokens} tokens in {len(self.manager.get_block_ids(request_id))} blocks"

    def free(self, request_id: str) -> str:
        """Finish ``request_id``: its blocks go back to the free queue, tail first, hashed ones (still findable) to
        the back, unhashed ones to the front (:meth:`BlockPool.free_blocks`)."""
        if request_id not in self.requests:
            raise ValueError(f"no running request {request_id!r}; running: {sorted(self.requests)}")
        self.manager.free(self.requests.pop(request_id))
        return f"{request_id}: freed"

    def state_text(self) -> str:
        return describe_kv_cache(self.manager, list(self.requests.values()))

    def plot(self, ax=None, title: str | None = None):
        return plot_block_pool(self.manager, ax=ax, title=title)

    # -- the ipywidgets front-end ----------------------------------------------------------------------------------
    def _render(self, status: str = "") -> None:
        png = render_png(lambda fig: self.plot(ax=fig.add_subplot()), block_pool_figsize(self.num_blocks))
        self._ui["view"].show(status, png, self.state_text())
        self._ui["req"].options = sorted(self.requests)

    def ui(self):
        """The interactive view (an ``ipywidgets.VBox``); display it as a cell's last expression."""
        import ipywidgets as w

        prompt = w.Dropdown(options=list(self.prompts), description="prompt")
        add = w.Button(description="add request")
        req = w.Dropdown(options=sorted(self.requests), description="request")
        n = w.BoundedIntText(value=1, min=1, max=64, description="tokens", layout=w.Layout(width="150px"))
        append = w.Button(description="append tokens")
        free = w.Button(description="free")
        reset = w.Button(description="reset")
        view = FigureView()
        self._ui = {"view": view, "req": req}

        def act(fn):
            def handler(_):
                try:
                    self._render(fn())
                except ValueError as e:
                    self._render(str(e))
            return handler

        add.on_click(act(lambda: self.add_request(prompt.value)))
        append.on_click(act(lambda: self.append_tokens(req.value, n.value) if req.value else "no request selected"))
        free.on_click(act(lambda: self.free(req.value) if req.value else "no request selected"))
        reset.on_click(act(self.reset))
        self._render()
        return w.VBox([w.HBox([prompt, add, reset]), w.HBox([req, n, append, free]), view.widget])
