"""Attention: the reference math (``reference``) and the objects a model layer attends through.

A model layer never owns its K/V. It computes this step's ``q, k, v`` and hands them to an
:class:`~minillm.attention.backend.AttentionImpl`, which decides where the K/V history lives (nowhere, a contiguous
buffer, a paged cache) and how attention over it is computed (PyTorch reference or a Triton kernel).
"""
from minillm.attention.backend import AttentionImpl
from minillm.attention.contiguous import ContiguousKVCache
from minillm.attention.reference import causal_mask, merge_attn_states, reference_attention

__all__ = ["AttentionImpl", "ContiguousKVCache", "causal_mask", "merge_attn_states", "reference_attention"]
