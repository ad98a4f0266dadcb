"""Model Runner V2's block-table kernels: the step's block table and its slot mapping, gathered from per-slot rows.

The block table is kept per *slot*, ``[max_num_reqs, max_num_blocks]`` int32, a row per request for as long as it
lives; a step's batch row ``b`` is slot ``idx_mapping[b]``. Attention wants the table in batch order, and the KV
write wants one cache slot per token (block ``block_table[s, p // block_size]``, offset ``p % block_size``), so each
step gathers both. Every function has a Triton kernel (``_<name>_kernel``, one program per batch row, as vLLM), a
vectorised PyTorch reference (``<name>_ref``, what the engine runs on a CPU) and a public ``<name>`` that picks the
kernel for CUDA tensors (or ``use_triton=True``: the tests run it in Triton's interpreter) and the reference
otherwise. ``query_start_loc[0] == 0`` throughout; values are not checked (a check would sync the GPU every step).

vLLM counterpart: ``vllm/v1/worker/gpu/block_table.py`` (``BlockTables``: ``gather_block_tables``,
``compute_slot_mappings``), here for one KV-cache group, without context parallelism or sliding-window masking.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.input_batch import _pick_triton

# Entries one program handles per loop iteration: a row or a query of any length is walked in chunks of this many.
_BLOCK = 1024


# ----------------------------------------------------------------------------------------------------------------
# gather_block_tables
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _gather_block_tables_kernel(
    idx_mapping_ptr,   # [num_reqs] int64
    block_table_ptr,   # [max_num_reqs, max_blocks] int32, per slot
    block_table_stride,
    num_blocks_ptr,    # [max_num_reqs] int32
    out_ptr,           # [>= num_reqs, max_blocks] int32, written
    out_stride,
    max_blocks,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + b)
    num_blocks = tl.load(num_blocks_ptr + slot)
    src = block_table_ptr + slot * block_table_stride
    dst = out_ptr + b.to(tl.int64) * out_stride
    # The whole row is written: past the request's blocks, the null block 0, not what a previous step left there.
    for i in range(0, max_blocks, BLOCK):
        j = i + tl.arange(0, BLOCK)
        blocks = tl.load(src + j, mask=j < num_blocks, other=0)
        tl.store(dst + j, blocks, mask=j < max_blocks)


def gather_block_tables_ref(idx_mapping: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor,
                            out: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`gather_block_tables` (same arguments, same result)."""
    num_reqs = idx_mapping.shape[0]
    rows = out[:num_reqs]
    torch.index_select(block_table, 0, idx_mapping, out=rows)
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    rows.masked_fill_(cols >= num_blocks[idx_mapping].unsqueeze(1), 0)
    return rows


