"""The tensor-parallel group: the ranks sharing one model's weights, and the two collectives they use.

An **all-reduce** (sum) after each row-parallel layer and the vocab-parallel embedding turns the ranks' partial sums
into the full output; an **all-gather** after the parallel LM head joins the ranks' vocabulary slices of the logits.
:class:`TensorParallelGroup` wraps a gloo group (``None``: one rank, no communication), waits on every collective
with a timeout (a dead or stalled peer raises :class:`~minillm.distributed.comm.CollectiveError`) and counts the
bytes. :func:`simulate_all_reduce` and :func:`simulate_all_gather` do the same for ranks simulated in one process.

vLLM counterpart: ``vllm/distributed/parallel_state.py:GroupCoordinator`` (``all_reduce``, ``all_gather``), the
group of ``get_tp_group()``, called through ``vllm/distributed/communication_op.py:tensor_model_parallel_all_reduce``.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from minillm.distributed.comm import CollectiveError, _wait
from minillm.sampling_params import is_int


def check_timeout(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number of seconds > 0, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class TensorParallelGroup:
    """The ranks of one tensor-parallel group, seen from one of them.

    Args:
        group: a ``torch.distributed`` process group (gloo), or ``None`` for a one-rank group: then
            ``world_size == 1``, ``rank == 0`` and every collective returns its input without communicating (as
            vLLM's ``GroupCoordinator.all_reduce`` does when ``world_size == 1``).
        timeout_s: the longest any collective may wait before :class:`CollectiveError` is raised.

    Attributes:
        rank: this process's rank in the group, ``0 ... world_size - 1`` (its ``tp_rank``).
        world_size: ranks in the group (``tp_size``).
        bytes_all_reduced: payload bytes this rank contributed to all-reduces so far: ``t.numel() *
            t.element_size()`` per call (what this rank puts in; the wire traffic of a ring all-reduce is about
            twice that, ``2 (N-1)/N`` times, but the payload is what the formulas of the chapter count).
        num_all_reduces: all-reduce calls that communicated.
        bytes_all_gathered: payload bytes this rank contributed to all-gathers (its own slice per call).
        num_all_gathers: all-gather calls that communicated.
        wait_s: wall time spent inside collectives (blocked, waiting for the peers and the transfer).

    A one-rank group counts nothing: nothing leaves the process.

    vLLM: ``vllm/distributed/parallel_state.py:GroupCoordinator`` (``rank_in_group``, ``world_size``,
    ``all_reduce``, ``all_gather``).
    """

    def __init__(self, group: Any | None, timeout_s: float = 60.0) -> None:
        self.group = group
        self.timeout_s = check_timeout("timeout_s", timeout_s)
        if group is None:
            self.rank, self.world_size = 0, 1
        else:
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the byte and call counters and the wait time."""
        self.bytes_all_reduced = 0
        self.num_all_reduces = 0
        self.bytes_all_gathered = 0
        self.num_all_gathers = 0
        self.wait_s = 0.0

    def stats(self) -> dict[str, int | float]:
        """The counters as a plain dict (what a worker sends back to the parent)."""
        return {"bytes_all_reduced": self.bytes_all_reduced, "num_all_reduces": self.num_all_reduces,
                "bytes_all_gathered": self.bytes_all_gathered, "num_all_gathers": self.num_all_gathers,
                "comm_wait_s": self.wait_s}

    def all_reduce(self, t: torch.Tensor, what: str = "all_reduce") -> torch.Tensor:
        """Sum ``t`` over the ranks of the group, in place; returns ``t`` (now the sum, the same on every rank).

        Args:
            t: any shape, the same on every rank (``[num_tokens, hidden]`` in the model).
            what: a label for the error message (``"layer 3 o_proj"``), so a failure says where it happened.

        Raises:
            CollectiveError: the collective failed or did not complete within ``timeout_s``.

        vLLM's ``GroupCoordinator.all_reduce`` is out of place (it returns a new tensor); here the sum overwrites
        the partial because the partial is never needed again, and callers should use the returned tensor either
        way.
        """
        if self.world_size == 1:
            return t
        # gloo reduces dense, contiguous buffers; a strided view is reduced through a copy and written back.
        buf = t if t.is_contiguous() else t.contiguous()
        label = f"rank {self.rank}: {what} of {tuple(t.shape)}"
        t0 = time.perf_counter()
        try:
            work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        except Exception as e:
            raise CollectiveError(f"{label} failed: {type(e).__name__}: {e}") from e
        _wait(work, self.timeout_s, label)
        self.wait_s += time.perf_counter() - t0
        if buf is not t:
            t.copy_(buf)
        self.bytes_all_reduced += t.numel() * t.element_size()
        self.num_all_reduces += 1
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1, what: str = "all_gather") -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim``, in rank order.

        Args:
            t: this rank's slice; the same shape on every rank (pad first if the slices are uneven).
            dim: the dimension to concatenate along (the vocabulary, ``-1``, for logits).

        Returns:
            ``t``'s shape with ``dim`` multiplied by ``world_size`` (``t`` itself on a one-rank group).

        Raises:
            CollectiveError: the collective failed or did not complete within ``timeout_s``.
        """
        if self.world_size == 1:
            return t
        if not -t.dim() <= dim < t.dim():
            raise ValueError(f"dim must be in [{-t.dim()}, {t.dim()}) for a tensor of shape {tuple(t.shape)}, "
                             f"got {dim}")
        buf = t.contiguous()
        out = [torch.empty_like(buf) for _ in range(self.world_size)]
        label = f"rank {self.rank}: {what} of {tuple(t.shape)}"
        t0 = time.perf_counter()
        try:
            work = dist.all_gather(out, buf, group=self.group, async_op=True)
        except Exception as e:
            raise CollectiveError(f"{label} failed: {type(e).__name__}: {e}") from e
        _wait(work, self.timeout_s, label)
        self.wait_s += time.perf_counter() - t0
        self.bytes_all_gathered += t.numel() * t.element_size()
        self.num_all_gathers += 1
        return torch.cat(out, dim=dim)

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, world_size={self.world_size})"


def check_tp_rank(tp_rank: object, tp_size: object) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` as ints if ``tp_size >= 1`` and ``0 <= tp_rank < tp_size``, else ValueError."""
    if not is_int(tp_size) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if not is_int(tp_rank) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be an int in [0, {tp_size}), got {tp_rank!r}")
    return int(tp_rank), int(tp_size)


