"""Reference attention in plain PyTorch: the ground truth every cache and kernel here is checked against.

A chunk of ``n`` queries at positions ``ctx_len ... ctx_len+n-1`` attends to all ``ctx_len`` earlier keys and,
causally, its own: the mask ``[n, ctx_len+n]`` has its diagonal shifted right by ``ctx_len``. The same attention in
two parts, over the prefix (no mask) and causally over the chunk, is joined exactly by :func:`merge_attn_states`
from each part's output and log-sum-exp (:func:`prefix_chunk_attention`): what lets kernels stream over K/V tiles.

vLLM counterparts: ``vllm/v1/attention/ops/triton_unified_attention.py`` (``unified_attention``),
``prefix_prefill.py`` (``context_attention_fwd``) and ``vllm/v1/attention/ops/merge_attn_states.py``
(``merge_attn_states``).
"""
from __future__ import annotations

import math
from typing import Literal, overload

import torch


def causal_mask(query_len: int, ctx_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean mask ``[query_len, ctx_len + query_len]``; ``True`` where query ``i`` may attend key ``j``.

    Query ``i`` sits at absolute position ``ctx_len + i`` and sees key ``j`` iff ``j <= ctx_len + i``.
    """
    if query_len < 0 or ctx_len < 0:
        raise ValueError(f"query_len and ctx_len must be >= 0, got query_len={query_len}, ctx_len={ctx_len}")
    q_pos = torch.arange(query_len, device=device)[:, None] + ctx_len
    k_pos = torch.arange(ctx_len + query_len, device=device)[None, :]
    return k_pos <= q_pos


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GQA: ``[T, num_kv_heads, D]`` -> ``[T, num_heads, D]``; query head ``h`` uses KV head ``h // group``."""
    num_kv_heads = x.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return x.repeat_interleave(num_heads // num_kv_heads, dim=1)


@overload
def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int | None = None,
                        causal: bool = True, scale: float | None = None,
                        return_lse: Literal[False] = False) -> torch.Tensor: ...
@overload
def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int | None = None,
                        causal: bool = True, scale: float | None = None, *,
                        return_lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int | None = None,
                        causal: bool = True, scale: float | None = None,
                        return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx_len: int | None = None,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query chunk over a prefix plus itself (grouped-query attention allowed).

    Args:
        q: ``[num_q, num_heads, head_dim]``, the chunk's queries.
        k: ``[num_k, num_kv_heads, head_dim]``, keys of the prefix then of the chunk.
        v: ``[num_k, num_kv_heads, head_dim]``.
        ctx_len: how many of the keys precede the chunk; default ``num_k - num_q``.
        causal: ``False`` lets every query see every key (used for "attention over the prefix only").
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        return_lse: also return the log-sum-exp of the scaled scores, ``[num_q, num_heads]`` (fp32), which
            :func:`merge_attn_states` needs.

    Returns:
        ``[num_q, num_heads, head_dim]`` in ``q.dtype`` (computed in fp32), and the LSE if asked. A query that sees no
        key gets output 0 and LSE ``-inf``.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be 3-D [tokens, heads, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    num_q, num_heads, head_dim = q.shape
    num_k = k.shape[0]
    if k.shape[2] != head_dim:
        raise ValueError(f"q and k must have the same head_dim, got {head_dim} and {k.shape[2]}")
    if ctx_len is None:
        ctx_len = num_k - num_q
    if causal and ctx_len + num_q != num_k:
        raise ValueError(f"causal attention needs num_k == ctx_len + num_q, got num_k={num_k}, ctx_len={ctx_len}, "
                         f"num_q={num_q}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    kf = _expand_kv(k, num_heads).float()
    vf = _expand_kv(v, num_heads).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(num_q, ctx_len, q.device)[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, num_q]
    probs = torch.exp(scores - lse[..., None].clamp(min=torch.finfo(torch.float32).min))
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key
    out = torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)
    if return_lse:
        return out, lse.transpose(0, 1).contiguous()
    return out


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets into attention over their union, exactly.

    If ``out_a`` is softmax-attention over keys A with log-sum-exp ``lse_a`` and likewise for B, then attention over
    A ∪ B is ``w_a * out_a + w_b * out_b`` with ``w_a = exp(lse_a - lse)``, ``w_b = exp(lse_b - lse)`` and
    ``lse = log(exp(lse_a) + exp(lse_b))``.

    Args:
        out_a, out_b: ``[num_tokens, num_heads, head_dim]``.
        lse_a, lse_b: ``[num_tokens, num_heads]``; ``-inf`` for an empty key set.

    Returns:
        The merged output ``[num_tokens, num_heads, head_dim]`` (dtype of ``out_a``) and LSE ``[num_tokens,
        num_heads]``.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:2]:
        raise ValueError(f"shapes do not match: out {tuple(out_a.shape)}/{tuple(out_b.shape)}, "
                         f"lse {tuple(lse_a.shape)}/{tuple(lse_b.shape)}")
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).nan_to_num(0.0)[..., None]
    w_b = torch.exp(lse_b - safe).nan_to_num(0.0)[..., None]
    out = w_a * out_a.float() + w_b * out_b.float()
    return out.to(out_a.dtype), lse


def prefix_chunk_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_chunk: torch.Tensor,
    v_chunk: torch.Tensor,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a chunk over ``prefix + chunk``, computed as two parts joined by :func:`merge_attn_states`.

    Part A: every query of the chunk sees every prefix key (no mask is needed: the whole prefix is in its past).
    Part B: causal attention of the chunk over its own keys (the ordinary triangle, offset 0). The merge of the two
    equals ``reference_attention(q, cat(k_prefix, k_chunk), cat(v_prefix, v_chunk))`` up to fp32 rounding.

    Args:
        q: ``[num_q, num_heads, head_dim]``.
        k_prefix, v_prefix: ``[ctx_len, num_kv_heads, head_dim]`` (``ctx_len`` may be 0).
        k_chunk, v_chunk: ``[num_q, num_kv_heads, head_dim]``.
        scale, return_lse: as in :func:`reference_attention`.
    """
    if k_chunk.shape[0] != q.shape[0]:
        raise ValueError(f"k_chunk must have one row per query, got {k_chunk.shape[0]} rows for {q.shape[0]} queries")
    out_a, lse_a = reference_attention(q, k_prefix, v_prefix, causal=False, scale=scale, return_lse=True)
    out_b, lse_b = reference_attention(q, k_chunk, v_chunk, ctx_len=0, causal=True, scale=scale, return_lse=True)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    return (out, lse) if return_lse else out
