"""What one forward pass over a flat, varlen batch needs to know to attend through a paged KV cache.

Request ``i`` owns query rows ``query_start_loc[i] : query_start_loc[i+1]`` of the concatenated tokens and attends
to ``seq_lens[i]`` tokens of history through row ``i`` of ``block_table``; query ``j`` sits at absolute position
``seq_len - query_len + j``. K/V live in ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer: token ``t``
at slot ``block_table[i, t // block_size] * block_size + t % block_size``; ``slot_mapping[k]`` is where new token
``k`` is written (``-1``: padding).

vLLM counterpart: ``vllm/v1/attention/backend.py:CommonAttentionMetadata`` (``query_start_loc``, ``seq_lens``,
``block_table_tensor``, ``slot_mapping``), which each backend turns into its own, e.g.
``vllm/v1/attention/backends/flash_attn.py:FlashAttentionMetadata``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step attention inputs for a varlen batch over a paged KV cache.

    Attributes:
        query_start_loc: ``[num_reqs + 1]`` int32, cumulative query lengths starting at 0.
        seq_lens: ``[num_reqs]`` int32, tokens of history each request attends to (context + this chunk).
        block_table: ``[num_reqs, max_num_blocks_per_req]`` int32, block ids of each request (unused: 0).
        slot_mapping: ``[num_tokens]`` int64, cache slot of each new token (``-1``: skip).
        max_query_len: largest ``query_start_loc[i+1] - query_start_loc[i]``.
        max_seq_len: largest ``seq_lens[i]``.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_actual_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> torch.Tensor:
        """``[num_reqs]``: tokens each request contributes this step."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def context_lens(self) -> torch.Tensor:
        """``[num_reqs]``: tokens already cached before this step (the causal offset)."""
        return self.seq_lens - self.query_lens
