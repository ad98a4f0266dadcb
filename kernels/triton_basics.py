"""The smallest useful Triton kernel: a numerically safe softmax over each row of a matrix (chapter 3, section 2).

It shows the whole programming model in a dozen lines: a *grid* of programs (here one per row), each program
working on a *block* of elements given by ``tl.arange``, *pointers* computed from a base address and strides,
and *masks* that keep a power-of-two block from touching memory past the end of the row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_rows_kernel(x_ptr, out_ptr, n_cols, stride_x_row, stride_out_row, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)                      # which program am I? one per row
    cols = tl.arange(0, BLOCK_N)                # a block of column indices, BLOCK_N a power of two
    mask = cols < n_cols                        # the block may be wider than the row
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=float("-inf"))
    x = x - tl.max(x, axis=0)                   # exp of large scores would overflow; shifting changes nothing
    e = tl.exp(x)                               # masked columns: exp(-inf) = 0, so they add nothing below
    tl.store(out_ptr + row * stride_out_row + cols, e / tl.sum(e, axis=0), mask=mask)


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis of a 2-D fp32/fp16 tensor ``[n_rows, n_cols]``, one Triton program per row."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"x must be a 2-D float32/float16 tensor, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along its rows (stride(1) == 1)")
    out = torch.empty_like(x)
    _softmax_rows_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0),
                                        BLOCK_N=max(16, triton.next_power_of_2(x.shape[1])))
    return out
