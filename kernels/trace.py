"""Which memory does a Triton kernel read and write? Record it in Triton's interpreter, and draw it.

Under ``TRITON_INTERPRET=1`` every ``tl.load`` / ``tl.store`` ends in ``InterpreterBuilder.create_masked_load`` or
``create_masked_store`` (triton 3.9.0, ``triton/runtime/interpreter.py``) with the byte addresses and the mask.
:func:`trace_memory` wraps both for a ``with`` block; each access becomes an :class:`Access`. Addresses map back to
elements of the tensors you ask about (:meth:`MemoryTrace.touched`); the rest are reads or writes *outside* them
(:meth:`MemoryTrace.outside`): a missing mask, a wrong offset. GPU tensors are copied to host per launch, and
mapped back. :func:`interpreted` gives an interpreted twin of a compiled kernel. :func:`owner_map` and
:func:`plot_access_comparison` draw the reference kernel's accesses beside yours.

vLLM counterpart: none; a tool for looking inside a kernel.
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    import matplotlib.figure

__all__ = ["Access", "AccessPanel", "MemoryTrace", "interpreted", "owner_map", "plot_access_comparison",
           "trace_memory"]

SEVERAL = -2  # in an owner map: touched by more than one trace
NONE = -1     # in an owner map: touched by none


@dataclass(frozen=True)
class Access:
    """One ``tl.load`` or ``tl.store`` executed by one program.

    Attributes:
        kind: ``"load"`` or ``"store"``.
        program_id: ``(x, y, z)`` of the program that ran it.
        addresses: int64 ``[n]``, the byte address of every lane the mask let through (flattened, in order).
        element_size: bytes per element of the pointer's type.
        launch: which kernel launch inside the trace (0 for the first).
    """

    kind: str
    program_id: tuple[int, int, int]
    addresses: np.ndarray
    element_size: int
    launch: int


@dataclass
class MemoryTrace:
    """Everything the kernels launched inside one :func:`trace_memory` block loaded and stored.

    Attributes:
        accesses: in execution order.
        launches: per launch, a map from the storage address of each tensor argument to the address the
            interpreter used for it (the same on a CPU; a host copy for a GPU tensor).
    """

    accesses: list[Access] = field(default_factory=list)
    launches: list[dict[int, int]] = field(default_factory=list)

    # -- recording ------------------------------------------------------------------------------------------------
    def _new_launch(self, args_dev: Sequence[Any], args_hst: Sequence[Any]) -> None:
        where: dict[int, int] = {}

        def visit(dev: Any, hst: Any) -> None:
            if isinstance(dev, tuple):
                for d, h in zip(dev, hst, strict=True):
                    visit(d, h)
                return
            dev, hst = getattr(dev, "base", dev), getattr(hst, "base", hst)  # triton's TensorWrapper
            if isinstance(dev, torch.Tensor) and isinstance(hst, torch.Tensor):
                where[dev.untyped_storage().data_ptr()] = hst.untyped_storage().data_ptr()

        for dev, hst in zip(args_dev, args_hst, strict=True):
            visit(dev, hst)
        self.launches.append(where)

    def _record(self, kind: str, builder: Any, ptrs: Any, mask: Any) -> None:
        data = np.asarray(ptrs.data)
        keep = np.broadcast_to(np.asarray(mask.data, dtype=bool), data.shape)
        element_size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        launch = max(len(self.launches) - 1, 0)
        x, y, z = (int(i) for i in builder.grid_idx)
        self.accesses.append(Access(kind, (x, y, z), data[keep].astype(np.int64).ravel(), element_size, launch))

    # -- reading ----------------------------------------------------------------------------------------------------
    def _of(self, kind: str) -> list[Access]:
        if kind not in ("load", "store"):
            raise ValueError(f"kind must be 'load' or 'store', got {kind!r}")
        if not self.launches:
            raise RuntimeError("no interpreted kernel launch was recorded: the kernel ran compiled. Trace it under "
                               "TRITON_INTERPRET=1, or launch kernels.trace.interpreted(kernel) instead")
        return [a for a in self.accesses if a.kind == kind]

    def _base(self, tensor: torch.Tensor, launch: int) -> int | None:
        """The address the interpreter used for ``tensor``'s first element in ``launch`` (None: not an argument)."""
        if tensor.device.type == "cpu":
            return tensor.data_ptr()
        storage = tensor.untyped_storage().data_ptr()
        host = self.launches[launch].get(storage)
        return None if host is None else host + (tensor.data_ptr() - storage)

    def _index(self, tensor: torch.Tensor, access: Access, dims: int) -> tuple[np.ndarray, ...] | None:
        """Index arrays into ``tensor.shape[:dims]`` of the addresses of ``access`` that fall inside ``tensor``."""
        base = self._base(tensor, access.launch)
        if base is None or tensor.numel() == 0:
            return None
        size = tensor.element_size()
        offset = access.addresses - base
        ok = (offset >= 0) & (offset % size == 0)
        elem = np.where(ok, offset // size, 0)
        index = [np.zeros_like(elem) for _ in range(tensor.dim())]
        # Unravel with the strides, largest first: an index in range on every axis and nothing left over means the
        # address is an element of this (possibly strided) tensor.
        for d in sorted(range(tensor.dim()), key=lambda d: -tensor.stride()[d]):
            stride = tensor.stride(d)
            if stride == 0 or tensor.shape[d] == 1:
                continue
            index[d] = elem // stride
            ok &= index[d] < tensor.shape[d]
            elem = elem - index[d] * stride
        ok &= elem == 0
        return tuple(i[ok] for i in index[:dims])

    def touched(self, tensor: torch.Tensor, kind: str = "load", dims: int = 1) -> np.ndarray:
        """bool ``tensor.shape[:dims]``: which entries of the leading ``dims`` axes the kernel loaded (or stored)
        at least one element of."""
        if not 0 < dims <= tensor.dim():
            raise ValueError(f"dims must be in 1..{tensor.dim()}, got {dims}")
        out = np.zeros(tuple(tensor.shape[:dims]), dtype=bool)
        for access in self._of(kind):
            idx = self._index(tensor, access, dims)
            if idx is not None and idx[0].size:
                out[idx] = True
        return out

    def programs(self, tensor: torch.Tensor, kind: str = "load", dims: int = 1) -> np.ndarray:
        """int ``tensor.shape[:dims]``: how many distinct programs touched each entry of the leading axes."""
        if not 0 < dims <= tensor.dim():
            raise ValueError(f"dims must be in 1..{tensor.dim()}, got {dims}")
        seen: dict[tuple[int, tuple[int, int, int]], np.ndarray] = {}
        for access in self._of(kind):
            idx = self._index(tensor, access, dims)
            if idx is None or not idx[0].size:
                continue
            key = (access.launch, access.program_id)
            mask = seen.setdefault(key, np.zeros(tuple(tensor.shape[:dims]), dtype=bool))
            mask[idx] = True
        total = np.zeros(tuple(tensor.shape[:dims]), dtype=np.int64)
        for mask in seen.values():
            total += mask
        return total

    def outside(self, tensors: Sequence[torch.Tensor], kind: str = "load") -> np.ndarray:
        """int64 byte addresses the kernel loaded (or stored) that are no element of any of ``tensors``."""
        rest = []
        for access in self._of(kind):
            inside = np.zeros(access.addresses.shape, dtype=bool)
            for t in tensors:
                base = self._base(t, access.launch)
                if base is None:
                    continue
                offset = access.addresses - base
                # Within the tensor's span; for the dense tensors the checks pass, the span is the tensor.
                last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
                span = (t.numel() and (last + 1)) * t.element_size()
                inside |= (offset >= 0) & (offset < span)
            rest.append(access.addresses[~inside])
        return np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)


