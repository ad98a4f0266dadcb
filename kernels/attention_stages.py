"""The paged attention kernel built up in stages, each one a complete, tested Triton kernel.

0. :func:`online_softmax_step` / :func:`online_softmax_attention`: the online-softmax recurrence in PyTorch.
1. :func:`attention_contiguous`: one sequence, contiguous K/V, a query chunk causal with an offset, KV tiles.
2. :func:`attention_paged_one_seq`: the same through one block-table row (:func:`kv_row_offsets` is the lookup).
3. :func:`attention_varlen`: a batch of requests, a 3-D grid ``(request, query block, head)``.
4. (``kernels.unified_attention``) GQA, a flat grid found by binary search, split-KV for decodes.

Stages 1-3 keep ``num_heads == num_kv_heads``, ``head_dim`` a power of two >= 16 and ``tl.exp``.

vLLM counterpart: stage 4's, ``vllm/v1/attention/ops/triton_unified_attention.py`` (``unified_attention``).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


def _check_simple(q: torch.Tensor, head_dim: int, block_m: int, tile_size: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the stage kernels need head_dim a power of two >= 16, got {head_dim}")
    if q.stride(2) != 1:
        raise ValueError("the stage kernels need the head_dim axis contiguous (stride 1)")
    for name, b in (("block_m", block_m), ("tile_size", tile_size)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot needs it on a GPU), got {b}")
    if q.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"the stage kernels take float32 or float16, got {q.dtype}")


# ------------------------------------------------------------------------------------------------------------------
# Stage 0: the recurrence in PyTorch
# ------------------------------------------------------------------------------------------------------------------
def online_softmax_step(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, s: torch.Tensor, v: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one tile of scores into the running softmax state.

    Args:
        m: ``[n]`` running max of the scores seen so far (``-inf`` before any).
        l: ``[n]`` running sum of ``exp(score - m)``.
        acc: ``[n, d]`` running sum of ``exp(score - m) * v``.
        s: ``[n, t]`` this tile's scores (``-inf`` where masked).
        v: ``[t, d]`` this tile's values.

    Returns:
        The new ``(m, l, acc)``; after the last tile, ``acc / l[:, None]`` is softmax(scores) @ values.
    """
    m_new = torch.maximum(m, s.max(dim=1).values)
    # A row whose scores so far are all masked keeps m = -inf; measure from 0 then, so exp gives 0, not NaN.
    ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - ref)                   # rescales the old sums to the new max
    p = torch.exp(s - ref[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v


def online_softmax_attention(s: torch.Tensor, v: torch.Tensor, tile: int) -> torch.Tensor:
    """``softmax(s, dim=1) @ v`` computed ``tile`` columns at a time with :func:`online_softmax_step`.

    ``s`` ``[n, N]`` scores, ``v`` ``[N, d]``; returns ``[n, d]`` (rows with every score masked give 0).
    """
    n, d = s.shape[0], v.shape[1]
    m = torch.full((n,), float("-inf"), dtype=s.dtype)
    l = torch.zeros(n, dtype=s.dtype)
    acc = torch.zeros(n, d, dtype=s.dtype)
    for start in range(0, s.shape[1], tile):
        m, l, acc = online_softmax_step(m, l, acc, s[:, start:start + tile], v[start:start + tile])
    return acc / torch.where(l > 0, l, torch.ones_like(l))[:, None]


# ------------------------------------------------------------------------------------------------------------------
# Stage 1: one sequence, contiguous K/V
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def _contiguous_kernel(out_ptr, q_ptr, k_ptr, v_ptr, scale, num_q, num_k,
                       stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                       stride_v_tok, stride_v_head, stride_o_tok, stride_o_head,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, TILE_SIZE: tl.constexpr):
    q_block = tl.program_id(0)
    head = tl.program_id(1)
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)            # query index inside the chunk
    row_ok = rows < num_q
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                mask=row_ok[:, None], other=0.0)                 # [BLOCK_M, HEAD_DIM]
    ctx_len = num_k - num_q
    q_abs = ctx_len + rows                                       # absolute positions: query i sees keys <= q_abs[i]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)      # running sum of exp(score - m_i) * v
    kv_end = tl.minimum(num_k, ctx_len + (q_block + 1) * BLOCK_M)  # no row of this block sees further
    for start in range(0, kv_end, TILE_SIZE):
        j = start + tl.arange(0, TILE_SIZE)                      # key positions of this tile
        j_ok = j < kv_end
        k = tl.load(k_ptr + j[None, :] * stride_k_tok + head * stride_k_head + d[:, None],
                    mask=j_ok[None, :], other=0.0)               # [HEAD_DIM, TILE_SIZE]: K transposed
        v = tl.load(v_ptr + j[:, None] * stride_v_tok + head * stride_v_head + d[None, :],
                    mask=j_ok[:, None], other=0.0)               # [TILE_SIZE, HEAD_DIM]
        s = tl.dot(q, k, input_precision="ieee") * scale         # [BLOCK_M, TILE_SIZE]
        s = tl.where((j[None, :] <= q_abs[:, None]) & j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)                              # rescale what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]                                     # every row saw key 0, so l_i > 0
    tl.store(out_ptr + rows[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def attention_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                         block_m: int = 16, tile_size: int = 16) -> torch.Tensor:
    """Stage 1. ``q`` ``[num_q, num_heads, head_dim]`` over ``k, v`` ``[num_k, num_heads, head_dim]``, the chunk
    being the last ``num_q`` positions. Returns ``[num_q, num_heads, head_dim]``. Grid: (query blocks, heads)."""
    num_q, num_heads, head_dim = q.shape
    if k.shape != v.shape or k.shape[1:] != q.shape[1:] or k.shape[0] < num_q:
        raise ValueError(f"need k, v [num_k >= num_q, {num_heads}, {head_dim}], got {tuple(k.shape)}, {tuple(v.shape)}")
    _check_simple(q, head_dim, block_m, tile_size)
    k, v = k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grid = (triton.cdiv(num_q, block_m), num_heads)
    _contiguous_kernel[grid](out, q, k, v, scale, num_q, k.shape[0], q.stride(0), q.stride(1), k.stride(0),
                             k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                             HEAD_DIM=head_dim, BLOCK_M=block_m, TILE_SIZE=tile_size)
    return out


# ------------------------------------------------------------------------------------------------------------------
# Stage 2: one sequence, paged K/V
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def kv_row_offsets(block_ids_ptr, j, j_ok, BLOCK_SIZE: tl.constexpr, stride_blk, stride_slot):
    """Element offset of the cache row holding key position ``j`` (a block of positions), for one request.

    Position ``j`` is in logical block ``j // BLOCK_SIZE`` of the request, which the block table maps to a physical
    block; inside it the row is ``j % BLOCK_SIZE``. Masked positions read block 0 (never used).
    """
    blk = tl.load(block_ids_ptr + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
    return blk * stride_blk + (j % BLOCK_SIZE) * stride_slot


@triton.jit
def _paged_one_seq_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_ids_ptr, scale, num_q, seq_len,
                          stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                          stride_c_blk, stride_c_slot, stride_c_head,
                          HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_M: tl.constexpr, TILE_SIZE: tl.constexpr):
    q_block = tl.program_id(0)
    head = tl.program_id(1)
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_q
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                mask=row_ok[:, None], other=0.0)
    ctx_len = seq_len - num_q
    q_abs = ctx_len + rows

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_M)
    for start in range(0, kv_end, TILE_SIZE):
        j = start + tl.arange(0, TILE_SIZE)
        j_ok = j < kv_end
        row = kv_row_offsets(block_ids_ptr, j, j_ok, BLOCK_SIZE, stride_c_blk, stride_c_slot)  # the only change
        k = tl.load(k_cache_ptr + row[None, :] + head * stride_c_head + d[:, None], mask=j_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + head * stride_c_head + d[None, :], mask=j_ok[:, None], other=0.0)
        s = tl.dot(q, k, input_precision="ieee") * scale
        s = tl.where((j[None, :] <= q_abs[:, None]) & j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    tl.store(out_ptr + rows[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
             (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _check_paged(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.shape != value_cache.shape or key_cache.dim() != 4:
        raise ValueError(f"caches must be [num_blocks, block_size, num_heads, head_dim] of equal shape, got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.shape[2:] != q.shape[1:]:
        raise ValueError(f"the stage kernels need num_kv_heads == num_heads: cache {tuple(key_cache.shape)}, "
                         f"q {tuple(q.shape)} (stage 4, kernels.unified_attention, adds GQA)")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()) or key_cache.dtype != q.dtype:
        raise ValueError("the stage kernels need contiguous caches of q's dtype")


def attention_paged_one_seq(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_ids: torch.Tensor, seq_len: int, scale: float | None = None,
                            block_m: int = 16, tile_size: int = 16) -> torch.Tensor:
    """Stage 2. One request's chunk ``q`` ``[num_q, num_heads, head_dim]`` over its first ``seq_len`` cached tokens,
    found through ``block_ids`` ``[max_blocks]`` (its row of the block table) in caches ``[num_blocks, block_size,
    num_heads, head_dim]``. Returns ``[num_q, num_heads, head_dim]``."""
    num_q, num_heads, head_dim = q.shape
    _check_simple(q, head_dim, block_m, tile_size)
    _check_paged(q, key_cache, value_cache)
    block_size = key_cache.shape[1]
    if not num_q <= seq_len <= block_ids.shape[0] * block_size:
        raise ValueError(f"need num_q ({num_q}) <= seq_len ({seq_len}) <= {block_ids.shape[0]} blocks * {block_size}")
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grid = (triton.cdiv(num_q, block_m), num_heads)
    _paged_one_seq_kernel[grid](out, q, key_cache, value_cache, block_ids, scale, num_q, seq_len,
                                q.stride(0), q.stride(1), out.stride(0), out.stride(1), *key_cache.stride()[:3],
                                HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, TILE_SIZE=tile_size)
    return out


# ------------------------------------------------------------------------------------------------------------------
# Stage 3: a varlen batch, each request with its own chunk, context and block-table row
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def _varlen_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
                   scale, stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                   stride_c_blk, stride_c_slot, stride_c_head, stride_bt_seq,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_SIZE: tl.constexpr):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_q = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_M >= num_q:
        return                                                   # this request's chunk is shorter than the grid
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - num_q
    block_ids_ptr = block_table_ptr + seq * stride_bt_seq

    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_q
    tok = q_start + rows                                         # row of the flat [num_tokens, ...] q and out
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                mask=row_ok[:, None], other=0.0)
    q_abs = ctx_len + rows

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_M)
    for start in range(0, kv_end, TILE_SIZE):
        j = start + tl.arange(0, TILE_SIZE)
        j_ok = j < kv_end
        row = kv_row_offsets(block_ids_ptr, j, j_ok, BLOCK_SIZE, stride_c_blk, stride_c_slot)
        k = tl.load(k_cache_ptr + row[None, :] + head * stride_c_head + d[:, None], mask=j_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + head * stride_c_head + d[None, :], mask=j_ok[:, None], other=0.0)
        s = tl.dot(q, k, input_precision="ieee") * scale
        s = tl.where((j[None, :] <= q_abs[:, None]) & j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    tl.store(out_ptr + tok[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
             (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def attention_varlen(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                     max_query_len: int, scale: float | None = None, block_m: int = 16,
                     tile_size: int = 16) -> torch.Tensor:
    """Stage 3. The arguments of ``kernels.unified_attention`` (without GQA). Grid: ``(num_seqs,
    cdiv(max_query_len, block_m), num_heads)``. Returns ``[num_tokens, num_heads, head_dim]``."""
    num_tokens, num_heads, head_dim = q.shape
    _check_simple(q, head_dim, block_m, tile_size)
    _check_paged(q, key_cache, value_cache)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grid = (seq_lens.shape[0], triton.cdiv(max_query_len, block_m), num_heads)
    _varlen_kernel[grid](out, q, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
                         q.stride(0), q.stride(1), out.stride(0), out.stride(1), *key_cache.stride()[:3],
                         block_table.stride(0), HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1],
                         BLOCK_M=block_m, TILE_SIZE=tile_size)
    return out
