"""A contiguous KV cache for one sequence: the simplest place K/V history can live.

Each layer keeps ``K`` and ``V`` as ``[num_tokens, num_kv_heads, head_dim]`` buffers that grow as chunks (or
single decode tokens) are appended. The engine uses the paged cache (:mod:`minillm.attention.paged`) instead.

vLLM counterpart: none; vLLM keeps K/V only in a paged cache.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Self

import torch

from minillm.attention.reference import reference_attention

if TYPE_CHECKING:
    from minillm.model.llama import LlamaForCausalLM


class ContiguousKVCache:
    """K/V of every layer for one sequence, plus reference attention over it (an :class:`AttentionImpl`).

    Call the model with ``attn=cache`` for each chunk in order; every call appends the chunk's K/V and attends
    over all tokens so far. ``cache.num_tokens`` is how many tokens are cached (equal in every layer after a
    forward pass).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", capacity: int = 256) -> None:
        if num_layers < 1 or num_kv_heads < 1 or head_dim < 1 or capacity < 0:
            raise ValueError(f"need num_layers, num_kv_heads, head_dim >= 1 and capacity >= 0, got num_layers="
                             f"{num_layers}, num_kv_heads={num_kv_heads}, head_dim={head_dim}, capacity={capacity}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._k = [torch.empty(capacity, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self._v = [torch.empty_like(t) for t in self._k]
        self._len = [0] * num_layers

    @classmethod
    def for_model(cls, model: LlamaForCausalLM, capacity: int = 256) -> Self:
        """An empty cache shaped for ``model`` (a :class:`~minillm.model.llama.LlamaForCausalLM`); subclasses get their
        own type."""
        cfg = model.config
        p = next(model.parameters())
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, p.dtype, p.device, capacity)

    @property
    def num_tokens(self) -> int:
        """Tokens cached in the last layer (the count after the latest completed forward pass)."""
        return self._len[-1]

    def keys(self, layer_idx: int) -> torch.Tensor:
        """Cached keys of ``layer_idx``: ``[num_tokens, num_kv_heads, head_dim]`` (a view)."""
        return self._k[layer_idx][: self._len[layer_idx]]

    def values(self, layer_idx: int) -> torch.Tensor:
        """Cached values of ``layer_idx``: ``[num_tokens, num_kv_heads, head_dim]`` (a view)."""
        return self._v[layer_idx][: self._len[layer_idx]]

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k``, ``v`` (``[n, num_kv_heads, head_dim]``) to ``layer_idx``, growing the buffer if needed."""
        self._check_layer(layer_idx)
        want = (self.num_kv_heads, self.head_dim)
        # Checked before writing: a mismatched copy would fail half-way (K written, V not) or broadcast silently.
        if k.dim() != 3 or tuple(k.shape[1:]) != want or v.shape != k.shape:
            raise ValueError(f"k and v must both be [n, num_kv_heads={want[0]}, head_dim={want[1]}] for this cache, "
                             f"got k {tuple(k.shape)} and v {tuple(v.shape)}")
        n, start = k.shape[0], self._len[layer_idx]
        if start + n > self._k[layer_idx].shape[0]:
            new_cap = max(2 * self._k[layer_idx].shape[0], start + n)
            for bufs in (self._k, self._v):
                old = bufs[layer_idx]
                grown = torch.empty(new_cap, *old.shape[1:], dtype=old.dtype, device=old.device)
                grown[:start] = old[:start]
                bufs[layer_idx] = grown
        self._k[layer_idx][start:start + n] = k
        self._v[layer_idx][start:start + n] = v
        self._len[layer_idx] = start + n

    def _check_layer(self, layer_idx: int) -> None:
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be in [0, {self.num_layers}), got {layer_idx}")

    def truncate(self, num_tokens: int) -> None:
        """Forget every token from ``num_tokens`` on, in all layers."""
        if not 0 <= num_tokens <= min(self._len):
            raise ValueError(f"num_tokens must be in [0, {min(self._len)}], got {num_tokens}")
        self._len = [num_tokens] * self.num_layers

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append this chunk's K/V, then attend its queries over the prefix and, causally, itself.

        Args:
            q: ``[n, num_heads, head_dim]``, ``num_heads`` a multiple of the cache's ``num_kv_heads`` (GQA).
            k, v: ``[n, num_kv_heads, head_dim]``.

        Returns:
            ``[n, num_heads, head_dim]``.
        """
        # Everything is checked before the append, so a refused call leaves the cache as it was.
        if q.dim() != 3 or q.shape[2] != self.head_dim or q.shape[1] < 1 or q.shape[1] % self.num_kv_heads:
            raise ValueError(f"q must be [n, num_heads, head_dim={self.head_dim}] with num_heads a multiple of "
                             f"num_kv_heads={self.num_kv_heads}, got {tuple(q.shape)}")
        if k.dim() >= 1 and k.shape[0] != q.shape[0]:
            raise ValueError(f"q and k must have the same number of tokens, got {q.shape[0]} and {k.shape[0]}")
        self.append(layer_idx, k, v)
        return reference_attention(q, self.keys(layer_idx), self.values(layer_idx))
