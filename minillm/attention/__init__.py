"""Attention: the reference math (``reference``) and the objects a model layer attends through.

A model layer never owns its K/V. It computes this step's ``q, k, v`` and hands them to an
:class:`~minillm.attention.backend.AttentionImpl`, which decides where the K/V history lives (nowhere, a contiguous
buffer, a paged cache) and how attention over it is computed (PyTorch reference or a Triton kernel).

vLLM counterpart: ``vllm/v1/attention/`` (backends, ops, the metadata they share).
"""
from minillm.attention.backend import AttentionImpl
from minillm.attention.contiguous import ContiguousKVCache
from minillm.attention.metadata import AttentionMetadata
from minillm.attention.paged import PagedAttention, allocate_kv_caches, build_attention_metadata
from minillm.attention.reference import causal_mask, merge_attn_states, prefix_chunk_attention, reference_attention

# minillm.attention.chunked (chapter 1's experiments) imports the model, which imports this package: import it
# as ``from minillm.attention.chunked import ...``.
__all__ = ["AttentionImpl", "AttentionMetadata", "ContiguousKVCache", "PagedAttention", "allocate_kv_caches",
           "build_attention_metadata", "causal_mask", "merge_attn_states", "prefix_chunk_attention",
           "reference_attention"]
