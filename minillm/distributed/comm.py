"""The two K/V exchanges of context-parallel attention, with a timeout on every one and a count of bytes sent.

- :func:`all_gather_kv`: every rank contributes its ``[2, n, num_kv_heads, head_dim]`` K/V block and receives every
  other rank's (vLLM's prefill context parallel: "partial query, full key/value").
- :class:`RingExchange`: blocks travel one hop around the ring per step, ``rank -> rank+1``, while the ranks compute
  on the block they hold (ring attention: "partial query, partial key/value").

Every call waits with a timeout, and a failure is re-raised as :class:`CollectiveError` naming the rank, the layer and
the operation, so a rank whose peer died or stalled fails instead of hanging.

vLLM counterpart: ``GroupCoordinator.all_gather`` in ``vllm/distributed/parallel_state.py`` on the group returned by
``get_pcp_group()``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective or point-to-point operation failed or timed out (usually because a peer failed first)."""


@dataclass
class CommStats:
    """What one rank sent and how long it waited, per layer.

    ``bytes_sent[layer]``: payload bytes this rank put on the wire for that layer, counted in the run (the ring: each
    block as its send is posted; the all-gather: the blocks that arrived from the other ranks, which in an
    all-gather of equal-sized blocks is the same number). ``wait_s``: wall time spent blocked in ``wait()`` over the
    whole run (time not hidden behind computation).
    """

    num_layers: int
    bytes_sent: list[int] = field(default_factory=list)
    wait_s: float = 0.0

    def __post_init__(self) -> None:
        self.bytes_sent = [0] * self.num_layers


def _wait(work: dist.Work, timeout_s: float, what: str) -> None:
    """Wait for ``work`` at most ``timeout_s``; turn any failure into :class:`CollectiveError`."""
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # gloo raises on timeout and on a closed peer connection
        raise CollectiveError(f"{what} failed: {type(e).__name__}: {e}") from e
    if ok is False:
        raise CollectiveError(f"{what} did not complete within {timeout_s} s")


def all_gather_kv(kv: torch.Tensor, max_tokens: int, group: dist.ProcessGroup, stats: CommStats, layer_idx: int,
                  timeout_s: float) -> list[torch.Tensor]:
    """All-gather the K/V blocks of every rank of ``group``.

    Args:
        kv: this rank's ``[2, n, num_kv_heads, head_dim]`` (K stacked on V) with ``n <= max_tokens``.
        max_tokens: the largest ``n`` of any rank; blocks are zero-padded to it because an all-gather moves
            equal-sized tensors.

    Returns:
        ``world_size`` tensors ``[2, max_tokens, num_kv_heads, head_dim]``, one per rank of ``group`` (padded).

    What is added to ``stats.bytes_sent[layer_idx]`` is counted from the exchange, not from a formula: the sizes of
    the blocks that arrived from the other ``N - 1`` ranks. An all-gather moves equal-sized blocks (each rank ships
    its padded block to the ``N - 1`` others, directly or forwarded around a ring), so what a rank receives is what
    it sends; :func:`expected_bytes_per_layer` is the formula to check the count against.
    """
    world = dist.get_world_size(group)
    if kv.shape[1] > max_tokens:
        raise ValueError(f"kv holds {kv.shape[1]} tokens, more than max_tokens={max_tokens}")
    padded = kv.new_zeros(kv.shape[0], max_tokens, *kv.shape[2:])
    padded[:, : kv.shape[1]] = kv
    out = [torch.empty_like(padded) for _ in range(world)]
    what = f"rank {dist.get_rank(group)}: all_gather of K/V at layer {layer_idx}"
    t0 = time.perf_counter()
    try:
        work = dist.all_gather(out, padded, group=group, async_op=True)
    except Exception as e:
        raise CollectiveError(f"{what} failed: {type(e).__name__}: {e}") from e
    _wait(work, timeout_s, what)
    stats.wait_s += time.perf_counter() - t0
    me = dist.get_rank(group)
    stats.bytes_sent[layer_idx] += sum(t.numel() * t.element_size() for src, t in enumerate(out) if src != me)
    return out


class RingExchange:
    """One step of a ring: send the block I hold to ``rank + 1``, receive the next one from ``rank - 1``.

    Use as ``start()`` (posts the non-blocking send and receive), compute on the block you hold, then ``finish()``
    (waits, with a timeout, and returns the received block). Sending and computing overlap, which is the point of the
    ring: on GPUs the transfer hides behind the attention math.
    """

    def __init__(self, group: dist.ProcessGroup, stats: CommStats, timeout_s: float) -> None:
        self.group = group
        self.stats = stats
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # P2P calls take global ranks; translate the ring neighbours of this group.
        self.next_global = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev_global = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self._works: list[dist.Work] = []
        self._recv: torch.Tensor | None = None
        self._what = ""

    def start(self, block: torch.Tensor, recv_shape: tuple[int, ...], layer_idx: int, step: int) -> None:
        """Post ``send(block -> rank+1)`` and ``recv(rank-1 -> buffer of recv_shape)``."""
        self._recv = block.new_empty(recv_shape)
        self._what = f"rank {self.rank}: ring step {step} at layer {layer_idx}"
        try:
            # Tag by step so a late message from the previous step can never be taken for this one.
            send = dist.isend(block.contiguous(), self.next_global, group=self.group, tag=step)
            recv = dist.irecv(self._recv, self.prev_global, group=self.group, tag=step)
            assert send is not None and recv is not None  # None only on a rank outside the group
            self._works = [send, recv]
        except Exception as e:
            raise CollectiveError(f"{self._what} failed to start: {type(e).__name__}: {e}") from e
        self.stats.bytes_sent[layer_idx] += block.numel() * block.element_size()

    def finish(self) -> torch.Tensor:
        """Wait for the posted send and receive; return the received block."""
        t0 = time.perf_counter()
        for w in self._works:
            _wait(w, self.timeout_s, self._what)
        self.stats.wait_s += time.perf_counter() - t0
        assert self._recv is not None
        out, self._recv, self._works = self._recv, None, []
        return out


def expected_bytes_per_layer(strategy: str, block_tokens: list[int], rank: int, num_kv_heads: int, head_dim: int,
                             dtype_bytes: int = 4) -> int:
    """The formula for what ``rank`` sends in one layer.

    Args:
        strategy: ``"allgather"`` or ``"ring"``.
        block_tokens: tokens held by each rank, ``[n_0, ..., n_{N-1}]``.

    One token's K and V are ``2 x num_kv_heads x head_dim x dtype_bytes`` bytes. All-gather: ``(N - 1)`` padded
    blocks of ``max(n)`` tokens. Ring: at step ``s = 0 ... N-2`` rank ``r`` forwards the block that started at rank
    ``r - s``, so it sends every block except the one of rank ``r + 1``.
    """
    per_token = 2 * num_kv_heads * head_dim * dtype_bytes
    world = len(block_tokens)
    if strategy == "allgather":
        return (world - 1) * max(block_tokens) * per_token
    if strategy == "ring":
        return sum(block_tokens[(rank - s) % world] for s in range(world - 1)) * per_token
    raise ValueError(f"strategy must be 'allgather' or 'ring', got {strategy!r}")