def gather_block_tables(idx_mapping: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor,
                        out: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """Gather the batch's block-table rows, in batch order, into ``out``.

    ``out[b] = block_table[s, :num_blocks[s]]`` followed by 0s (the null block) to the end of the row, for
    ``s = idx_mapping[b]``; rows of ``out`` from ``num_reqs`` on are left as they are.

    Args:
        idx_mapping: ``[num_reqs]`` int64, batch row -> slot (all ``>= 0``).
        block_table: ``[max_num_reqs, max_blocks]`` int32, each slot's KV block ids.
        num_blocks: ``[max_num_reqs]`` int32, the blocks each slot holds.
        out: ``[>= num_reqs, max_blocks]`` int32, contiguous, written.
        use_triton: the kernel (``True``), the reference (``False``), or by device (``None``).

    Returns:
        ``out[:num_reqs]``, the step's block table for attention.

    Raises:
        ValueError: ``out`` of another width than ``block_table``, or with fewer than ``num_reqs`` rows.

    vLLM counterpart: ``vllm/v1/worker/gpu/block_table.py`` (``BlockTables.gather_block_tables``,
    ``_gather_block_tables_kernel``), which copies only the first ``num_blocks`` entries of a row and zeros the rows
    a larger earlier batch left past ``num_reqs``.
    """
    num_reqs = idx_mapping.shape[0]
    if out.dim() != 2 or out.shape[1] != block_table.shape[1] or out.shape[0] < num_reqs:
        raise ValueError(f"out must be [>= num_reqs={num_reqs}, {block_table.shape[1]}] like block_table's rows, got "
                         f"{tuple(out.shape)}")
    if not _pick_triton(use_triton, out):
        return gather_block_tables_ref(idx_mapping, block_table, num_blocks, out)
    if num_reqs > 0:
        _gather_block_tables_kernel[(num_reqs,)](
            idx_mapping, block_table, block_table.stride(0), num_blocks, out, out.stride(0), block_table.shape[1],
            BLOCK=min(_BLOCK, triton.next_power_of_2(block_table.shape[1])),
        )
    return out[:num_reqs]


# ----------------------------------------------------------------------------------------------------------------
# compute_slot_mappings
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _fill_range(ptr, start, stop, value, BLOCK: tl.constexpr):
    """``ptr[start:stop] = value``, in chunks of ``BLOCK``."""
    for i in range(start, stop, BLOCK):
        t = i + tl.arange(0, BLOCK)
        # No value.to(...): the store casts, and a value of 1 arrives as a compile-time constant, which has no .to.
        tl.store(ptr + t, value, mask=t < stop)


@triton.jit
def _compute_slot_mappings_kernel(
    idx_mapping_ptr,      # [num_reqs] int64; negative: a row with no blocks
    query_start_loc_ptr,  # [num_reqs + 1] int32
    positions_ptr,        # [num_tokens] int64
    block_table_ptr,      # [max_num_reqs, max_blocks] int32, per slot
    block_table_stride,
    out_ptr,              # [max_num_tokens] int64, written
    max_num_tokens,
    pad_id,
    KV_BLOCK_SIZE: tl.constexpr,  # tokens per cache block: a constant, so // and % compile to shifts and masks
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(query_start_loc_ptr + b)
    if b == tl.num_programs(0) - 1:
        # The extra last program pads the rest of the buffer (start is num_tokens here): a stale slot left there by
        # a longer earlier step would make a cache write through a padded batch overwrite a live block.
        _fill_range(out_ptr, start, max_num_tokens, pad_id, BLOCK)
        return
    end = tl.load(query_start_loc_ptr + b + 1)
    slot = tl.load(idx_mapping_ptr + b)
    if slot < 0:
        # A dummy row owns no blocks: its row of the table is not read, and its tokens are padding.
        _fill_range(out_ptr, start, end, pad_id, BLOCK)
        return
    row = block_table_ptr + slot * block_table_stride
    for i in range(start, end, BLOCK):
        t = i + tl.arange(0, BLOCK)
        mask = t < end
        pos = tl.load(positions_ptr + t, mask=mask, other=0)
        block = tl.load(row + pos // KV_BLOCK_SIZE, mask=mask, other=0)
        tl.store(out_ptr + t, block.to(tl.int64) * KV_BLOCK_SIZE + pos % KV_BLOCK_SIZE, mask=mask)


def compute_slot_mappings_ref(idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
                              block_table: torch.Tensor, block_size: int, out: torch.Tensor,
                              pad_id: int = -1) -> torch.Tensor:
    """PyTorch reference of :func:`compute_slot_mappings` (same arguments, same result)."""
    num_reqs = idx_mapping.shape[0]
    qsl = query_start_loc[:num_reqs + 1]
    num_tokens = int(qsl[-1])
    slots = torch.repeat_interleave(idx_mapping, (qsl[1:] - qsl[:-1]).long(), output_size=num_tokens)
    pos = positions[:num_tokens].long()
    real = slots >= 0
    # Dummy rows read entry 0 of row 0 (any valid entry would do): the value is replaced by pad_id below.
    block = block_table[slots.clamp(min=0), torch.where(real, pos // block_size, 0)].long()
    cache_slots = block * block_size + pos % block_size
    out[:num_tokens] = torch.where(real, cache_slots, pad_id)
    out[num_tokens:] = pad_id
    return out[:num_tokens]


def compute_slot_mappings(idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
                          block_table: torch.Tensor, block_size: int, out: torch.Tensor, pad_id: int = -1,
                          use_triton: bool | None = None) -> torch.Tensor:
    """Each token's KV-cache slot: where :func:`kernels.reshape_and_cache` writes its key and value.

    Token ``t`` of row ``b`` (slot ``s = idx_mapping[b]``) at position ``p = positions[t]`` goes to
    ``block_table[s, p // block_size] * block_size + p % block_size``. Tokens of rows with ``s < 0`` get ``pad_id``,
    and so does ``out`` from ``num_tokens = query_start_loc[num_reqs]`` to its end.

    Args:
        idx_mapping: ``[num_reqs]`` int64, batch row -> slot; negative: a dummy row.
        query_start_loc: ``[num_reqs + 1]`` int32.
        positions: ``[>= num_tokens]`` int64, from :func:`kernels.input_batch.prepare_pos_seq_lens`.
        block_table: ``[max_num_reqs, max_blocks]`` int32, per slot (not the gathered batch table).
        block_size: tokens per KV-cache block.
        out: ``[max_num_tokens]`` int64, written whole.
        pad_id: the slot of a token that is not written to the cache (``reshape_and_cache`` skips negatives).
        use_triton: the kernel (``True``), the reference (``False``), or by device (``None``).

    Returns:
        ``out[:num_tokens]``, the step's slot mapping (``num_tokens`` read from ``query_start_loc``: with CUDA
        tensors, one small device-to-host copy).

    vLLM counterpart: ``vllm/v1/worker/gpu/block_table.py`` (``BlockTables.compute_slot_mappings``,
    ``_compute_slot_mappings_kernel``); its pad is ``PAD_SLOT_ID``, -1 too.
    """
    if not _pick_triton(use_triton, out):
        return compute_slot_mappings_ref(idx_mapping, query_start_loc, positions, block_table, block_size, out, pad_id)
    num_reqs = idx_mapping.shape[0]
    # One more program than rows: the last pads the tail of out.
    _compute_slot_mappings_kernel[(num_reqs + 1,)](
        idx_mapping, query_start_loc, positions, block_table, block_table.stride(0), out, out.shape[0], pad_id,
        KV_BLOCK_SIZE=block_size, BLOCK=_BLOCK,
    )
    # The signature has no num_tokens: on a GPU this read is one small device-to-host copy (vLLM's caller passes
    # num_tokens_padded instead).
    return out[:int(query_start_loc[num_reqs])]
