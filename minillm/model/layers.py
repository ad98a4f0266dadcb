"""The building blocks of a Llama layer, in plain PyTorch.

vLLM counterparts: ``vllm/model_executor/layers/layernorm.py`` (``RMSNorm``),
``vllm/model_executor/layers/rotary_embedding`` (``get_rope``). The SwiGLU activation is inlined in
:class:`~minillm.model.llama.LlamaMLP` (vLLM: ``SiluAndMul`` in ``vllm/model_executor/layers/activation.py``).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension.

    Computed in fp32 whatever the input dtype, as Llama's reference does, then cast back.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[num_tokens, hidden_size]`` -> same shape."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype)) if dtype == torch.float32 else (self.weight * x32).to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), "rotate half" layout as in Hugging Face Llama.

    The angle of dimension pair ``i`` at position ``p`` is ``p * theta^(-2i/head_dim)``. Positions are explicit, so a
    chunk at absolute positions ``ctx_len ... ctx_len+n-1`` is rotated exactly as in a full prefill.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: ``[num_tokens]`` -> cos, sin each ``[num_tokens, 1, head_dim]`` (fp32).

        Inside :func:`share_rotary_cache` (the model's forward pass) every layer rotates by the same angles, so the
        first layer computes them and the others reuse them.
        """
        shared = getattr(_ROPE_CACHE, "entries", None)
        if shared is None or shared.get("positions") is not positions:
            return self._cos_sin(positions)
        key = (self.head_dim, self.theta, self.inv_freq.device)
        if key not in shared:
            shared[key] = self._cos_sin(positions)
        return shared[key]

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[num_tokens, num_heads, head_dim]`` and ``k`` ``[num_tokens, num_kv_heads, head_dim]``."""
        cos, sin = self.cos_sin(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


# Per thread: {"positions": the tensor being rotated, (head_dim, theta, device): (cos, sin)} while a forward pass runs.
_ROPE_CACHE = threading.local()


@contextlib.contextmanager
def share_rotary_cache(positions: torch.Tensor) -> Iterator[None]:
    """Within this block, every :class:`RotaryEmbedding` called with this very ``positions`` tensor reuses the cos
    and sin the first one computed (a forward pass rotates all layers by the same angles; recomputing them per
    layer costs ~10% of a prefill on a CPU). Outside it nothing is cached, so a tensor changed in place between
    calls is never served stale angles."""
    previous = getattr(_ROPE_CACHE, "entries", None)
    _ROPE_CACHE.entries = {"positions": positions}
    try:
        yield
    finally:
        _ROPE_CACHE.entries = previous


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, computed half by half without
    building the rotated copy (the same floating-point operations, so the same bits)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = xf * cos
    out[..., :half] -= x2 * sin[..., :half]
    out[..., half:] += x1 * sin[..., half:]
    return out.to(x.dtype)
