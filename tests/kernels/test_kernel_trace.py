"""kernels.trace: the addresses Triton's interpreter loads and stores, mapped back to tensors (chapter 3's pictures).

The key claims: the reference paged-attention kernels read exactly the cache rows of each request's block-table row
up to its seq_len (and nothing else of the cache), a deliberately wrong offset function shows up as reads of other
blocks, masked-off lanes are not recorded, and the interpreter is left as it was after the ``with`` block.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kernels.attention_stages import _paged_one_seq_kernel, attention_paged_one_seq, attention_varlen
from kernels.testing import make_paged_batch
from kernels.trace import NONE, SEVERAL, AccessPanel, interpreted, owner_map, plot_access_comparison, trace_memory

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the tracer records the interpreter (conftest sets TRITON_INTERPRET=1 on a CPU)")

ROOT = Path(__file__).resolve().parents[2]


def _expected_rows(block_ids: torch.Tensor, seq_len: int, num_blocks: int, block_size: int) -> np.ndarray:
    """bool [num_blocks, block_size]: the cache rows holding positions 0..seq_len-1 of one request."""
    rows = np.zeros((num_blocks, block_size), dtype=bool)
    for pos in range(seq_len):
        rows[int(block_ids[pos // block_size]), pos % block_size] = True
    return rows


@triton.jit
def _wrong_offsets_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_ids_ptr, scale, num_q, seq_len,
                          stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                          stride_c_blk, stride_c_slot, stride_c_head,
                          HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_M: tl.constexpr, TILE_SIZE: tl.constexpr):
    """Only the K/V loads of the paged kernel, with a classic mistake: ``j % BLOCK_SIZE`` as the block index
    (``BLOCK_M == 1``), or the logical block ``j // BLOCK_SIZE`` as the physical one (``BLOCK_M == 2``)."""
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    for start in range(0, seq_len, TILE_SIZE):
        j = start + tl.arange(0, TILE_SIZE)
        j_ok = j < seq_len
        if BLOCK_M == 1:
            blk = tl.load(block_ids_ptr + j % BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
        else:
            blk = (j // BLOCK_SIZE).to(tl.int64)
        row = blk * stride_c_blk + (j % BLOCK_SIZE) * stride_c_slot
        tl.load(k_cache_ptr + row[None, :] + head * stride_c_head + d[:, None], mask=j_ok[None, :], other=0.0)
        tl.load(v_cache_ptr + row[:, None] + head * stride_c_head + d[None, :], mask=j_ok[:, None], other=0.0)


def _launch(kernel, q, key_cache, value_cache, block_ids, seq_len, block_m=16):
    out = torch.empty_like(q)
    kernel[(triton.cdiv(q.shape[0], 16), q.shape[1])](
        out, q, key_cache, value_cache, block_ids, 1.0, q.shape[0], seq_len, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), *key_cache.stride()[:3], HEAD_DIM=q.shape[2], BLOCK_SIZE=key_cache.shape[1], BLOCK_M=block_m,
        TILE_SIZE=16)
    return out


def test_reference_paged_kernel_reads_exactly_each_requests_blocks_up_to_seq_len():
    # Contexts that end inside a block, a decode, a request of exactly one block; blocks scattered at random.
    b = make_paged_batch([5, 8, 1, 4], [3, 14, 10, 0], num_heads=2, num_kv_heads=2, head_dim=16, block_size=4)
    num_blocks, block_size = b.key_cache.shape[:2]
    starts = b.query_start_loc.tolist()
    for i, seq_len in enumerate(b.seq_lens_list):
        q = b.q[starts[i]:starts[i + 1]]
        with trace_memory() as trace:
            out = attention_paged_one_seq(q, b.key_cache, b.value_cache, b.block_table[i], seq_len)
        want = _expected_rows(b.block_table[i], seq_len, num_blocks, block_size)
        for cache in (b.key_cache, b.value_cache):
            np.testing.assert_array_equal(trace.touched(cache, "load", dims=2), want)
            # every head of every row it reads
            assert trace.touched(cache, "load", dims=3)[want].all()
        # the block table: the request's own entries up to its last block, nothing else
        table = np.zeros(tuple(b.block_table.shape), dtype=bool)
        table[i, :-(-seq_len // block_size)] = True
        np.testing.assert_array_equal(trace.touched(b.block_table, "load", dims=2), table)
        assert trace.touched(out, "store", dims=2).all() and not trace.touched(out, "load").any()
        assert not trace.touched(b.key_cache, "store").any()
        assert trace.outside([b.q, b.key_cache, b.value_cache, b.block_table], "load").size == 0
        assert trace.outside([out], "store").size == 0


def test_reference_varlen_kernel_reads_the_union_of_the_block_table_rows():
    b = make_paged_batch([5, 8, 1], [3, 14, 10], num_heads=1, num_kv_heads=1, head_dim=16, block_size=4)
    num_blocks, block_size = b.key_cache.shape[:2]
    with trace_memory() as trace:
        attention_varlen(b.q, b.key_cache, b.value_cache, b.query_start_loc, b.seq_lens, b.block_table,
                         b.max_query_len)
    want = np.zeros((num_blocks, block_size), dtype=bool)
    for i, seq_len in enumerate(b.seq_lens_list):
        want |= _expected_rows(b.block_table[i], seq_len, num_blocks, block_size)
    np.testing.assert_array_equal(trace.touched(b.key_cache, "load", dims=2), want)
    # One program per (request, query block, head): program (i, 0, 0) reads only request i's rows.
    for i, seq_len in enumerate(b.seq_lens_list):
        mine = [a for a in trace.accesses if a.kind == "load" and a.program_id[0] == i]
        sub = type(trace)(mine, trace.launches)
        np.testing.assert_array_equal(sub.touched(b.key_cache, "load", dims=2),
                                      _expected_rows(b.block_table[i], seq_len, num_blocks, block_size))


def test_a_wrong_offset_function_shows_as_reads_of_wrong_blocks():
    b = make_paged_batch([8], [14], num_heads=1, num_kv_heads=1, head_dim=16, block_size=4)
    num_blocks, block_size = b.key_cache.shape[:2]
    seq_len = b.seq_lens_list[0]
    args = (b.q, b.key_cache, b.value_cache, b.block_table[0], seq_len)
    with trace_memory() as trace:
        _launch(_paged_one_seq_kernel, *args)
    want = _expected_rows(b.block_table[0], seq_len, num_blocks, block_size)
    np.testing.assert_array_equal(trace.touched(b.key_cache, "load", dims=2), want)
    own_blocks = {int(x) for x in b.block_table[0, :6]}
    assert set(np.flatnonzero(want.any(axis=1)).tolist()) == own_blocks

    # j % 4 as the block index: position p reads row p % 4 of block block_table[p % 4], so 4 rows in all, in the
    # first 4 of its 6 blocks; the blocks of entries 4 and 5 (positions 16-21) are never read.
    with trace_memory() as trace:
        _launch(_wrong_offsets_kernel, *args, block_m=1)
    wrong = trace.touched(b.key_cache, "load", dims=2)
    assert wrong.sum() == 4 and set(np.flatnonzero(wrong.any(axis=1)).tolist()) == {int(x) for x in
                                                                                     b.block_table[0, :4]}
    # The logical block as the physical one: blocks 0-5 are read, most of which belong to no one or to no position
    # of this request.
    with trace_memory() as trace:
        _launch(_wrong_offsets_kernel, *args, block_m=2)
    wrong = trace.touched(b.key_cache, "load", dims=2)
    assert set(np.flatnonzero(wrong.any(axis=1)).tolist()) == set(range(6))
    assert set(range(6)) - own_blocks and (wrong & ~want).any()


def test_masked_lanes_are_not_recorded_and_unmasked_overreads_land_outside():
    @triton.jit
    def copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
        i = tl.arange(0, BLOCK)
        if MASKED:
            tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n, other=0.0), mask=i < n)
        else:
            tl.store(y_ptr + i, tl.load(x_ptr + i), mask=i < n)

    buf = torch.arange(16, dtype=torch.float32)
    x, y = buf[:5], torch.zeros(5)
    with trace_memory() as trace:
        copy[(1,)](x, y, 5, BLOCK=8, MASKED=True)
    assert trace.touched(x).all() and trace.touched(y, "store").all()
    assert trace.outside([x]).size == 0 and trace.outside([y], "store").size == 0
    assert [a.addresses.size for a in trace.accesses] == [5, 5]
    with trace_memory() as trace:
        copy[(1,)](x, y, 5, BLOCK=8, MASKED=False)
    over = trace.outside([x])
    assert over.size == 3 and set(((over - buf.data_ptr()) // 4).tolist()) == {5, 6, 7}
    assert trace.touched(buf).tolist() == [True] * 8 + [False] * 8


def test_strided_views_map_to_their_own_rows():
    @triton.jit
    def read_all(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.load(x_ptr + i, mask=i < n)

    base = torch.zeros(6, 4)
    with trace_memory() as trace:
        read_all[(1,)](base, 24, BLOCK=32)
    # every element of the buffer, seen through a transposed view and through a slice of columns
    assert trace.touched(base.t(), dims=1).all()
    assert trace.touched(base[:, 1:3], dims=2).all()
    with trace_memory() as trace:
        read_all[(1,)](base[2], 4, BLOCK=4)      # row 2 only
    assert trace.touched(base).tolist() == [False, False, True, False, False, False]
    assert trace.touched(base.t(), dims=2)[:, 2].all() and trace.touched(base.t(), dims=2).sum() == 4
    assert trace.programs(base).tolist() == [0, 0, 1, 0, 0, 0]


def test_the_interpreter_is_restored_after_the_block_even_on_error():
    from triton.runtime import interpreter

    before = (interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_masked_store,
              interpreter.GridExecutor._init_args_hst)
    with pytest.raises(ZeroDivisionError):
        with trace_memory():
            assert interpreter.InterpreterBuilder.create_masked_load is not before[0]
            1 / 0
    after = (interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_masked_store,
             interpreter.GridExecutor._init_args_hst)
    assert after == before
    x = torch.zeros(4)
    with trace_memory() as outer:
        with trace_memory() as inner:
            attention_paged_one_seq  # noqa: B018 - nesting alone must be harmless
        assert inner.accesses == [] and outer.accesses == []
    assert interpreter.InterpreterBuilder.create_masked_load is before[0]
    with pytest.raises(RuntimeError, match="no interpreted kernel launch"):
        outer.touched(x)


def test_owner_map_and_the_picture():
    b = make_paged_batch([5, 8], [3, 14], num_heads=1, num_kv_heads=1, head_dim=16, block_size=4)
    starts = b.query_start_loc.tolist()
    traces = []
    for i, seq_len in enumerate(b.seq_lens_list):
        with trace_memory() as trace:
            attention_paged_one_seq(b.q[starts[i]:starts[i + 1]], b.key_cache, b.value_cache, b.block_table[i],
                                    seq_len)
        traces.append(trace)
    owners = owner_map(traces, b.key_cache, "load", dims=2)
    assert set(np.unique(owners).tolist()) == {NONE, 0, 1}       # the requests share no block
    both = owner_map([traces[0], traces[0]], b.key_cache, "load", dims=2)
    assert set(np.unique(both).tolist()) == {NONE, SEVERAL}
    yours = owners.copy()
    yours[0, 0] = 1 if yours[0, 0] != 1 else 0
    panel = AccessPanel("K cache rows read", owners.T, yours.T, {0: "request 0", 1: "request 1"}, xlines=[3.5])
    assert panel.differences.tolist() == [[0, 0]]
    fig = plot_access_comparison([panel])
    assert len(fig.axes) == 2
    assert fig.axes[1].get_title().endswith("1 differ (x)") and fig.axes[0].get_title().startswith("reference")
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_interpreted_twin_of_a_compiled_kernel_is_traced(tmp_path):
    """On a GPU the kernels are compiled (no TRITON_INTERPRET); ``interpreted`` gives a twin the tracer sees. Here a
    subprocess without TRITON_INTERPRET defines real JITFunctions (one calling another) and traces their twins."""
    script = textwrap.dedent('''
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        import torch, triton, triton.language as tl
        from triton.runtime.jit import JITFunction

        @triton.jit
        def lookup(ids_ptr, i, ok):
            return tl.load(ids_ptr + i // 2, mask=ok, other=0).to(tl.int64)

        @triton.jit
        def gather(x_ptr, ids_ptr, out_ptr, n, BLOCK: tl.constexpr):
            i = tl.arange(0, BLOCK)
            ok = i < n
            r = lookup(ids_ptr, i, ok)
            tl.store(out_ptr + i, tl.load(x_ptr + r * 2 + i % 2, mask=ok, other=0.0), mask=ok)

        assert isinstance(gather, JITFunction) and isinstance(lookup, JITFunction)
        from kernels.trace import interpreted, trace_memory   # (kernels/__init__ turns the interpreter on for later ones)
        x, ids, out = torch.arange(20.0), torch.tensor([3, 0, 5], dtype=torch.int32), torch.zeros(6)
        with trace_memory() as trace:
            interpreted(gather)[(1,)](x, ids, out, 6, BLOCK=8)
        assert out.tolist() == [6, 7, 0, 1, 10, 11], out
        assert sorted(trace.touched(x).nonzero()[0].tolist()) == [0, 1, 6, 7, 10, 11]
        assert trace.touched(ids).all() and isinstance(gather, JITFunction)   # the kernel itself is unchanged
        print("ok")
    ''')
    path = tmp_path / "compiled_kernels.py"     # a file: Triton reads a kernel's source from it
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
