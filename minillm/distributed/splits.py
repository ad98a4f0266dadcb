"""How the tokens of one prompt are dealt out to the ranks of a context-parallel group.

A split cuts positions ``0 ... num_tokens-1`` into contiguous *pieces*: ``plain`` gives rank ``r`` piece ``r`` of
``N``; ``zigzag`` gives it pieces ``r`` and ``2N-1-r`` of ``2N``, one early and one late, so every rank has about the
same causal attention to do. Every rank rebuilds the split from ``(num_tokens, world_size, kind)``: no positions are
sent. Pieces differ by at most one token.

vLLM counterpart: ``vllm/v1/worker/gpu/pcp_manager.py:PCPManager.partition_batch`` ("DualChunkSwap",
``PCPManager._iter_rank_chunks``: chunks ``r`` and ``2 * pcp_world_size - 1 - r``), which leaves its last chunks
shorter instead and does not split decodes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SPLIT_KINDS = ("plain", "zigzag")


@dataclass(frozen=True)
class Piece:
    """A contiguous run of absolute positions ``start ... end-1``."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ContextSplit:
    """The pieces each rank holds. ``pieces[r]`` is rank ``r``'s pieces in increasing position order.

    A rank's *local* tokens are its pieces concatenated in that order: local row ``i`` of its q/k/v is position
    ``positions(r)[i]``.
    """

    num_tokens: int
    world_size: int
    kind: str
    pieces: tuple[tuple[Piece, ...], ...]

    def positions(self, rank: int) -> torch.Tensor:
        """Absolute positions of ``rank``'s local tokens: ``[num_local_tokens(rank)]`` int64, increasing."""
        self._check_rank(rank)
        return torch.cat([torch.arange(p.start, p.end) for p in self.pieces[rank]])

    def num_local_tokens(self, rank: int) -> int:
        """How many tokens ``rank`` holds."""
        self._check_rank(rank)
        return sum(len(p) for p in self.pieces[rank])

    @property
    def max_local_tokens(self) -> int:
        """The largest number of tokens any rank holds (the padded size of an all-gather)."""
        return max(self.num_local_tokens(r) for r in range(self.world_size))

    @property
    def last_token_rank(self) -> int:
        """The rank holding position ``num_tokens - 1``: it produces the next-token logits.

        ``world_size - 1`` for the plain split, rank 0 for zigzag (piece ``2N-1`` belongs to rank 0).
        """
        for r, ps in enumerate(self.pieces):
            if any(p.start <= self.num_tokens - 1 < p.end for p in ps):
                return r
        raise AssertionError("unreachable: the pieces cover every position")

    def attention_score_entries(self, rank: int) -> int:
        """Query-key scores ``rank`` computes in one layer (per head), piece by piece.

        A query piece ``[s, e)`` scores every key of an earlier piece and the ``len x len`` square of its own piece
        (the upper triangle is computed and masked, as a block kernel does); later pieces are skipped. Attention
        FLOPs per layer are ``4 x num_heads x head_dim x`` this number (``QK^T`` and ``PV``, 2 FLOPs per
        multiply-add).
        """
        self._check_rank(rank)
        return sum(len(p) * p.end for p in self.pieces[rank])

    def causal_pairs(self, rank: int) -> int:
        """Query-key pairs ``rank``'s queries may see under the causal rule (per head, per layer): the work an
        ideal kernel that skips masked entries would do. Position ``p`` sees ``p + 1`` keys."""
        self._check_rank(rank)
        return sum((p.start + 1 + p.end) * len(p) // 2 for p in self.pieces[rank])

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")


def _cut(num_tokens: int, num_pieces: int) -> list[Piece]:
    """``num_pieces`` contiguous pieces covering ``0 ... num_tokens-1``; sizes differ by at most one (larger first)."""
    base, extra = divmod(num_tokens, num_pieces)
    pieces, start = [], 0
    for i in range(num_pieces):
        end = start + base + (1 if i < extra else 0)
        pieces.append(Piece(start, end))
        start = end
    return pieces


def make_split(num_tokens: int, world_size: int, kind: str = "plain") -> ContextSplit:
    """Split ``num_tokens`` positions over ``world_size`` ranks.

    Args:
        num_tokens: prompt length.
        world_size: ranks in the context-parallel group.
        kind: ``"plain"`` (rank ``r`` gets piece ``r`` of ``N``) or ``"zigzag"`` (pieces ``r`` and ``2N-1-r`` of
            ``2N``).

    Raises:
        ValueError: unknown ``kind``, ``world_size < 1``, or fewer tokens than pieces (every piece must be
            non-empty so that every rank has work and every exchange has a fixed shape).
    """
    if kind not in SPLIT_KINDS:
        raise ValueError(f"split kind must be one of {SPLIT_KINDS}, got {kind!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    num_pieces = world_size if kind == "plain" else 2 * world_size
    if num_tokens < num_pieces:
        raise ValueError(f"a {kind} split over {world_size} ranks needs at least {num_pieces} tokens "
                         f"(one per piece), got num_tokens={num_tokens}")
    cut = _cut(num_tokens, num_pieces)
    pieces: tuple[tuple[Piece, ...], ...]
    if kind == "plain":
        pieces = tuple((cut[r],) for r in range(world_size))
    else:
        pieces = tuple((cut[r], cut[2 * world_size - 1 - r]) for r in range(world_size))
    return ContextSplit(num_tokens, world_size, kind, pieces)
