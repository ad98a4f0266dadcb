"""One Triton kernel for prefill, chunked prefill and decode over a paged KV cache (vLLM's "unified attention").

Request ``i`` owns query rows ``query_start_loc[i] : query_start_loc[i+1]`` and attends to ``seq_lens[i]`` keys
through row ``i`` of ``block_table``, causal with offset ``seq_len - query_len``; a decode is ``query_len = 1``. The
grid: axis 0, query blocks of ``BLOCK_Q`` tokens, each finding its request by binary search over
``query_start_loc``; axis 1, KV heads, each K/V tile loaded once for all ``num_queries_per_kv`` query heads stacked
as ``BLOCK_M`` rows; axis 2, KV segments (split-KV) for decode batches too small to fill a GPU, merged by a second
kernel. Inside a program: online softmax over tiles of ``TILE_SIZE`` keys.

vLLM counterpart: ``vllm/v1/attention/ops/triton_unified_attention.py`` (``unified_attention``,
``reduce_segments``, ``kernel_unified_attention``); vLLM takes ``BLOCK_M = 16`` rows where this kernel takes taller
tiles for a prefill (:func:`choose_config`), and adds sliding windows, ALiBi, soft-capping, sinks and fp8 caches.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._checks import check_cache, check_dtype, on_same_device

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is the GPU's native instruction


@triton.jit
def find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    """The request whose query blocks contain global block ``q_block_global``: the last ``i`` with
    ``query_start_loc[i] // BLOCK_Q + i <= q_block_global`` (binary search; ``query_start_loc`` is sorted)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    out_ptr,                          # [num_tokens, num_heads, head_dim]
    q_ptr,                            # [num_tokens, num_heads, head_dim]
    key_cache_ptr, value_cache_ptr,   # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,                  # [num_seqs, max_num_blocks_per_seq]
    seq_lens_ptr,                     # [num_seqs]
    query_start_loc_ptr,              # [num_seqs + 1]
    part_acc_ptr,                     # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PADDED] fp32 (split-KV only)
    part_max_ptr, part_sum_ptr,       # [num_tokens, num_heads, NUM_SEGMENTS] fp32 (split-KV only)
    qk_scale,                         # softmax scale * log2(e)
    num_seqs, num_heads,
    stride_q_tok, stride_q_head, stride_q_dim,
    stride_o_tok, stride_o_head, stride_o_dim,
    stride_kc_blk, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_blk, stride_vc_slot, stride_vc_head, stride_vc_dim,
    stride_bt_seq,
    NUM_QUERIES_PER_KV: tl.constexpr,  # query heads per KV head (GQA group size)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,     # power of two >= 16
    BLOCK_SIZE: tl.constexpr,          # tokens per cache block
    BLOCK_Q: tl.constexpr,             # query tokens per program: BLOCK_M // NUM_QUERIES_PER_KV (rounded down)
    BLOCK_M: tl.constexpr,             # rows of the query tile: power of two >= 16 and >= NUM_QUERIES_PER_KV
    TILE_SIZE: tl.constexpr,           # keys per iteration, power of two >= 16
    NUM_SEGMENTS: tl.constexpr,        # 1: write the output; > 1: write partial results for the reduce kernel
    DOT_PRECISION: tl.constexpr,       # "ieee" for fp32 inputs (no TF32 rounding on a GPU)
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    # --- which request and which of its query tokens this program owns ---------------------------------------
    seq = find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= query_len:
        return  # a spare program: the numbering leaves up to one per request
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # --- the query tile: BLOCK_Q tokens x the NUM_QUERIES_PER_KV heads that share this KV head -----------------
    m = tl.arange(0, BLOCK_M)
    q_pos = q_block * BLOCK_Q + m // NUM_QUERIES_PER_KV          # position inside the chunk
    head = kv_head * NUM_QUERIES_PER_KV + m % NUM_QUERIES_PER_KV
    row_ok = (m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_pos < query_len)
    q_abs = context_len + q_pos                                  # absolute position: the causal limit of the row
    tok = (q_start + q_pos).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PADDED)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :] * stride_q_dim,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # --- the KV range: keys up to the last one any row of this tile may see, cut into segments ----------------
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    num_tiles = (kv_end + TILE_SIZE - 1) // TILE_SIZE
    tiles_per_segment = (num_tiles + NUM_SEGMENTS - 1) // NUM_SEGMENTS
    tile_lo = segment * tiles_per_segment
    tile_hi = tl.minimum(num_tiles, tile_lo + tiles_per_segment)

    # Running max (in log2 units), running sum of exponentials, unnormalised output: the online softmax state.
    run_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    # Loop-invariant parts of the addresses, computed once.
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = key_cache_ptr + kv_head * stride_kc_head + d[:, None] * stride_kc_dim      # [HEAD_DIM_PADDED, 1]
    v_base = value_cache_ptr + kv_head * stride_vc_head + d[None, :] * stride_vc_dim    # [1, HEAD_DIM_PADDED]
    j_in_tile = tl.arange(0, TILE_SIZE)
    for t in range(tile_lo, tile_hi):
        j = t * TILE_SIZE + j_in_tile                            # absolute key positions of this tile
        j_ok = j < kv_end
        # The paged lookup: logical block j // BLOCK_SIZE of this request -> physical block, row j % BLOCK_SIZE.
        blk = tl.load(block_table_row + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
        slot = j % BLOCK_SIZE
        k_t = tl.load(k_base + (blk * stride_kc_blk + slot * stride_kc_slot)[None, :],     # [HEAD_DIM_PADDED, TILE]
                      mask=j_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + (blk * stride_vc_blk + slot * stride_vc_slot)[:, None],       # [TILE, HEAD_DIM_PADDED]
                    mask=j_ok[:, None] & d_ok[None, :], other=0.0)

        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale                   # [BLOCK_M, TILE], fp32
        visible = (j[None, :] <= q_abs[:, None]) & j_ok[None, :]
        s = tl.where(visible, s, float("-inf"))

        new_max = tl.maximum(run_max, tl.max(s, axis=1))
        # A row that has seen no key yet keeps max -inf; subtract 0 instead so exp2 gives 0, not NaN.
        safe_max = tl.where(new_max > float("-inf"), new_max, 0.0)
        p = tl.exp2(s - safe_max[:, None])
        correction = tl.exp2(run_max - safe_max)                 # rescales what was summed under the old max
        run_sum = run_sum * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        run_max = new_max

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(run_sum > 0.0, run_sum, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :] * stride_o_dim,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Unnormalised partial result of this segment; an empty segment writes max -inf, sum 0, acc 0.
        part = (tok * num_heads + head) * NUM_SEGMENTS + segment                       # [BLOCK_M]
        tl.store(part_max_ptr + part, run_max, mask=row_ok)
        tl.store(part_sum_ptr + part, run_sum, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PADDED + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _reduce_segments_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    num_heads,
    stride_o_tok, stride_o_head, stride_o_dim,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, SEGMENTS_PADDED: tl.constexpr,
):
    # One program per (token, query head): merge the segments' partial softmax states, then normalise once.
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SEGMENTS_PADDED)
    s_ok = s < NUM_SEGMENTS
    d = tl.arange(0, HEAD_DIM_PADDED)
    part = (tok * num_heads + head) * NUM_SEGMENTS + s
    seg_max = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    seg_sum = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
    top = tl.max(seg_max, axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)
    weight = tl.exp2(seg_max - top)                              # each segment rescaled to the common max
    total = tl.sum(seg_sum * weight, axis=0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PADDED + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + d * stride_o_dim,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes and launch options of one ``unified_attention`` call (chosen by hand: no autotune on a CPU)."""

    block_m: int
    block_q: int
    tile_size: int
    num_segments: int
    num_warps: int
    num_stages: int


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_config(q: torch.Tensor, num_seqs: int, num_kv_heads: int, block_size: int, max_query_len: int,
                  max_seq_len: int, block_m: int | None = None, tile_size: int | None = None,
                  num_kv_splits: int | None = None) -> LaunchConfig:
    """Pick the tile shapes for a batch; any argument given explicitly wins (tests use small ones).

    On a GPU: a prefill-heavy batch gets tall query tiles (128 rows) so each K/V tile is reused by many queries;
    a decode-only batch gets 16-row tiles (a decode has only ``num_queries_per_kv`` useful rows) and, when there are
    too few requests to fill the GPU, split-KV segments. In the interpreter every program costs Python time, so
    tiles stay moderate and split-KV is off unless asked for.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    on_gpu = q.device.type == "cuda"
    decode_only = max_query_len <= 1
    # fp32 runs on a GPU only as a correctness path: its exact ("ieee") dot has no tensor cores and needs many
    # registers, so it gets small tiles. Register and shared-memory use of these choices was checked by compiling
    # for sm_80 and sm_90 without a GPU (python -m kernels.compile_check).
    gpu_fp32 = on_gpu and q.dtype == torch.float32
    if block_m is None:
        if decode_only:
            block_m = 16
        elif on_gpu:
            block_m = 32 if gpu_fp32 else 128
        else:
            block_m = 64  # the interpreter pays per program and per operation, hardly per element
        block_m = max(block_m, triton.next_power_of_2(group))
    if block_m < 16 or block_m & (block_m - 1) or block_m < group:
        raise ValueError(f"block_m must be a power of two >= 16 and >= num_queries_per_kv ({group}), got {block_m}")
    block_q = block_m // group
    if tile_size is None:
        tile_size = 32 if gpu_fp32 else 64
    if tile_size < 16 or tile_size & (tile_size - 1):
        raise ValueError(f"tile_size must be a power of two >= 16, got {tile_size}")
    max_tiles = max(1, triton.cdiv(max_seq_len, tile_size))
    if num_kv_splits is None:
        num_kv_splits = 1
        if on_gpu and decode_only:
            programs = num_seqs * num_kv_heads
            target = 2 * _num_sms(q.device)  # about two waves of programs
            if programs < target:
                num_kv_splits = min(16, triton.next_power_of_2(triton.cdiv(target, programs)))
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    num_kv_splits = min(num_kv_splits, max_tiles)  # no segment without at least one tile
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    num_warps = 8 if block_m >= 128 else 4
    num_stages = 2 if head_dim_padded >= 128 else 3
    return LaunchConfig(block_m, block_q, tile_size, num_kv_splits, num_warps, num_stages)


def check_batch_values(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       num_tokens: int, max_seq_len: int, block_size: int, num_blocks: int) -> None:
    """Raise ``ValueError`` unless the batch's index tensors describe a batch the kernel can run safely.

    Checked: ``query_start_loc`` (``[num_seqs + 1]``) starts at 0, never decreases and ends at ``num_tokens``;
    ``0 <= query_len <= seq_len`` for every request (``seq_lens`` ``[num_seqs]``); ``max(seq_lens) <= max_seq_len``
    (the block table's width was checked against ``max_seq_len``, so every request then has enough columns); and
    the block ids a request reads, the first ``ceil(seq_len / block_size)`` entries of its ``block_table`` row
    (``[num_seqs, max_num_blocks]``), lie in ``[0, num_blocks)``. Unused entries past those may hold anything.
    """
    # vLLM trusts its scheduler and checks none of this. In a teaching kernel bad indices should be an error, not
    # an out-of-bounds read (a crashed interpreter or GPU context, or silent garbage). Cost: one small copy per
    # tensor (a sync on a GPU) and a dozen vectorized ops; only a failure pays for finding the first bad entry.
    qsl = query_start_loc.to("cpu", torch.int64)
    sl = seq_lens.to("cpu", torch.int64)
    bt = block_table.cpu()
    query_lens = qsl.diff()
    if sl.numel() == 0:
        if qsl[0] != 0 or num_tokens != 0:
            raise ValueError(f"query_start_loc of an empty batch must be [0] with num_tokens = 0, got "
                             f"{qsl.tolist()} and num_tokens = {num_tokens}")
        return
    # Key position j lives in column j // block_size, so a request reads the columns c with c * block_size < seq_len.
    reads = torch.arange(bt.shape[1]) * block_size < sl[:, None]                       # [num_seqs, max_blocks]
    bad_block = reads & ((bt < 0) | (bt >= num_blocks))
    first, min_query_len, last, max_excess, max_len, any_bad_block = torch.stack(
        [qsl[0], query_lens.min(), qsl[-1], (query_lens - sl).max(), sl.max(), bad_block.any()]).tolist()
    if first != 0:
        raise ValueError(f"query_start_loc must start at 0, got query_start_loc[0] = {first}")
    if min_query_len < 0:
        i = int((query_lens < 0).nonzero()[0])
        raise ValueError(f"query_start_loc must be non-decreasing, got query_start_loc[{i}] = {int(qsl[i])} > "
                         f"query_start_loc[{i + 1}] = {int(qsl[i + 1])}")
    if last != num_tokens:
        raise ValueError(f"query_start_loc must end at num_tokens = {num_tokens} (the rows of q), got "
                         f"query_start_loc[-1] = {last}")
    if max_excess > 0:
        i = int((query_lens > sl).nonzero()[0])
        raise ValueError(f"request {i} has query_len {int(query_lens[i])} > seq_lens[{i}] = {int(sl[i])}; need "
                         f"0 <= query_len <= seq_len (seq_len counts the context and the new tokens)")
    if max_len > max_seq_len:
        i = int(sl.argmax())
        raise ValueError(f"seq_lens[{i}] = {max_len} exceeds the max_seq_len = {max_seq_len} given; "
                         f"max_seq_len must be at least max(seq_lens)")
    if any_bad_block:
        i, j = bad_block.nonzero()[0].tolist()
        raise ValueError(f"block_table[{i}, {j}] = {int(bt[i, j])} is not a cache block: request {i} reads the "
                         f"first {-(-int(sl[i]) // block_size)} entries of its row, each must be in [0, num_blocks = "
                         f"{num_blocks})")


def unified_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    tile_size: int | None = None,
    num_kv_splits: int | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Attention of a varlen batch of query chunks over their paged K/V history (causal with offset, GQA).

    The chunk's own K/V must already be in the cache (write it first with :func:`kernels.reshape_and_cache`).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, queries of all requests, concatenated.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype as ``q``.
        query_start_loc: ``[num_seqs + 1]`` int32/int64, cumulative query lengths starting at 0.
        seq_lens: ``[num_seqs]``, history length of each request (context + this chunk).
        block_table: ``[num_seqs, max_num_blocks_per_seq]``, physical block ids of each request.
        max_query_len: largest query length in the batch (picks the tile shape; 1 means a decode-only batch).
        max_seq_len: at least the largest ``seq_lens`` entry.
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        out: optional ``[num_tokens, num_heads, head_dim]`` tensor to write into.
        block_m, tile_size, num_kv_splits: override the launch configuration (see :func:`choose_config`).
        check_values: run :func:`check_batch_values` (on a GPU it copies the index tensors to the host: a sync).
            A caller that checked this step's metadata once for all layers passes ``False``, as
            :class:`~minillm.attention.paged.PagedAttention` does; shapes, dtypes and devices are checked anyway.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype`` (softmax accumulated in fp32).

    Raises:
        ValueError: on mismatched shapes, dtypes or devices, or index values that would read outside a tensor
            (see :func:`check_batch_values`).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(key_cache.shape)}")
    num_kv_heads = key_cache.shape[2]
    check_cache(key_cache, value_cache, num_kv_heads, head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    check_dtype("q", q)
    if key_cache.dtype != q.dtype:
        raise ValueError(f"q ({q.dtype}) and the KV cache ({key_cache.dtype}) must have the same dtype")
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"need seq_lens [num_seqs] and query_start_loc [num_seqs + 1], got {tuple(seq_lens.shape)} "
                         f"and {tuple(query_start_loc.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table must be [num_seqs={num_seqs}, max_num_blocks], got {tuple(block_table.shape)}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    block_size = key_cache.shape[1]
    if block_table.shape[1] * block_size < max_seq_len:
        raise ValueError(f"block_table has {block_table.shape[1]} blocks of {block_size} tokens per request, too few "
                         f"for max_seq_len={max_seq_len}")
    if max_query_len < 0 or max_seq_len < max_query_len:
        raise ValueError(f"need 0 <= max_query_len <= max_seq_len, got {max_query_len} and {max_seq_len}")
    on_same_device(q=q, key_cache=key_cache, value_cache=value_cache, query_start_loc=query_start_loc,
                   seq_lens=seq_lens, block_table=block_table)
    if check_values:
        check_batch_values(query_start_loc, seq_lens, block_table, num_tokens, max_seq_len, block_size,
                           key_cache.shape[0])
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} on {q.device}, got {tuple(out.shape)} on {out.device}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    cfg = choose_config(q, num_seqs, num_kv_heads, block_size, max_query_len, max_seq_len,
                        block_m, tile_size, num_kv_splits)
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    if cfg.num_segments > 1:
        part_acc = torch.empty(num_tokens, num_heads, cfg.num_segments, head_dim_padded, dtype=torch.float32,
                               device=q.device)
        part_max = torch.empty(num_tokens, num_heads, cfg.num_segments, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:  # never touched by the kernel; any tensor will do as a pointer
        part_acc = part_max = part_sum = out
    # Request i's query blocks are numbered from query_start_loc[i] // BLOCK_Q + i, so this many cover all of them.
    grid = (num_tokens // cfg.block_q + num_seqs, num_kv_heads, cfg.num_segments)
    _unified_attention_kernel[grid](
        out, q, key_cache, value_cache, block_table, seq_lens, query_start_loc, part_acc, part_max, part_sum,
        scale * LOG2E, num_seqs, num_heads,
        *q.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), block_table.stride(0),
        NUM_QUERIES_PER_KV=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=block_size, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, TILE_SIZE=cfg.tile_size,
        NUM_SEGMENTS=cfg.num_segments, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.num_segments > 1:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, num_heads, *out.stride(),
            HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded,
            NUM_SEGMENTS=cfg.num_segments, SEGMENTS_PADDED=max(2, triton.next_power_of_2(cfg.num_segments)),
        )
    return out


@dataclass(frozen=True)
class ProgramWork:
    """What one ``(query block, KV head)`` program of :func:`unified_attention` does (split-KV off)."""

    program: int          # index on grid axis 0
    seq: int              # request it serves
    q_block: int          # its query block inside the request
    tokens: range         # rows of the flat batch it computes
    kv_end: int           # it reads key positions 0 .. kv_end-1
    blocks: list[int]     # physical cache blocks it reads, in order


def describe_programs(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      block_size: int, block_q: int) -> list[ProgramWork]:
    """The host-side mirror of the kernel's index arithmetic: for every non-spare program on grid axis 0, which
    request, tokens and cache blocks it touches. For pictures and tests; the kernel never calls it."""
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    num_seqs = len(sl)
    work = []
    for program in range(qsl[-1] // block_q + num_seqs):
        seq = max(i for i in range(num_seqs) if qsl[i] // block_q + i <= program)  # what find_seq_idx returns
        query_len = qsl[seq + 1] - qsl[seq]
        q_block = program - (qsl[seq] // block_q + seq)
        if q_block * block_q >= query_len:
            continue
        context_len = sl[seq] - query_len
        kv_end = min(sl[seq], context_len + (q_block + 1) * block_q)
        first = qsl[seq] + q_block * block_q
        tokens = range(first, min(first + block_q, qsl[seq + 1]))
        blocks = block_table[seq, : -(-kv_end // block_size)].tolist()
        work.append(ProgramWork(program, seq, q_block, tokens, kv_end, blocks))
    return work