@contextlib.contextmanager
def trace_memory() -> Iterator[MemoryTrace]:
    """Record every load and store of the interpreted kernels launched inside the ``with`` block.

    >>> with trace_memory() as trace:                       # doctest: +SKIP
    ...     my_kernel[grid](x, out, n, BLOCK=16)
    >>> trace.touched(x, "load")                            # doctest: +SKIP

    The interpreter's methods are replaced only inside the block and restored after it, even on an exception.
    """
    from triton.runtime import interpreter

    builder_cls, executor_cls = interpreter.InterpreterBuilder, interpreter.GridExecutor
    saved = (builder_cls.create_masked_load, builder_cls.create_masked_store, executor_cls._init_args_hst)
    original_load, original_store, original_init = saved
    trace = MemoryTrace()

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):  # noqa: ANN001, ANN202
        trace._record("load", self, ptrs, mask)
        return original_load(self, ptrs, mask, other, cache_policy, is_volatile)

    def create_masked_store(self, ptrs, value, mask, cache_policy):  # noqa: ANN001, ANN202
        trace._record("store", self, ptrs, mask)
        return original_store(self, ptrs, value, mask, cache_policy)

    def _init_args_hst(self, args_dev, kwargs):  # noqa: ANN001, ANN202
        args_hst, kwargs_hst = original_init(self, args_dev, kwargs)
        keys = list(kwargs)
        trace._new_launch(list(args_dev) + [kwargs[k] for k in keys], list(args_hst) + [kwargs_hst[k] for k in keys])
        return args_hst, kwargs_hst

    builder_cls.create_masked_load = create_masked_load
    builder_cls.create_masked_store = create_masked_store
    executor_cls._init_args_hst = _init_args_hst
    try:
        yield trace
    finally:
        builder_cls.create_masked_load, builder_cls.create_masked_store, executor_cls._init_args_hst = saved