def simulate_all_reduce(partials: list[torch.Tensor]) -> torch.Tensor:
    """What an all-reduce (sum) computes, for ranks simulated in one process.

    Args:
        partials: one tensor per rank, all of one shape (rank ``r``'s partial output).

    Returns:
        Their sum, same shape. A real all-reduce leaves this sum on *every* rank (each rank's buffer is overwritten
        with it), which is why the layer after it can run on every rank without further communication. The real one
        may add in another order (gloo's ring adds chunk by chunk), so it can differ from this by fp32 rounding.
    """
    if not partials:
        raise ValueError("simulate_all_reduce needs at least one partial (one per rank)")
    shapes = {tuple(p.shape) for p in partials}
    if len(shapes) != 1:
        raise ValueError(f"every rank's partial must have the same shape, got {sorted(shapes)}")
    out = partials[0].clone()
    for p in partials[1:]:
        out += p
    return out


def simulate_all_gather(parts: list[torch.Tensor], dim: int = -1) -> torch.Tensor:
    """What an all-gather computes, for ranks simulated in one process: ``torch.cat(parts, dim)`` in rank order.

    A real all-gather leaves this concatenation on every rank.
    """
    if not parts:
        raise ValueError("simulate_all_gather needs at least one part (one per rank)")
    return torch.cat(list(parts), dim=dim)
