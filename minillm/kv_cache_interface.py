"""What a worker's KV cache is made of, and what the engine core tells each worker to allocate.

At start-up each worker describes its cache (:class:`FullAttentionSpec`, one per attention layer: the bytes of one
block of ``block_size`` tokens of its own KV heads) and reports the bytes it can give it
(``Worker.determine_available_memory``); the engine core turns the reports into one :class:`KVCacheConfig` per
worker, every one with the same ``num_blocks`` (the smallest rank's: a block id must name the same tokens on every
rank), and each worker allocates its cache from its own (``Worker.initialize_from_config``). A tensor-parallel rank
caches only its KV heads, so its block is ``num_kv_heads / tp_size`` of a whole block.

vLLM counterpart: ``vllm/v1/kv_cache_interface.py`` (``FullAttentionSpec``, ``KVCacheConfig``); vLLM also has sliding
window, Mamba and MLA specs, groups of layers with different specs, and named tensors per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class FullAttentionSpec:
    """The KV cache of one full-attention layer on one worker.

    Attributes:
        block_size: tokens per block.
        num_kv_heads: the KV heads this worker caches (its own, under tensor parallelism).
        head_size: ``head_dim``.
        dtype: the cache's dtype.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer: K and V, ``2 * block_size * num_kv_heads * head_size * dtype size``
        (vLLM: ``AttentionSpec.page_size_bytes``)."""
        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_bytes


@dataclass(frozen=True)
class KVCacheConfig:
    """What one worker allocates: ``num_blocks`` blocks (the reserved null block included) of every layer in
    ``kv_cache_spec``, ``[num_blocks, block_size, num_kv_heads, head_size]`` for K and for V of each.

    Attributes:
        num_blocks: blocks per layer, the same on every worker.
        kv_cache_spec: layer name -> its spec on this worker (``model.layers.{i}.self_attn``).
    """

    num_blocks: int
    kv_cache_spec: dict[str, FullAttentionSpec] = field(default_factory=dict)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across every layer of this worker."""
        return bytes_per_block(self.kv_cache_spec)


def bytes_per_block(kv_cache_spec: dict[str, FullAttentionSpec]) -> int:
    """Bytes one block takes across every layer of a worker's spec (layer name -> :class:`FullAttentionSpec`)."""
    return sum(spec.page_size_bytes for spec in kv_cache_spec.values())
