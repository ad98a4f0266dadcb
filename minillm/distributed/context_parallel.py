"""Context-parallel prefill: the pieces of one prompt on several ranks at once, advancing layer by layer together.

Rank ``r`` runs the unchanged model on its pieces (:mod:`minillm.distributed.splits`). Only attention needs other
ranks' tokens, so the model gets :class:`ContextParallelAttention` as its ``attn``: at every layer it exchanges K/V
(:mod:`minillm.distributed.comm`) and applies the causal rule by *absolute* position. Under ``torchrun``::

    dist.init_process_group("gloo")
    split = make_split(len(ids), dist.get_world_size(), "zigzag")
    out = context_parallel_forward(model, ids, split, dist.group.WORLD, strategy="ring")

vLLM counterparts: ``prefill_context_parallel_size`` in ``ParallelConfig`` (``vllm/config/parallel.py``), the group
``get_pcp_group()`` (``vllm/distributed/parallel_state.py``), token partitioning in
``vllm/v1/worker/gpu/pcp_manager.py`` (``PCPManager.partition_batch``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from minillm.attention.reference import merge_attn_states, reference_attention
from minillm.distributed.comm import CommStats, RingExchange, all_gather_kv
from minillm.distributed.splits import ContextSplit, Piece

if TYPE_CHECKING:
    from minillm.model.llama import LlamaForCausalLM

STRATEGIES = ("allgather", "ring")


@dataclass
class _LocalPiece:
    """A piece of this rank's tokens: absolute positions ``piece.start ... piece.end-1`` at local rows
    ``row ... row+len-1``."""

    piece: Piece
    row: int


def _local_pieces(pieces: tuple[Piece, ...]) -> list[_LocalPiece]:
    out, row = [], 0
    for p in pieces:
        out.append(_LocalPiece(p, row))
        row += len(p)
    return out


class ContextParallelAttention:
    """An :class:`~minillm.attention.backend.AttentionImpl` for one rank of a context-parallel prefill.

    ``forward(layer_idx, q, k, v)`` receives this rank's rotated ``q`` ``[n, num_heads, head_dim]`` and ``k``, ``v``
    ``[n, num_kv_heads, head_dim]`` (``n = split.num_local_tokens(rank)``), exchanges K/V with the other ranks and
    returns attention of its queries over every key at an earlier or equal absolute position ``[n, num_heads,
    head_dim]``. It keeps its own K/V per layer (``kv_shard``): the rank's shard of the KV cache.

    Args:
        split: who holds which positions (the same object on every rank).
        group: the context-parallel process group; ``dist.get_rank(group)`` is this rank's index in ``split``.
        strategy: ``"allgather"`` (gather every block, then one attention per query piece) or ``"ring"`` (``N``
            steps; at each, attend to the block held and merge with the online-softmax rule while the next block
            travels).
        timeout_s: limit on every wait.
        fail_at_layer: for tests; at this layer, instead of exchanging, ``fail_mode="raise"`` raises a
            ``RuntimeError`` (a rank that crashes) and ``fail_mode="hang"`` sleeps far past ``timeout_s`` (a rank that
            stalls, so its peers' timeouts must fire).
    """

    def __init__(self, split: ContextSplit, group: dist.ProcessGroup, num_layers: int, strategy: str = "allgather",
                 timeout_s: float = 60.0, fail_at_layer: int | None = None, fail_mode: str = "raise") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.split = split
        self.group = group
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != split.world_size:
            raise ValueError(f"the group has {dist.get_world_size(group)} ranks but the split is for "
                             f"{split.world_size}")
        self.strategy = strategy
        self.timeout_s = timeout_s
        if fail_mode not in ("raise", "hang"):
            raise ValueError(f"fail_mode must be 'raise' or 'hang', got {fail_mode!r}")
        self.fail_at_layer = fail_at_layer
        self.fail_mode = fail_mode
        self.stats = CommStats(num_layers)
        self.kv_shard: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.score_entries = [0] * num_layers  # query-key scores computed per head, counted as they happen
        self.attn_cpu_s = 0.0  # CPU time of this thread in attention math (not in waits)
        self._mine = _local_pieces(split.pieces[self.rank])
        self._positions = [split.positions(r) for r in range(split.world_size)]

    # -- the AttentionImpl entry point -------------------------------------------------------------------------
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = self.split.num_local_tokens(self.rank)
        if q.shape[0] != n or k.shape[0] != n:
            raise ValueError(f"rank {self.rank} holds {n} tokens but got q {tuple(q.shape)}, k {tuple(k.shape)}")
        if self.fail_at_layer == layer_idx:
            if self.fail_mode == "hang":
                time.sleep(10 * self.timeout_s)
            raise RuntimeError(f"deliberate failure on rank {self.rank} at layer {layer_idx}")
        self.kv_shard[layer_idx] = (k, v)
        kv = torch.stack([k, v])  # [2, n, num_kv_heads, head_dim]: one message instead of two
        if self.strategy == "allgather":
            return self._allgather(layer_idx, q, kv)
        return self._ring(layer_idx, q, kv)

    # -- strategy 1: all-gather --------------------------------------------------------------------------------
    def _allgather(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        split = self.split
        blocks = all_gather_kv(kv, split.max_local_tokens, self.group, self.stats, layer_idx, self.timeout_s)
        t0 = time.thread_time()
        full = kv.new_empty(2, split.num_tokens, *kv.shape[2:])
        for src, block in enumerate(blocks):
            # Put every rank's tokens back at their absolute positions (vLLM: pcp_allgather_restore_idx).
            full[:, self._positions[src]] = block[:, : len(self._positions[src])]
        out = torch.empty_like(q)
        for lp in self._mine:
            s, e = lp.piece.start, lp.piece.end
            # Keys 0 ... e-1, queries at s ... e-1: the causal rule by absolute position is reference_attention's
            # shifted diagonal with ctx_len = s. Keys after e are never touched: that is the work saved.
            out[lp.row: lp.row + len(lp.piece)] = reference_attention(
                q[lp.row: lp.row + len(lp.piece)], full[0, :e], full[1, :e], ctx_len=s)
            self.score_entries[layer_idx] += len(lp.piece) * e
        self.attn_cpu_s += time.thread_time() - t0
        return out

    # -- strategy 2: ring with online-softmax merging ----------------------------------------------------------
    def _ring(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        split, world = self.split, self.split.world_size
        acc = torch.zeros(q.shape, dtype=torch.float32)
        acc_lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32)
        ring = RingExchange(self.group, self.stats, self.timeout_s) if world > 1 else None
        block = kv
        for step in range(world):
            src = (self.rank - step) % world  # whose tokens the block I hold now are
            if ring is not None and step < world - 1:
                nxt = (self.rank - step - 1) % world
                ring.start(block, (2, split.num_local_tokens(nxt), *kv.shape[2:]), layer_idx, step)
            t0 = time.thread_time()
            self._attend_block(layer_idx, q, block, src, acc, acc_lse)
            self.attn_cpu_s += time.thread_time() - t0
            if ring is not None and step < world - 1:
                block = ring.finish()
        return acc.to(q.dtype)

    def _attend_block(self, layer_idx: int, q: torch.Tensor, block: torch.Tensor, src: int, acc: torch.Tensor,
                      acc_lse: torch.Tensor) -> None:
        """Attend every query piece of mine to every key piece of ``block`` (rank ``src``'s tokens) that the causal
        rule allows, merging each partial result into ``acc``/``acc_lse`` (``[n, H, D]`` / ``[n, H]``, fp32)."""
        for kp in _local_pieces(self.split.pieces[src]):
            k_blk = block[0, kp.row: kp.row + len(kp.piece)]
            v_blk = block[1, kp.row: kp.row + len(kp.piece)]
            for qp in self._mine:
                # Pieces of one split never overlap: a key piece is wholly before, the same as, or wholly after.
                if kp.piece.start >= qp.piece.end:
                    continue  # every key is later than every query: nothing visible
                causal = kp.piece == qp.piece  # the diagonal block; otherwise all keys are earlier
                rows = slice(qp.row, qp.row + len(qp.piece))
                out, lse = reference_attention(q[rows], k_blk, v_blk, ctx_len=0 if causal else None, causal=causal,
                                               return_lse=True)
                acc[rows], acc_lse[rows] = merge_attn_states(acc[rows], acc_lse[rows], out.float(), lse)
                self.score_entries[layer_idx] += len(qp.piece) * len(kp.piece)


@dataclass
class RankPrefillOutput:
    """What one rank of a context-parallel prefill produced and measured.

    Attributes:
        rank: index in the context-parallel group.
        positions: ``[n]`` absolute positions of this rank's tokens.
        hidden_states: ``[n, hidden]`` final normed hidden states of those tokens.
        last_layer_kv: ``[2, n, num_kv_heads, head_dim]``, K and V of the last layer for those tokens.
        logits: ``[vocab]`` next-token logits if this rank holds the final position, else ``None``.
        bytes_sent: ``[num_layers]`` bytes this rank sent per layer.
        score_entries: ``[num_layers]`` query-key scores computed per head per layer.
        attn_cpu_s: CPU seconds in attention math. forward_cpu_s: CPU seconds of the whole forward pass (this
            thread). forward_wall_s: its wall time. wait_s: wall time blocked on communication.
    """

    rank: int
    positions: torch.Tensor
    hidden_states: torch.Tensor
    last_layer_kv: torch.Tensor
    logits: torch.Tensor | None
    bytes_sent: list[int]
    score_entries: list[int]
    attn_cpu_s: float
    forward_cpu_s: float
    forward_wall_s: float
    wait_s: float


@torch.inference_mode()
def context_parallel_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, split: ContextSplit,
                             group: dist.ProcessGroup, strategy: str = "allgather", timeout_s: float = 60.0,
                             fail_at_layer: int | None = None, fail_mode: str = "raise") -> RankPrefillOutput:
    """Run this rank's share of a prefill; call it on every rank of ``group`` at the same time.

    Args:
        model: a :class:`~minillm.model.llama.LlamaForCausalLM` (the same weights on every rank).
        input_ids: ``[num_tokens]``, the whole prompt (every rank has it; each takes its own positions).
        split: from :func:`~minillm.distributed.splits.make_split`, the same on every rank.
        group: the context-parallel process group (this rank's index in ``split`` is its rank in the group).
        strategy: ``"allgather"`` or ``"ring"`` (see :class:`ContextParallelAttention`).
        timeout_s: limit on every communication wait.
        fail_at_layer, fail_mode: fault injection for tests (see :class:`ContextParallelAttention`).

    Returns:
        This rank's :class:`RankPrefillOutput`; the rank holding the last position also has the logits.
    """
    if input_ids.dim() != 1 or input_ids.shape[0] != split.num_tokens:
        raise ValueError(f"input_ids must be [num_tokens={split.num_tokens}], got {tuple(input_ids.shape)}")
    rank = dist.get_rank(group)
    attn = ContextParallelAttention(split, group, model.config.num_hidden_layers, strategy, timeout_s, fail_at_layer,
                                    fail_mode)
    positions = split.positions(rank)
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    hidden = model(input_ids[positions], positions, attn=attn)
    forward_cpu_s, forward_wall_s = time.thread_time() - cpu0, time.perf_counter() - wall0
    logits = None
    if rank == split.last_token_rank:
        logits = model.compute_logits(hidden[-1:])[0]  # the final position is this rank's last local row
    last = attn.kv_shard[-1]
    assert last is not None  # the forward pass ran every layer
    k, v = last
    return RankPrefillOutput(rank, positions, hidden, torch.stack([k, v]), logits, attn.stats.bytes_sent,
                             attn.score_entries, attn.attn_cpu_s, forward_cpu_s, forward_wall_s, attn.stats.wait_s)
