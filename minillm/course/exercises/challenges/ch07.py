"""Challenge 7: a third split, striped (round-robin), and its balance.

The zigzag split evens out the causal work by pairing an early piece with a late one. A *striped* split deals the
prompt out in runs of ``interleave`` tokens, round-robin: run ``k`` (positions ``k * interleave ..``) goes to rank
``k % world_size``. Every rank then holds tokens from the whole prompt, early and late alike, and with
``interleave = 1`` the busiest rank sees fewer than ``num_tokens`` more query-key pairs than the least busy one
(``ContextSplit.causal_pairs``), whatever the prompt's length.

vLLM v0.33.0 has no striped split of a prefill's queries: its prefill context parallel cuts the zigzag way
("DualChunkSwap", ``vllm/v1/worker/gpu/pcp_manager.py:PCPManager._iter_rank_chunks``). Its *decode* context parallel
stores the KV cache striped: with ``cp_kv_cache_interleave_size = s`` (``vllm/config/parallel.py:ParallelConfig``)
token ``i`` lives on DCP rank ``(i // s) % dcp_world_size``
(``vllm/v1/worker/gpu/cp_utils.py:cp_local_slot``, and ``_dcp_local_seq_lens_kernel``: "Distribute KV cache among
different ranks, in a round-robin manner"). For queries, the idea is Striped Attention (Brandon et al., 2023,
arXiv:2311.09431), a ring attention whose blocks are all close to causal triangles.
"""
from __future__ import annotations

import torch

from minillm.distributed.splits import ContextSplit, Piece

# What a delegating answer could call (the tripwire reads it for "C7").
TARGETS = ("minillm.course.exercises.challenges.ch07:striped_split",
           "minillm.course.exercises.challenges.ch07:striped_restore_order")


def striped_split(num_tokens: int, world_size: int, interleave: int = 1) -> ContextSplit:
    """Runs of ``interleave`` positions dealt round-robin: run ``k`` is ``Piece(k * interleave, min((k + 1) *
    interleave, num_tokens))`` and belongs to rank ``k % world_size``; each rank's pieces in increasing order.

    E.g. ``striped_split(7, 2, 2)``: runs ``[0 1] [2 3] [4 5] [6]``; rank 0 holds ``[0 1] [4 5]``, rank 1 ``[2 3]
    [6]``.

    Raises:
        ValueError: ``world_size`` or ``interleave`` below 1, or a rank would hold no token (``num_tokens <=
            (world_size - 1) * interleave``).
    """
    if world_size < 1 or interleave < 1:
        raise ValueError(f"world_size and interleave must be >= 1, got {world_size} and {interleave}")
    if num_tokens <= (world_size - 1) * interleave:
        raise ValueError(f"a striped split over {world_size} ranks in runs of {interleave} needs more than "
                         f"{(world_size - 1) * interleave} tokens (one per rank), got num_tokens={num_tokens}")
    pieces: list[list[Piece]] = [[] for _ in range(world_size)]
    for k, start in enumerate(range(0, num_tokens, interleave)):
        pieces[k % world_size].append(Piece(start, min(start + interleave, num_tokens)))  # the last run may be short
    return ContextSplit(num_tokens, world_size, "striped", tuple(tuple(p) for p in pieces))


def striped_restore_order(num_tokens: int, world_size: int, interleave: int = 1) -> torch.Tensor:
    """int64 ``[num_tokens]`` ``idx``: ``torch.cat(rank_outputs)[idx]`` is in token order (rank outputs in rank order,
    rows in each rank's position order)."""
    split = striped_split(num_tokens, world_size, interleave)
    held = torch.cat([split.positions(r) for r in range(world_size)])  # row i of the stacked outputs holds held[i]
    return torch.argsort(held)
