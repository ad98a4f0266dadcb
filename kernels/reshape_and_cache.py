"""Write a step's new K/V into the paged KV cache at ``slot_mapping`` (one Triton kernel for K and V together).

Before a layer attends, the keys and values of the tokens computed in this step must be in the cache, because
the attention kernel reads *all* history, this step's tokens included, through the block table. Token ``t`` of
the batch goes to slot ``s = slot_mapping[t]``, i.e. block ``s // block_size``, row ``s % block_size``. A negative
slot marks a padding token (e.g. a batch padded for a CUDA graph): nothing is written for it.

vLLM counterpart: ``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py`` (``triton_reshape_and_cache_flash``)
and the CUDA op ``reshape_and_cache_flash`` in ``csrc/cache_kernels.cu``. vLLM adds fp8 caches with per-tensor
scales and other cache layouts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_cache, check_dtype, on_same_device


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr,              # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,                # [num_tokens] int64
    num_tokens,
    stride_k_tok, stride_k_head, stride_k_dim,
    stride_v_tok, stride_v_head, stride_v_dim,
    stride_kc_blk, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_blk, stride_vc_slot, stride_vc_head, stride_vc_dim,
    HEAD_DIM: tl.constexpr,      # real head dim
    ROW: tl.constexpr,           # num_kv_heads * head_dim: the elements of one token
    ROW_PADDED: tl.constexpr,    # ROW rounded up to a power of two (Triton blocks are powers of two)
    BLOCK_T: tl.constexpr,       # tokens per program
    BLOCK_SIZE: tl.constexpr,    # cache block size (tokens per block)
):
    # One program copies BLOCK_T tokens. A token's row of num_kv_heads * head_dim elements is handled as one flat
    # vector e = head * HEAD_DIM + dim, so any head count and head dim work without two padded axes.
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)          # [BLOCK_T]
    e = tl.arange(0, ROW_PADDED)                                     # [ROW_PADDED]
    head = e // HEAD_DIM
    dim = e % HEAD_DIM

    tok_ok = tok < num_tokens
    slot = tl.load(slot_mapping_ptr + tok, mask=tok_ok, other=-1).to(tl.int64)
    write = tok_ok & (slot >= 0)                                      # padding slots (< 0) are skipped
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    mask = write[:, None] & (e < ROW)[None, :]

    src_k = (key_ptr + tok[:, None].to(tl.int64) * stride_k_tok + head[None, :] * stride_k_head
             + dim[None, :] * stride_k_dim)
    src_v = (value_ptr + tok[:, None].to(tl.int64) * stride_v_tok + head[None, :] * stride_v_head
             + dim[None, :] * stride_v_dim)
    dst_k = (key_cache_ptr + block[:, None] * stride_kc_blk + row[:, None] * stride_kc_slot
             + head[None, :] * stride_kc_head + dim[None, :] * stride_kc_dim)
    dst_v = (value_cache_ptr + block[:, None] * stride_vc_blk + row[:, None] * stride_vc_slot
             + head[None, :] * stride_vc_head + dim[None, :] * stride_vc_dim)
    k = tl.load(src_k, mask=mask, other=0.0)
    v = tl.load(src_v, mask=mask, other=0.0)
    # The cache may have another dtype than the activations (e.g. fp32 activations, fp16 cache): cast on store.
    tl.store(dst_k, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def check_slot_values(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Raise ``ValueError`` if a slot of ``slot_mapping`` (``[num_tokens]``) lies beyond a cache of ``num_blocks``
    blocks of ``block_size`` slots (negative slots are padding and allowed)."""
    # vLLM trusts its scheduler and checks none of this; in a teaching kernel a slot beyond the cache should be an
    # error, not a write outside it (a crashed interpreter or GPU context). One small copy (a sync on a GPU).
    if slot_mapping.numel() == 0:
        return
    slots = slot_mapping.cpu()
    t = int(slots.argmax())
    if slots[t] >= num_blocks * block_size:
        raise ValueError(f"slot_mapping[{t}] = {int(slots[t])}, but the cache holds only {num_blocks * block_size} "
                         f"slots ({num_blocks} blocks of {block_size}): slots must be < {num_blocks * block_size}, "
                         f"or negative for padding")


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, *, check_values: bool = True) -> None:
    """Scatter ``key``/``value`` rows into the paged caches, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, this step's new K/V (any strides).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: ``[num_tokens]`` integer; token ``t`` goes to block ``slot // block_size``, row
            ``slot % block_size``. Slots ``< 0`` are padding and are skipped.
        check_values: check that no slot lies beyond the cache (:func:`check_slot_values`; on a GPU a sync). A
            caller that checked this step's ``slot_mapping`` once for all layers passes ``False``.

    Raises:
        ValueError: on mismatched shapes, dtypes or devices, or a slot beyond the cache.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must be [num_tokens, num_kv_heads, head_dim] of equal shape, got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    check_cache(key_cache, value_cache, num_kv_heads, head_dim)
    check_dtype("key", key)
    check_dtype("key_cache", key_cache)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must be [num_tokens={num_tokens}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    on_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    num_blocks, block_size = key_cache.shape[:2]
    if check_values:
        check_slot_values(slot_mapping, num_blocks, block_size)

    row = num_kv_heads * head_dim
    block_t = 16 if key.device.type == "cpu" else 4  # fewer, larger programs are what the interpreter likes
    grid = (triton.cdiv(num_tokens, block_t),)
    _reshape_and_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, num_tokens,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        HEAD_DIM=head_dim, ROW=row, ROW_PADDED=triton.next_power_of_2(row), BLOCK_T=block_t, BLOCK_SIZE=block_size,
    )
