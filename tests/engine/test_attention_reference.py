"""Reference attention with a prefix offset, the rectangular causal mask, and the log-sum-exp merge.

Everything is compared with an independent implementation written here in fp64 (explicit loops over heads, the mask
built from positions), and with PyTorch's ``scaled_dot_product_attention``.

Tolerances: inputs are fp32 with entries ~N(0, 1); the reference computes in fp32, so per-element errors are a few
ulps of O(1) numbers times the number of keys (<= 24): ``atol = rtol = 1e-5`` is ~100x above what we observe and far
below any real bug (a wrong mask or head mapping gives O(0.1) errors).
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.attention.reference import (causal_mask, merge_attn_states, prefix_chunk_attention,
                                         reference_attention)

ATOL = RTOL = 1e-5
FAST = settings(max_examples=60, deadline=None)


def naive_attention(q, k, v, ctx_len, causal=True):
    """fp64, one head at a time; query i (absolute position ctx_len+i) sees key j iff j <= ctx_len+i."""
    num_q, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros(num_q, num_heads, head_dim, dtype=torch.float64)
    lse = torch.full((num_q, num_heads), -math.inf, dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for i in range(num_q):
            visible = k.shape[0] if not causal else ctx_len + i + 1
            if visible == 0:
                continue
            s = (kh[:visible] @ q[i, h].double()) / math.sqrt(head_dim)
            lse[i, h] = torch.logsumexp(s, 0)
            out[i, h] = torch.softmax(s, 0) @ vh[:visible]
    return out, lse


@st.composite
def chunk_problem(draw):
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    head_dim = draw(st.sampled_from([2, 8, 16]))
    num_q = draw(st.integers(1, 8))
    ctx_len = draw(st.integers(0, 16))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_q, num_kv_heads * group, head_dim, generator=g)
    k = torch.randn(ctx_len + num_q, num_kv_heads, head_dim, generator=g)
    v = torch.randn(ctx_len + num_q, num_kv_heads, head_dim, generator=g)
    return q, k, v, ctx_len


@FAST
@given(chunk_problem())
def test_reference_matches_naive_fp64(problem):
    q, k, v, ctx_len = problem
    out, lse = reference_attention(q, k, v, ctx_len=ctx_len, return_lse=True)
    want_out, want_lse = naive_attention(q, k, v, ctx_len)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:2]
    torch.testing.assert_close(out.double(), want_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse.double(), want_lse, atol=ATOL, rtol=RTOL)
    # ctx_len defaults to num_k - num_q: the chunk is the tail of the keys
    torch.testing.assert_close(reference_attention(q, k, v), out, atol=0, rtol=0)


@FAST
@given(chunk_problem())
def test_reference_matches_torch_sdpa(problem):
    q, k, v, ctx_len = problem
    group = q.shape[1] // k.shape[1]
    mask = torch.arange(k.shape[0])[None, :] <= (torch.arange(q.shape[0])[:, None] + ctx_len)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1),
        attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(reference_attention(q, k, v, ctx_len=ctx_len), want, atol=ATOL, rtol=RTOL)


@FAST
@given(st.integers(1, 24), st.data())
def test_chunks_with_prefix_reproduce_full_causal_attention(total, data):
    """Cutting the queries anywhere and attending each piece over its prefix + itself gives full attention."""
    cuts = sorted(set(data.draw(st.lists(st.integers(1, total - 1), max_size=4)) if total > 1 else []))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    q, k, v = torch.randn(total, 6, 8, generator=g), torch.randn(total, 2, 8, generator=g), torch.randn(total, 2, 8,
                                                                                                       generator=g)
    full = reference_attention(q, k, v)
    pieces = []
    for s, e in zip([0] + cuts, cuts + [total]):
        pieces.append(reference_attention(q[s:e], k[:e], v[:e], ctx_len=s))
    torch.testing.assert_close(torch.cat(pieces), full, atol=ATOL, rtol=RTOL)


@FAST
@given(chunk_problem(), st.data())
def test_merge_of_disjoint_key_sets_is_attention_over_union(problem, data):
    q, k, v, _ = problem
    n = k.shape[0]
    in_a = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    out_u, lse_u = reference_attention(q, k, v, causal=False, return_lse=True)
    out_a, lse_a = reference_attention(q, k[in_a], v[in_a], causal=False, return_lse=True)
    out_b, lse_b = reference_attention(q, k[~in_a], v[~in_a], causal=False, return_lse=True)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_u, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse, lse_u, atol=ATOL, rtol=RTOL)
    # the order of the two parts does not matter
    out2, lse2 = merge_attn_states(out_b, lse_b, out_a, lse_a)
    torch.testing.assert_close(out2, out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse2, lse, atol=ATOL, rtol=RTOL)


@FAST
@given(chunk_problem())
def test_prefix_plus_chunk_by_merge_equals_reference(problem):
    q, k, v, ctx_len = problem
    out, lse = prefix_chunk_attention(q, k[:ctx_len], v[:ctx_len], k[ctx_len:], v[ctx_len:], return_lse=True)
    want, want_lse = reference_attention(q, k, v, ctx_len=ctx_len, return_lse=True)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse, want_lse, atol=ATOL, rtol=RTOL)


def test_merge_with_an_empty_part_returns_the_other_part():
    q, k, v = torch.randn(3, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    out_b, lse_b = reference_attention(q, k, v, causal=False, return_lse=True)
    out_a, lse_a = reference_attention(q, k[:0], v[:0], causal=False, return_lse=True)
    assert torch.isneginf(lse_a).all() and (out_a == 0).all()
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, out_b, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse, lse_b, atol=ATOL, rtol=RTOL)
    both_empty, lse_e = merge_attn_states(out_a, lse_a, out_a, lse_a)
    assert (both_empty == 0).all() and torch.isneginf(lse_e).all()


def test_merge_is_stable_for_large_scores():
    """Scores of ~1000 overflow exp() in fp32; the merge must work in log space."""
    q = torch.randn(2, 3, 4) * 60
    k = torch.randn(6, 3, 4) * 60
    v = torch.randn(6, 3, 4)
    out_u = reference_attention(q, k, v, causal=False)
    a = reference_attention(q, k[:3], v[:3], causal=False, return_lse=True)
    b = reference_attention(q, k[3:], v[3:], causal=False, return_lse=True)
    out, lse = merge_attn_states(*a, *b)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, out_u, atol=1e-4, rtol=1e-4)


@FAST
@given(st.integers(0, 12), st.integers(0, 12))
def test_causal_mask_is_the_shifted_rectangle(query_len, ctx_len):
    m = causal_mask(query_len, ctx_len)
    assert m.shape == (query_len, ctx_len + query_len) and m.dtype == torch.bool
    for i in range(query_len):
        assert m[i].sum() == ctx_len + i + 1  # the whole prefix, then itself and earlier chunk tokens
        assert m[i, : ctx_len + i + 1].all()
    if query_len:
        assert m[:, :ctx_len].all()  # every query sees the whole prefix
        assert torch.equal(m[:, ctx_len:], torch.ones(query_len, query_len, dtype=torch.bool).tril())


def test_bad_inputs_raise_value_errors():
    q, k, v = torch.randn(3, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match="query_len"):
        causal_mask(-1, 0)
    with pytest.raises(ValueError, match="3-D"):
        reference_attention(q[0], k, v)
    with pytest.raises(ValueError, match="same shape"):
        reference_attention(q, k, v[:4])
    with pytest.raises(ValueError, match="multiple"):
        reference_attention(torch.randn(3, 3, 8), k, v)
    with pytest.raises(ValueError, match="num_k == ctx_len"):
        reference_attention(q, k, v, ctx_len=1)
    with pytest.raises(ValueError, match="head_dim"):
        reference_attention(torch.randn(3, 4, 4), k, v)
    with pytest.raises(ValueError, match="shapes"):
        merge_attn_states(q, torch.zeros(3, 4), q[:2], torch.zeros(2, 4))
    with pytest.raises(ValueError, match="one row per query"):
        prefix_chunk_attention(q, k[:2], v[:2], k[2:4], v[2:4])
