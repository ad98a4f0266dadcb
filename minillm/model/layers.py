"""The building blocks of a Llama layer, in plain PyTorch.

vLLM counterparts: ``vllm/model_executor/layers/layernorm.py`` (``RMSNorm``),
``vllm/model_executor/layers/rotary_embedding`` (``get_rope``), ``vllm/model_executor/layers/activation.py``
(``SiluAndMul``).
"""
from __future__ import annotations

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
        """``positions``: ``[num_tokens]`` -> cos, sin each ``[num_tokens, 1, head_dim]`` (fp32)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[num_tokens, num_heads, head_dim]`` and ``k`` ``[num_tokens, num_kv_heads, head_dim]``."""
        cos, sin = self.cos_sin(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class SiluAndMul(nn.Module):
    """SwiGLU's gate: input ``[num_tokens, 2 * d]`` holds gate and up halves; returns ``silu(gate) * up``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return nn.functional.silu(x[..., :d]) * x[..., d:]
