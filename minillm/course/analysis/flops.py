"""Counting the work of a prefill: matmul FLOPs per part of the model, and K/V bytes read by attention.

Convention: one multiply-add is 2 FLOPs, and only matrix products are counted (projections, ``QK^T``, ``PV``, the
LM head); norms, RoPE, softmax and SiLU are a few FLOPs per element and are left out. This is the convention of
``torch.utils.flop_counter.FlopCounterMode``, so :func:`measure_flops` of a real forward pass can be compared with
these formulas exactly.

Attention is counted two ways. *Visible* pairs: query ``i`` of a chunk with ``ctx_len`` earlier tokens sees
``ctx_len + i + 1`` keys, so a chunk of ``n`` sees ``n * ctx_len + n (n+1) / 2`` pairs (what a kernel that skips
masked tiles pays, roughly). *Dense* pairs: ``n * (ctx_len + n)``, the whole rectangle, which is what the plain
PyTorch reference computes before masking.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from minillm.config import LlamaConfig


def attention_pairs(query_len: int, ctx_len: int, dense: bool = False) -> int:
    """(query, key) pairs of one chunk per head and layer: visible ``n*ctx + n(n+1)/2``, or dense ``n*(ctx+n)``."""
    if query_len < 0 or ctx_len < 0:
        raise ValueError(f"query_len and ctx_len must be >= 0, got query_len={query_len}, ctx_len={ctx_len}")
    if dense:
        return query_len * (ctx_len + query_len)
    return query_len * ctx_len + query_len * (query_len + 1) // 2


def layer_flops(config: LlamaConfig, query_len: int, ctx_len: int, dense: bool = False,
                kv_only: bool = False) -> dict[str, int]:
    """Matmul FLOPs of one decoder layer for a chunk of ``query_len`` tokens after ``ctx_len`` cached ones.

    Returns a dict with ``q_proj``, ``kv_proj``, ``attention`` (``QK^T`` and ``PV``), ``o_proj``, ``mlp`` and
    ``total``. ``kv_only``: the chunk only needs this layer's K/V (everything but ``kv_proj`` is 0).
    """
    n, hs = query_len, config.hidden_size
    h, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    parts = {
        "q_proj": 2 * n * hs * h * d,
        "kv_proj": 2 * 2 * n * hs * hkv * d,
        "attention": 2 * 2 * h * d * attention_pairs(n, ctx_len, dense),
        "o_proj": 2 * n * h * d * hs,
        "mlp": 3 * 2 * n * hs * config.intermediate_size,
    }
    if kv_only:
        parts = {k: (v if k == "kv_proj" else 0) for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def lm_head_flops(config: LlamaConfig, num_rows: int) -> int:
    """FLOPs of the LM head (``hidden -> vocab``) on ``num_rows`` hidden states."""
    return 2 * num_rows * config.hidden_size * config.vocab_size


def prefill_flops(config: LlamaConfig, chunk_sizes: Sequence[int], logits_rows: str = "last",
                  kv_only_last_layer: bool = False, dense: bool = False) -> dict[str, int]:
    """Matmul FLOPs of a chunked prefill of ``sum(chunk_sizes)`` tokens, split into ``layers`` and ``lm_head``.

    Args:
        chunk_sizes: tokens per chunk, in order (one chunk = full prefill).
        logits_rows: ``"last"``: the LM head runs on the prompt's last token only (vLLM's ``logits_indices``);
            ``"all"``: on every prompt token (what a naive ``model(ids) -> logits`` does).
        kv_only_last_layer: every chunk but the last only computes the last layer's K/V.
        dense: count attention as the full rectangle (see the module docstring).
    """
    if logits_rows not in ("last", "all"):
        raise ValueError(f"logits_rows must be 'last' or 'all', got {logits_rows!r}")
    sizes = [int(s) for s in chunk_sizes]
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"chunk sizes must be positive integers, got {list(chunk_sizes)}")
    L = config.num_hidden_layers
    layers, ctx = 0, 0
    for c, n in enumerate(sizes):
        last_chunk = c == len(sizes) - 1
        for layer in range(L):
            kv_only = kv_only_last_layer and not last_chunk and layer == L - 1
            layers += layer_flops(config, n, ctx, dense=dense, kv_only=kv_only)["total"]
        ctx += n
    head = lm_head_flops(config, sum(sizes) if logits_rows == "all" else 1)
    return {"layers": layers, "lm_head": head, "total": layers + head}


def kv_bytes_read(config: LlamaConfig, chunk_sizes: Sequence[int], dtype_bytes: int = 4) -> int:
    """Bytes of K/V that attention reads over a chunked prefill: chunk ``c`` reads all ``ctx_c + n_c`` tokens'
    K and V at every layer.

    ``C`` equal chunks of a ``T``-token prompt read ``T (C+1) / 2`` tokens' K/V per layer, against ``T`` for a
    full prefill: the price of chunking is re-reading the prefix, not extra attention FLOPs.
    """
    sizes = [int(s) for s in chunk_sizes]
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"chunk sizes must be positive integers, got {list(chunk_sizes)}")
    tokens_read, ctx = 0, 0
    for n in sizes:
        tokens_read += ctx + n
        ctx += n
    return tokens_read * config.kv_cache_bytes_per_token(dtype_bytes)


def measure_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """Run ``fn(*args, **kwargs)`` under ``torch.utils.flop_counter.FlopCounterMode``; return (FLOPs, result).

    The counter sees every matrix product PyTorch dispatches (``mm``, ``addmm``, ``bmm``, the ``einsum`` that
    lowers to them), so this is a measurement of what the code really did, not a formula.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        result = fn(*args, **kwargs)
    return int(counter.get_total_flops()), result
