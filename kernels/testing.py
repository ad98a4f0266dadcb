"""Random paged batches and a plain-PyTorch reference for them: what the kernel tests check against.

:func:`make_paged_batch` builds a varlen batch (some prefills, some chunks with a cached context, some decodes)
with each request's blocks scattered at random over the cache, exactly the shapes vLLM hands its attention kernel.
:func:`paged_reference_attention` gathers each request's K/V back into a contiguous tensor through the block table
and calls :func:`minillm.attention.reference.reference_attention`, so it shares no code with the kernels.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from triton.runtime.errors import InterpreterError

from minillm.attention.reference import reference_attention


@dataclass
class PagedBatch:
    """A varlen batch over a paged KV cache, with the history already written into the cache.

    Attributes:
        q: ``[num_tokens, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        query_start_loc: ``[num_seqs + 1]`` int32. seq_lens: ``[num_seqs]`` int32.
        block_table: ``[num_seqs, max_blocks]`` int32 (unused entries 0).
        slot_mapping: ``[num_tokens]`` int64, where each query token's own K/V lives.
        query_lens, seq_lens_list: the same lengths as Python lists.
    """

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    seq_lens_list: list[int]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list)

    def kernel_args(self) -> tuple:
        """Positional arguments of :func:`kernels.unified_attention`, in order (``scale`` left at its default)."""
        return (self.q, self.key_cache, self.value_cache, self.query_start_loc, self.seq_lens, self.block_table,
                self.max_query_len, self.max_seq_len)


def make_paged_batch(query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                     extra_blocks: int = 3, generator: torch.Generator | None = None) -> PagedBatch:
    """A random batch: request ``i`` has ``context_lens[i]`` cached tokens and ``query_lens[i]`` new ones.

    Blocks are handed out in a random order (so a request's blocks are not contiguous) and ``extra_blocks`` unused
    blocks filled with large values make any wrong lookup visible. The K/V of every token, new ones included, are
    already in the cache, as after :func:`kernels.reshape_and_cache`.
    """
    if len(query_lens) != len(context_lens) or not query_lens:
        raise ValueError(f"need equal, non-empty query_lens and context_lens, got {query_lens} and {context_lens}")
    if min(query_lens) < 1 or min(context_lens) < 0:
        raise ValueError(f"query_lens must be >= 1 and context_lens >= 0, got {query_lens} and {context_lens}")
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    # Garbage everywhere first: unused blocks and unused rows of the last block must never be read.
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), 1e4).to(dtype)
    value_cache = torch.full_like(key_cache, -1e4)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slot_mapping = []
    next_block = 0
    for i, (s, nb, c) in enumerate(zip(seq_lens, blocks_per_seq, context_lens, strict=True)):
        ids = perm[next_block:next_block + nb]
        next_block += nb
        block_table[i, :nb] = ids.to(torch.int32)
        pos = torch.arange(s)
        slots = ids[pos // block_size] * block_size + pos % block_size
        k = torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype)
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        slot_mapping.append(slots[c:])
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return PagedBatch(q.to(device), key_cache.to(device), value_cache.to(device), qsl.to(device),
                      torch.tensor(seq_lens, dtype=torch.int32, device=device), block_table.to(device),
                      torch.cat(slot_mapping).to(torch.int64).to(device), list(query_lens), seq_lens)


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` tokens of one request as contiguous ``[seq_len, num_kv_heads, head_dim]`` K and V."""
    block_size = key_cache.shape[1]
    pos = torch.arange(seq_len, device=key_cache.device)
    blk = block_ids.long()[pos // block_size]
    return key_cache[blk, pos % block_size], value_cache[blk, pos % block_size]


def paged_reference_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                              scale: float | None = None) -> torch.Tensor:
    """What :func:`kernels.unified_attention` must return, computed request by request in fp32 PyTorch.

    Returns ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    out = torch.empty_like(q)
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(sl):
        a, b = qsl[i], qsl[i + 1]
        k, v = gather_kv(key_cache, value_cache, block_table[i], seq_len)
        out[a:b] = reference_attention(q[a:b], k, v, ctx_len=seq_len - (b - a), scale=scale)
    return out


def unwrap_kernel_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``fn`` so that an exception raised *inside* a kernel keeps its type.

    Triton's interpreter wraps whatever a kernel raises in an ``InterpreterError`` (once per nested ``@triton.jit``
    call). Exercise checks want the original: a stub's ``NotImplementedError`` or a failed ``AssertionError``.
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except InterpreterError as e:
            cause: BaseException = e
            while isinstance(cause, InterpreterError) and cause.__cause__ is not None:
                cause = cause.__cause__
            if cause is e:
                raise
            raise cause from None
    return wrapper
