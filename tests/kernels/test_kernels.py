"""Chapter 3 kernels against plain PyTorch: ``reshape_and_cache`` and ``unified_attention`` (and its stages).

Without a GPU every kernel runs in Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``), so batches are
small; the block sizes are chosen so every code path still runs: several query blocks per request, several KV
tiles, contexts that end inside a cache block, decodes mixed with prefills, GQA groups of 1, 3 and 4.

Tolerances (absolute, against an fp32 reference computed from the *same* inputs, upcast):
- fp32: 1e-4. Kernel and reference differ only in summation order (tiles, online rescaling); measured ~1e-6.
- fp16: 2e-3, a measured tolerance with a margin, not a bound (notebook 03 says the same). Measured up to 1.1e-3
  (the fp16 cases below and notebook 03), nearly all of it the rounding of the output to fp16: half an ulp, 2^-10
  ~ 9.8e-4 for 2 <= |out| < 4 (|out| <= max |v|, under 4 for these unit-normal values). The probabilities rounded
  to fp16 before ``P @ V`` (relative 2^-11 each) could add up to 2^-11 * max |v| ~ 2e-3 in the worst case but
  mostly cancel. 2e-3 is about a 2x margin over the measured error; the worst-case budget (~3e-3) would be looser than
  needed to catch a bug.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

import kernels
from kernels.attention_stages import (attention_contiguous, attention_paged_one_seq, attention_varlen,
                                      online_softmax_attention)
from kernels.testing import gather_kv, make_paged_batch, paged_reference_attention
from kernels.triton_basics import softmax_rows
from kernels.unified_attention import choose_config, describe_programs
from minillm.attention.reference import reference_attention

ATOL = {torch.float32: 1e-4, torch.float16: 2e-3}


def _reference(b, scale=None):
    """fp32 reference over the batch's inputs upcast to fp32."""
    return paged_reference_attention(b.q.float(), b.key_cache.float(), b.value_cache.float(), b.query_start_loc,
                                     b.seq_lens, b.block_table, scale=scale)


def _random_lengths(rng: random.Random, block_size: int, tile: int) -> tuple[list[int], list[int]]:
    """A varlen batch with every kind of request: a fresh prefill longer than a tile, a chunk whose context ends
    inside a cache block, decodes with contexts on and off block boundaries, and one random request."""
    query_lens = [rng.randint(tile + 1, 2 * tile + 3), rng.randint(2, tile), 1, 1, rng.randint(1, 2 * tile)]
    context_lens = [0, rng.randint(1, 2 * block_size) + block_size // 2, block_size - 1,
                    rng.randint(2 * block_size, 3 * block_size), rng.randint(0, 2 * block_size)]
    return query_lens, context_lens


# ----------------------------------------------------------------------------------------------------------------
# reshape_and_cache
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(3, 64, 16), (2, 80, 32), (1, 128, 16)])
def test_reshape_and_cache_writes_slots_and_skips_padding(dtype, num_kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(head_dim)
    num_blocks, num_tokens = 5, 37
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::4] = -1  # padding tokens: must not be written anywhere
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), 7.0, dtype=dtype)
    value_cache = torch.full_like(key_cache, -7.0)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)

    want_k = torch.full((num_blocks * block_size, num_kv_heads, head_dim), 7.0, dtype=dtype)
    want_v = torch.full_like(want_k, -7.0)
    keep = slots >= 0
    want_k[slots[keep]] = key[keep]
    want_v[slots[keep]] = value[keep]
    assert torch.equal(key_cache.view_as(want_k), want_k)  # a copy: exact
    assert torch.equal(value_cache.view_as(want_v), want_v)


