"""The contract between a model layer and the place its K/V history lives.

vLLM counterpart: ``vllm/v1/attention/backend.py`` (``AttentionImpl.forward`` receives the layer, its query, key
and value, its KV cache tensor and the step's ``attn_metadata``; ``AttentionBackend`` names the implementation and
its metadata builder). Older releases kept these classes in ``vllm/attention/backends/abstract.py``. Here the
implementation object carries its cache and metadata itself, so a learner can swap a contiguous cache, a paged cache
or a Triton kernel in one argument.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionImpl(Protocol):
    """Anything a :class:`~minillm.model.llama.LlamaAttention` layer can attend through."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's K/V for ``layer_idx`` and return attention over the whole history.

        Args:
            layer_idx: which decoder layer is calling (each layer has its own K/V).
            q: ``[num_tokens, num_heads, head_dim]``, already rotated by RoPE.
            k: ``[num_tokens, num_kv_heads, head_dim]``, already rotated by RoPE.
            v: ``[num_tokens, num_kv_heads, head_dim]``.

        Returns:
            ``[num_tokens, num_heads, head_dim]``: for each token, attention over every earlier token of its sequence
            (from the cache) and itself.
        """
        ...