def interpreted(kernel: Any) -> Any:
    """An interpreted twin of a ``@triton.jit`` kernel, so that :func:`trace_memory` sees its accesses.

    Under ``TRITON_INTERPRET=1`` the kernel already is interpreted and comes back unchanged. Otherwise (a GPU) the
    twin runs the same Python source in Triton's interpreter, with the ``@triton.jit`` functions it calls interpreted
    too; launch it as the kernel, ``twin[grid](...)``, on tensors of either device (GPU tensors are copied to the host
    and back by the interpreter: slow, for small traced runs only).
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    if not isinstance(kernel, JITFunction):
        raise TypeError(f"expected a @triton.jit function, got {type(kernel).__name__}")
    return _interpreted(kernel, {})


def _interpreted(kernel: Any, done: dict[int, Any]) -> Any:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if id(kernel) in done:
        return done[id(kernel)]
    fn = kernel.fn
    # A copy of the function's globals in which every jit'd function is interpreted as well; the kernel's module
    # (a notebook's namespace, say) is left alone.
    scope = dict(fn.__globals__)
    twin_fn = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    twin_fn.__kwdefaults__, twin_fn.__module__, twin_fn.__qualname__ = fn.__kwdefaults__, fn.__module__, fn.__qualname__
    twin = InterpretedFunction(twin_fn)
    done[id(kernel)] = twin
    for name, value in fn.__globals__.items():
        if isinstance(value, JITFunction):
            scope[name] = _interpreted(value, done)
    return twin


# -- pictures -------------------------------------------------------------------------------------------------------
def owner_map(traces: Sequence[MemoryTrace], tensor: torch.Tensor, kind: str = "load", dims: int = 1) -> np.ndarray:
    """int ``tensor.shape[:dims]``: the index of the trace that touched each entry, ``-1`` (:data:`NONE`) if none
    did, ``-2`` (:data:`SEVERAL`) if more than one did. One trace per request makes a map of who read what."""
    out = np.full(tuple(tensor.shape[:dims]), NONE, dtype=np.int64)
    for i, trace in enumerate(traces):
        hit = trace.touched(tensor, kind, dims)
        out[hit & (out == NONE)] = i
        out[hit & (out != i)] = SEVERAL
    return out


@dataclass
class AccessPanel:
    """One row of :func:`plot_access_comparison`: the same 2-D map for the reference kernel and for yours.

    Attributes:
        title: what the map shows ("K/V cache: which request read each row").
        reference / yours: int ``[rows, cols]`` maps of categories (``-1`` = untouched; see :func:`owner_map`).
        labels: legend text of each category value (missing ones are shown as the number).
        xlabel / ylabel: axis labels.
        xticks / yticks: tick labels (``None``: numbers).
        xlines: x positions of dashed vertical lines (the end of a tensor, say: a line at 32.5 after column 32).
    """

    title: str
    reference: np.ndarray
    yours: np.ndarray
    labels: dict[int, str] = field(default_factory=dict)
    xlabel: str = ""
    ylabel: str = ""
    xticks: Sequence[str] | None = None
    yticks: Sequence[str] | None = None
    xlines: Sequence[float] = ()

    @property
    def differences(self) -> np.ndarray:
        """int ``[n, 2]``: the ``(row, col)`` of every entry where the two maps differ."""
        return np.argwhere(np.asarray(self.reference) != np.asarray(self.yours))


_PALETTE = ["#4C72B0", "#DD8452", "#55A868", "#8172B3", "#937860", "#DA8BC3", "#CCB974", "#64B5CD", "#8C8C8C"]


def plot_access_comparison(panels: Sequence[AccessPanel], names: tuple[str, str] = ("reference kernel", "your kernel"),
                           width: float = 11.0) -> matplotlib.figure.Figure:
    """Two heatmaps per panel, side by side (the reference's, then yours), with every differing entry crossed out
    in black on both. Untouched entries are white, ``-2`` (several) grey, others one colour per category."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    heights = [max(1.2, 0.32 * np.atleast_2d(p.reference).shape[0] + 1.1) for p in panels]
    fig, axes = plt.subplots(len(panels), 2, figsize=(width, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for row, panel in enumerate(panels):
        ref, got = np.atleast_2d(panel.reference), np.atleast_2d(panel.yours)
        values = sorted((set(np.unique(ref).tolist()) | set(np.unique(got).tolist())) - {NONE})
        # A category keeps its colour whichever panel or kernel it appears in (request 2 is always the same).
        colors = {v: ("#B0B0B0" if v < 0 else _PALETTE[v % len(_PALETTE)]) for v in values}
        keys = [NONE] + values
        cmap = ListedColormap(["#FFFFFF"] + [colors[v] for v in values])
        lookup = {v: i for i, v in enumerate(keys)}
        diff = panel.differences
        for col, (name, data) in enumerate(zip(names, (ref, got), strict=True)):
            ax = axes[row][col]
            codes = np.vectorize(lookup.get)(data) if data.size else data
            ax.imshow(codes, cmap=cmap, vmin=-0.5, vmax=len(keys) - 0.5, aspect="auto", interpolation="nearest")
            ax.set_xticks(np.arange(data.shape[1] + 1) - 0.5, minor=True)
            ax.set_yticks(np.arange(data.shape[0] + 1) - 0.5, minor=True)
            ax.grid(which="minor", color="#DDDDDD", linewidth=0.6)
            ax.tick_params(which="minor", length=0)
            for axis, n, names_ in ((ax.xaxis, data.shape[1], panel.xticks), (ax.yaxis, data.shape[0], panel.yticks)):
                every = 1 if n <= 24 else 4  # a label on every 4th of many columns
                axis.set_ticks(range(0, n, every))
                axis.set_ticklabels([(names_[i] if names_ is not None else str(i)) for i in range(0, n, every)],
                                    fontsize=7)
            ax.set_xlabel(panel.xlabel, fontsize=8)
            ax.set_ylabel(panel.ylabel, fontsize=8)
            for x in panel.xlines:
                ax.axvline(x, color="black", linestyle="--", linewidth=1.2)
            if len(diff):
                ax.scatter(diff[:, 1], diff[:, 0], marker="x", color="black", s=40, linewidths=1.6)
            suffix = ""
            if col == 1:
                suffix = f" — {len(diff)} differ (x)" if len(diff) else " — same as the reference"
            ax.set_title(f"{name}: {panel.title}{suffix}", fontsize=9)
        handles = [Patch(facecolor=colors[v], edgecolor="#888888", label=panel.labels.get(v, str(v)))
                   for v in values]
        handles.append(Patch(facecolor="#FFFFFF", edgecolor="#888888", label=panel.labels.get(NONE, "not touched")))
        axes[row][1].legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7,
                            frameon=False)
    fig.tight_layout()
    return fig
