"""The attention-layer hooks of a KV connector: wait for a layer's loads before it attends, save its K/V after.

vLLM counterpart: ``vllm/model_executor/layers/attention/kv_transfer_utils.py``, whose decorator wraps each
attention layer's forward with ``connector.wait_for_layer_load(layer_name)`` before and
``connector.save_kv_layer(layer_name, kv_cache, attn_metadata)`` after.
"""
from __future__ import annotations

import torch

from minillm.attention.backend import AttentionImpl
from minillm.attention.metadata import AttentionMetadata
from minillm.distributed.kv_transfer.base import KVCache, KVConnectorBase_V1


class KVConnectorAttention:
    """An :class:`~minillm.attention.backend.AttentionImpl` that runs ``inner`` between the connector's hooks.

    Args:
        inner: the step's attention (it writes the step's K/V into ``kv_caches``, then attends).
        connector: the worker side of the engine's connector.
        kv_caches: the paged cache, one ``(key_cache, value_cache)`` per layer.
        metadata: the step's attention metadata.
    """

    def __init__(self, inner: AttentionImpl, connector: KVConnectorBase_V1, kv_caches: list[KVCache],
                 metadata: AttentionMetadata) -> None:
        self.inner = inner
        self.connector = connector
        self.kv_caches = kv_caches
        self.metadata = metadata

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[num_tokens, num_heads, head_dim]``, ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` ->
        ``[num_tokens, num_heads, head_dim]``."""
        self.connector.wait_for_layer_load(layer_idx)
        out = self.inner.forward(layer_idx, q, k, v)
        self.connector.save_kv_layer(layer_idx, self.kv_caches[layer_idx], self.metadata)
        return out