def test_reshape_and_cache_strided_input_and_fp16_cache():
    """K/V sliced out of a fused qkv tensor (non-contiguous) into an fp16 cache: the kernel casts on store."""
    qkv = torch.randn(9, 3 * 2, 32)
    key, value = qkv[:, 2:4], qkv[:, 4:6]
    key_cache = torch.zeros(2, 16, 2, 32, dtype=torch.float16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([3, 4, 5, -1, 16, 17, 31, 0, -1])
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    keep = slots >= 0
    assert torch.equal(key_cache.view(-1, 2, 32)[slots[keep]], key[keep].half())
    assert torch.equal(value_cache.view(-1, 2, 32)[slots[keep]], value[keep].half())
    assert int((key_cache.view(-1, 2, 32).abs().sum((1, 2)) > 0).sum()) == int(keep.sum())


def test_reshape_and_cache_rejects_bad_input():
    key = torch.randn(4, 2, 16)
    cache = torch.zeros(2, 16, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="holds only 32 slots"):
        kernels.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 1, 2, 32]))
    with pytest.raises(ValueError, match="num_kv_heads=2, head_dim=16"):
        kernels.reshape_and_cache(key, key, torch.zeros(2, 16, 3, 16), torch.zeros(2, 16, 3, 16),
                                  torch.arange(4))
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.reshape_and_cache(key.bfloat16(), key.bfloat16(), cache.bfloat16(), cache.bfloat16(),
                                  torch.arange(4))


def test_reshape_and_cache_rejects_slot_beyond_cache_and_names_it():
    """Without the check the kernel writes past the end of the cache (a crashed process or a corrupted heap)."""
    key = torch.randn(4, 1, 16)
    cache = torch.zeros(2, 16, 1, 16)
    for slots in (torch.tensor([0, -1, 5, 32], dtype=torch.int32), torch.tensor([-1, -1, 3, 10_000])):
        with pytest.raises(ValueError, match=r"slot_mapping\[3\] = (32|10000).* must be < 32, or negative"):
            kernels.reshape_and_cache(key, key, cache, cache.clone(), slots)
    assert not cache.any()  # nothing was written before the error


# ----------------------------------------------------------------------------------------------------------------
# unified_attention
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 32), (9, 3, 64), (8, 2, 128)])
def test_unified_attention_random_varlen_batches(dtype, block_size, num_heads, num_kv_heads, head_dim):
    """GQA ratios 1, 3, 4; head dims 32, 64, 128; block sizes 16, 32; small tiles (many blocks and tiles per
    request) and the default launch configuration."""
    rng = random.Random(f"{dtype}{block_size}{num_heads}")
    for block_m, tile in ((16, 16), (None, None)):
        query_lens, context_lens = _random_lengths(rng, block_size, tile or 32)
        b = make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                             generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        out = kernels.unified_attention(*b.kernel_args(), block_m=block_m, tile_size=tile)
        assert out.dtype == dtype and out.shape == b.q.shape
        err = (out.float() - _reference(b)).abs().max().item()
        assert err <= ATOL[dtype], f"max abs error {err:.2e} for query_lens={query_lens}, contexts={context_lens}"


def test_unified_attention_head_dim_not_power_of_two_and_custom_scale():
    b = make_paged_batch([19, 1], [13, 40], 6, 2, 80, 16)
    out = kernels.unified_attention(*b.kernel_args(), scale=0.3, block_m=16, tile_size=16)
    assert (out - _reference(b, scale=0.3)).abs().max().item() <= ATOL[torch.float32]


@pytest.mark.parametrize("query_lens,context_lens", [([1, 1, 1], [70, 5, 33]), ([9, 1, 20], [40, 64, 0])])
def test_split_kv_segments_merge_exactly(query_lens, context_lens):
    """Split-KV (flash decoding): segments, including empty ones, merged by the reduce kernel."""
    b = make_paged_batch(query_lens, context_lens, 4, 2, 32, 16)
    out = kernels.unified_attention(*b.kernel_args(), block_m=16, tile_size=16, num_kv_splits=3)
    assert (out - _reference(b)).abs().max().item() <= ATOL[torch.float32]


