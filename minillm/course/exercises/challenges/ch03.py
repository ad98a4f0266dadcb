"""Challenge 3's reference: sliding-window attention for one request over the paged KV cache.

With a sliding window of ``W`` keys, the query at absolute position ``p`` sees only the keys ``j`` with
``p - W < j <= p``: itself and the ``W - 1`` before it (Mistral's and Gemma's local layers). vLLM v0.33.0's Triton
kernel does it in ``vllm/v1/attention/ops/triton_unified_attention.py:kernel_unified_attention`` through two
helpers of ``vllm/v1/attention/ops/triton_attention_helpers.py``: ``compute_kv_seq_mask`` masks a score unless
``(query_abs_pos - seq_offset) < SLIDING_WINDOW``, and ``compute_tile_loop_bounds`` starts the tile loop at the tile
holding ``q_abs - SLIDING_WINDOW + 1`` of the program's first query, so the tiles wholly before every row's window
are never read. The launcher passes ``SLIDING_WINDOW = 1 + window_size[0]`` (``unified_attention``).

minillm's kernels have no window; the course's challenge 3 asks for one in Triton, and its check compares the
learner's launcher with :func:`paged_window_attention`, a plain PyTorch loop.
"""
from __future__ import annotations

import math

import torch

# What a delegating answer could call (the tripwire replaces it while the learner's answer runs).
TARGETS = ("minillm.course.exercises.challenges.ch03:paged_window_attention",)


def paged_window_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_ids: torch.Tensor, seq_len: int, window: int) -> torch.Tensor:
    """Causal attention with a sliding window for one request's chunk, in float32, returned in ``q``'s dtype.

    Args:
        q: ``[num_q, num_heads, head_dim]``, the request's last ``num_q`` positions (``seq_len - num_q`` cached).
        key_cache, value_cache: ``[num_blocks, block_size, num_heads, head_dim]``.
        block_ids: the request's row of the block table (position ``j`` is row ``j % block_size`` of
            ``block_ids[j // block_size]``).
        seq_len: the request's tokens, cached and new.
        window: ``W >= 1``; query ``p`` sees the keys ``p - W < j <= p``.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1 (a query always sees itself), got {window}")
    num_q, _, head_dim = q.shape
    block_size = key_cache.shape[1]
    j = torch.arange(seq_len, device=q.device)
    blocks = block_ids.long()[j // block_size]
    k = key_cache[blocks, j % block_size].float()           # [seq_len, heads, head_dim], in logical order
    v = value_cache[blocks, j % block_size].float()
    p = torch.arange(seq_len - num_q, seq_len, device=q.device)[:, None]   # absolute position of each query
    visible = (j[None, :] <= p) & (j[None, :] > p - window)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(head_dim)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v).to(q.dtype)
