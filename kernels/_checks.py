"""Argument checks shared by the kernel wrappers: bad input fails with a ValueError before any kernel launches."""
from __future__ import annotations

import torch

# bf16 compiles on a GPU but gives garbage or NaN in Triton's CPU interpreter (TRITON_INTERPRET=1): fp32 and fp16 there.
_GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float32, torch.float16)


def check_dtype(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``t`` has a dtype the kernels support on its device."""
    allowed = _CPU_DTYPES if t.device.type == "cpu" else _GPU_DTYPES
    if t.dtype not in allowed:
        raise ValueError(f"{name} has dtype {t.dtype}; on {t.device.type} the kernels support "
                         f"{', '.join(str(d) for d in allowed)}")


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """Raise ``ValueError`` unless the caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` and equal."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache and value_cache must be [num_blocks, block_size, num_kv_heads, head_dim] of "
                         f"equal shape, got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache and value_cache dtypes differ: {key_cache.dtype} vs {value_cache.dtype}")
    if tuple(key_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"cache is [.., .., {key_cache.shape[2]}, {key_cache.shape[3]}] but the new K/V have "
                         f"num_kv_heads={num_kv_heads}, head_dim={head_dim}")


def on_same_device(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the tensors if they live on different devices."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