def test_write_with_reshape_and_cache_then_attend():
    """The order a model layer uses: write the chunk's K/V at slot_mapping, then attend over the cache."""
    b = make_paged_batch([12, 1, 5], [0, 20, 17], 4, 2, 32, 16)
    fresh_k = torch.zeros_like(b.key_cache)
    fresh_v = torch.zeros_like(b.value_cache)
    qsl, sl = b.query_start_loc.tolist(), b.seq_lens.tolist()
    for i, seq_len in enumerate(sl):  # history (context) written by earlier steps
        ctx = seq_len - (qsl[i + 1] - qsl[i])
        k, v = gather_kv(b.key_cache, b.value_cache, b.block_table[i], ctx)
        pos = torch.arange(ctx)
        slots = b.block_table[i].long()[pos // 16] * 16 + pos % 16
        kernels.reshape_and_cache(k, v, fresh_k, fresh_v, slots)
    new_k = torch.cat([gather_kv(b.key_cache, b.value_cache, b.block_table[i], s)[0][s - (qsl[i + 1] - qsl[i]):]
                       for i, s in enumerate(sl)])
    new_v = torch.cat([gather_kv(b.key_cache, b.value_cache, b.block_table[i], s)[1][s - (qsl[i + 1] - qsl[i]):]
                       for i, s in enumerate(sl)])
    kernels.reshape_and_cache(new_k, new_v, fresh_k, fresh_v, b.slot_mapping)
    out = kernels.unified_attention(b.q, fresh_k, fresh_v, b.query_start_loc, b.seq_lens, b.block_table,
                                    b.max_query_len, b.max_seq_len)
    assert (out - _reference(b)).abs().max().item() <= ATOL[torch.float32]


def test_unified_attention_rejects_bad_input():
    b = make_paged_batch([3], [5], 4, 2, 32, 16)
    args = list(b.kernel_args())
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kernels.unified_attention(torch.randn(3, 3, 32), *args[1:])
    with pytest.raises(ValueError, match="same dtype"):
        kernels.unified_attention(b.q.half(), *args[1:])
    with pytest.raises(ValueError, match="too few"):
        kernels.unified_attention(*args[:6], 3, 1000)
    with pytest.raises(ValueError, match="block_m"):
        kernels.unified_attention(*args, block_m=24)
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.unified_attention(b.q.bfloat16(), b.key_cache.bfloat16(), b.value_cache.bfloat16(), *args[3:])


def _bad_index_batch() -> dict:
    """Three requests (query_lens 3, 1, 2; seq_lens 8, 5, 3; one 16-token block each; 6 cache blocks) as the
    keyword arguments of unified_attention, for the value checks below to spoil one at a time."""
    b = make_paged_batch([3, 1, 2], [5, 4, 1], 2, 1, 16, 16, extra_blocks=3)
    return dict(q=b.q, key_cache=b.key_cache, value_cache=b.value_cache, query_start_loc=b.query_start_loc,
                seq_lens=b.seq_lens, block_table=b.block_table, max_query_len=3, max_seq_len=8)


# Each spoiled batch slips past every other check (shapes, dtypes, the block table's width for max_seq_len), so
# without its own check the kernel would run: out-of-bounds reads and writes (crash) or silent garbage.
_BAD_INDICES = {
    "qsl starts at 1": (dict(query_start_loc=[1, 3, 4, 6]), r"start at 0, got query_start_loc\[0\] = 1"),
    "qsl decreases": (dict(query_start_loc=[0, 3, 2, 6]),
                      r"non-decreasing, got query_start_loc\[1\] = 3 > query_start_loc\[2\] = 2"),
    "qsl ends past q": (dict(query_start_loc=[0, 3, 4, 7]), r"end at num_tokens = 6 .* query_start_loc\[-1\] = 7"),
    "qsl ends short of q": (dict(query_start_loc=[0, 3, 4, 5]), r"end at num_tokens = 6 .*\[-1\] = 5"),
    "negative context": (dict(seq_lens=[2, 5, 3]), r"request 0 has query_len 3 > seq_lens\[0\] = 2"),
    "seq_len over max_seq_len": (dict(seq_lens=[8, 5, 300]), r"seq_lens\[2\] = 300 exceeds the max_seq_len = 8"),
    "block id = num_blocks": (dict(block_table=[[0], [6], [1]]), r"block_table\[1, 0\] = 6 .* \[0, num_blocks = 6\)"),
    "negative block id": (dict(block_table=[[0], [1], [-1]]), r"block_table\[2, 0\] = -1 is not a cache block"),
}


@pytest.mark.parametrize("case", list(_BAD_INDICES))
def test_unified_attention_rejects_bad_index_values(case):
    spoil, message = _BAD_INDICES[case]
    kwargs = _bad_index_batch()
    for name, value in spoil.items():
        kwargs[name] = torch.tensor(value, dtype=kwargs[name].dtype)
    out = torch.full_like(kwargs["q"], 123.0)
    with pytest.raises(ValueError, match=message):
        kernels.unified_attention(**kwargs, out=out)
    assert (out == 123.0).all()  # rejected before any kernel ran


def test_paged_attention_checks_index_values_once_per_step(monkeypatch):
    """The engine's Triton path checks a step's metadata once for all layers (on a GPU every check is a host sync),
    and still refuses bad values before any kernel runs."""
    from minillm.attention.metadata import AttentionMetadata
    from minillm.attention.paged import PagedAttention

    kw = _bad_index_batch()
    num_tokens = kw["q"].shape[0]
    slots = torch.arange(num_tokens, dtype=torch.int64)  # any distinct slots in the 6 x 16 cache

    def metadata(**spoil):
        fields = dict(query_start_loc=kw["query_start_loc"], seq_lens=kw["seq_lens"], block_table=kw["block_table"],
                      slot_mapping=slots, max_query_len=3, max_seq_len=8)
        fields.update({k: torch.tensor(v, dtype=fields[k].dtype) for k, v in spoil.items()})
        return AttentionMetadata(**fields)

    caches = [(kw["key_cache"].clone(), kw["value_cache"].clone()) for _ in range(3)]
    calls = []
    ua = sys.modules["kernels.unified_attention"]  # the package attribute of that name is the function
    real = ua.check_batch_values
    monkeypatch.setattr(ua, "check_batch_values", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    attn = PagedAttention(caches, metadata(), backend="triton")
    k = torch.randn(num_tokens, 1, 16)
    outs = [attn.forward(layer, kw["q"], k, k) for layer in range(3)]
    assert len(calls) == 1  # three layers, one check
    want = paged_reference_attention(kw["q"], *caches[0], kw["query_start_loc"], kw["seq_lens"], kw["block_table"])
    assert all((o - want).abs().max() < ATOL[torch.float32] for o in outs)
    attn.metadata = metadata()  # the next step's metadata is checked again
    attn.forward(0, kw["q"], k, k)
    assert len(calls) == 2

    for spoil, message in [(dict(slot_mapping=[0, 1, 2, 3, 4, 96]), r"slot_mapping\[5\] = 96"),
                           (dict(block_table=[[0], [6], [1]]), r"block_table\[1, 0\] = 6")]:
        before = [c[0].clone() for c in caches]
        with pytest.raises(ValueError, match=message):
            PagedAttention(caches, metadata(**spoil), backend="triton").forward(1, kw["q"], k, k)
        assert all(torch.equal(b, c[0]) for b, c in zip(before, caches))  # nothing was written


def test_unified_attention_empty_batch_needs_no_tokens():
    """No requests: query_start_loc is [0] and q has no rows; rows without a request would be left unwritten."""
    kwargs = _bad_index_batch()
    kwargs.update(query_start_loc=torch.zeros(1, dtype=torch.int32), seq_lens=torch.zeros(0, dtype=torch.int32),
                  block_table=torch.zeros(0, 1, dtype=torch.int32))
    assert kernels.unified_attention(**dict(kwargs, q=kwargs["q"][:0])).shape == (0, 2, 16)
    with pytest.raises(ValueError, match=r"empty batch must be \[0\] with num_tokens = 0, got .* num_tokens = 6"):
        kernels.unified_attention(**kwargs)


def test_unified_attention_ignores_unused_block_table_entries():
    """Only the blocks a request reads are checked: padding columns past them may hold anything."""
    kwargs = _bad_index_batch()
    b = kwargs["block_table"]
    kwargs["block_table"] = torch.cat([b, torch.tensor([[999], [-1], [6]], dtype=b.dtype)], dim=1)
    out = kernels.unified_attention(**kwargs, block_m=16, tile_size=16)
    want = paged_reference_attention(kwargs["q"], kwargs["key_cache"], kwargs["value_cache"],
                                     kwargs["query_start_loc"], kwargs["seq_lens"], b)
    assert (out - want).abs().max().item() <= ATOL[torch.float32]


def test_launch_config_shapes():
    """The GPU rules of choose_config, checked without a GPU (they only read shapes), and the tl.dot >= 16 rule."""
    q = torch.empty(5, 9, 64)
    for max_q in (1, 300):
        cfg = choose_config(q, 3, 3, 16, max_q, 400)
        assert cfg.block_m >= 16 and cfg.tile_size >= 16 and cfg.block_q * 3 <= cfg.block_m
    assert choose_config(torch.empty(5, 32, 64), 1, 1, 16, 1, 100).block_m == 32  # group of 32 needs 32 rows


def test_describe_programs_covers_each_request_once():
    b = make_paged_batch([23, 1, 7, 1], [0, 37, 16, 5], 4, 2, 32, 16)
    work = describe_programs(b.query_start_loc, b.seq_lens, b.block_table, 16, block_q=8)
    covered = [t for w in work for t in w.tokens]
    assert covered == list(range(b.q.shape[0]))  # every token exactly once, in order
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        last = max((w for w in work if w.seq == i), key=lambda w: w.q_block)
        assert last.kv_end == seq_len and last.blocks == b.block_table[i, : -(-seq_len // 16)].tolist()


# ----------------------------------------------------------------------------------------------------------------
# The stages of the chapter (notebook section 3) and the first kernel (section 2)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tile", [1, 7, 64])
def test_online_softmax_recurrence(tile):
    s = torch.randn(5, 50, dtype=torch.float64) * 40  # exp(s) alone would overflow fp32
    s[0, :] = float("-inf")      # a row with nothing visible
    s[1, :30] = float("-inf")    # a row whose first tiles are all masked
    v = torch.randn(50, 8, dtype=torch.float64)
    want = torch.nan_to_num(torch.softmax(s, dim=1), nan=0.0) @ v
    assert torch.allclose(online_softmax_attention(s, v, tile), want, atol=1e-12)


def test_softmax_rows_kernel():
    x = torch.randn(6, 37) * 30  # large scores: the max shift is what keeps exp finite
    assert torch.allclose(softmax_rows(x), torch.softmax(x, -1), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_stages_agree_with_reference(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(20, 2, 32, generator=g).to(dtype)
    k = torch.randn(45, 2, 32, generator=g).to(dtype)
    v = torch.randn(45, 2, 32, generator=g).to(dtype)
    want = reference_attention(q.float(), k.float(), v.float())
    assert (attention_contiguous(q, k, v).float() - want).abs().max().item() <= ATOL[dtype]

    one = make_paged_batch([20], [25], 2, 2, 32, 16, dtype)
    got = attention_paged_one_seq(one.q, one.key_cache, one.value_cache, one.block_table[0], 45)
    assert (got.float() - _reference(one)).abs().max().item() <= ATOL[dtype]

    batch = make_paged_batch([20, 1, 5, 17], [25, 30, 0, 16], 2, 2, 32, 16, dtype)
    got = attention_varlen(batch.q, batch.key_cache, batch.value_cache, batch.query_start_loc, batch.seq_lens,
                           batch.block_table, batch.max_query_len)
    assert (got.float() - _reference(batch)).abs().max().item() <= ATOL[dtype]


# ----------------------------------------------------------------------------------------------------------------
# Without a GPU: the kernels still compile for one, and the benchmark says it needs one
# ----------------------------------------------------------------------------------------------------------------
_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.slow
@pytest.mark.skipif(not _PTXAS.exists(), reason="this Triton build ships no CUDA backend (ptxas)")
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter accepts code the GPU compiler rejects; compile the prefill and decode configurations (and
    reshape_and_cache, and the eight input-preparation configurations of kernels/input_batch.py and
    kernels/block_table.py) for sm_90 offline, in a child process with the interpreter off."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--arch", "90", "--quick"], env=env,
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all kernels compiled" in res.stdout and res.stdout.count(" 90  ") == 4 + 8


def test_bench_on_cpu_says_it_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run for real")
    res = subprocess.run([sys.executable, "bench/attention.py"], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parents[2])
    assert res.returncode == 0 and "needs a CUDA GPU" in res.stdout
