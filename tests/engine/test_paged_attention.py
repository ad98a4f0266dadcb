"""The paged KV cache tensors, slot mapping, reshape_and_cache, gather, paged attention, and the real model on it."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.attention.paged import (PagedAttention, allocate_kv_caches, build_attention_metadata,
                                     compute_slot_mapping, forward_paged, gather_kv, make_block_table,
                                     paged_attention_torch, reshape_and_cache_torch)
from minillm.attention.reference import reference_attention
from minillm.config import LlamaConfig
from minillm.core import KVCacheManager
from minillm.request import Request


def test_slot_mapping_and_block_table():
    # Blocks 7, 2, 5 with block_size 4: position 5 is offset 1 of the second block, block 2 -> slot 2*4+1 = 9.
    assert compute_slot_mapping([7, 2, 5], 3, 9, 4).tolist() == [31, 8, 9, 10, 11, 20]
    with pytest.raises(ValueError, match="only 3 blocks"):
        compute_slot_mapping([7, 2, 5], 0, 13, 4)
    for bad in (0, -4):
        with pytest.raises(ValueError, match=rf"block_size must be >= 1.*got {bad}"):
            compute_slot_mapping([7, 2, 5], 0, 3, bad)
    t = make_block_table([[3, 1], [4], []])
    assert t.dtype == torch.int32 and t.tolist() == [[3, 1], [4, 0], [0, 0]]


def test_allocate_kv_caches_shapes():
    cfg = LlamaConfig(num_hidden_layers=2)
    caches = allocate_kv_caches(cfg, num_blocks=5, block_size=16)
    assert len(caches) == 2 and caches[0][0].shape == (5, 16, 3, 64) and caches[0][1].dtype == torch.float32
    total = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in caches)
    assert total == 5 * 16 * cfg.kv_cache_bytes_per_token(4)
    with pytest.raises(ValueError, match="null block"):
        allocate_kv_caches(cfg, 1, 16)


def test_reshape_and_cache_writes_slots_and_skips_padding():
    kc, vc = torch.zeros(3, 2, 1, 2), torch.zeros(3, 2, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    reshape_and_cache_torch(k, -k, kc, vc, torch.tensor([5, -1, 0]))
    assert kc[2, 1].tolist() == [[0.0, 1.0]] and kc[0, 0].tolist() == [[4.0, 5.0]]
    assert vc[2, 1].tolist() == [[-0.0, -1.0]]
    assert int((kc != 0).sum()) == 3  # the padded token wrote nothing (its row [2, 3] is nowhere)
    with pytest.raises(ValueError, match="beyond the cache"):
        reshape_and_cache_torch(k, k, kc, vc, torch.tensor([6, 0, 1]))
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache_torch(k, k, kc, vc, torch.tensor([0, 1]))


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6)), min_size=1, max_size=4),
       block_size=st.sampled_from([1, 2, 4, 16]), seed=st.integers(0, 2**16))
def test_paged_attention_matches_contiguous_reference(lens, block_size, seed):
    """Scattered blocks, varlen chunks with context, GQA: paged attention == reference attention on contiguous K/V.

    Tolerance 0: both paths call reference_attention on the very same K/V values in the same order, only fetched
    differently, so any difference at all is a wrong slot.
    """
    g = torch.Generator().manual_seed(seed)
    ctx, new = [c for c, _ in lens], [n for _, n in lens]
    seqs = [c + n for c, n in lens]
    need = [-(-s // block_size) for s in seqs]
    num_blocks = 1 + sum(need) + 2
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 is the null block
    block_ids, i = [], 0
    for n in need:
        block_ids.append(perm[i:i + n])
        i += n
    kc = torch.full((num_blocks, block_size, 2, 8), float("nan"))  # unwritten slots are NaN: reading one shows
    vc = kc.clone()
    ks = [torch.randn(s, 2, 8, generator=g) for s in seqs]
    vs = [torch.randn(s, 2, 8, generator=g) for s in seqs]
    for ids, c, k, v in zip(block_ids, ctx, ks, vs):  # the cached contexts, as earlier steps would have left them
        reshape_and_cache_torch(k[:c], v[:c], kc, vc, compute_slot_mapping(ids, 0, c, block_size))
    md = build_attention_metadata(block_ids, ctx, new, block_size)
    q = torch.randn(sum(new), 4, 8, generator=g)
    attn = PagedAttention([(kc, vc)], md)
    out = attn.forward(0, q, torch.cat([k[c:] for k, c in zip(ks, ctx)]), torch.cat([v[c:] for v, c in zip(vs, ctx)]))
    qsl = md.query_start_loc.tolist()
    for r in range(len(lens)):
        want = reference_attention(q[qsl[r]:qsl[r + 1]], ks[r], vs[r])
        assert torch.equal(out[qsl[r]:qsl[r + 1]], want)
        gk, gv = gather_kv(kc, vc, block_ids[r], seqs[r])
        assert torch.equal(gk, ks[r]) and torch.equal(gv, vs[r])


def test_paged_attention_rejects_bad_input():
    cfg = LlamaConfig(num_hidden_layers=1)
    caches = allocate_kv_caches(cfg, 4, 2)
    md = build_attention_metadata([[1]], [0], [2], 2)
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        PagedAttention(caches, md, backend="cuda")
    attn = PagedAttention(caches, md)
    q, k = torch.zeros(2, 9, 64), torch.zeros(2, 3, 64)
    with pytest.raises(ValueError, match="layer_idx 1 out of range"):
        attn.forward(1, q, k, k)
    with pytest.raises(ValueError, match="3 tokens"):
        attn.forward(0, torch.zeros(3, 9, 64), torch.zeros(3, 3, 64), torch.zeros(3, 3, 64))
    with pytest.raises(ValueError, match="num_new_tokens must be >= 1"):
        build_attention_metadata([[1]], [0], [0], 2)
    with pytest.raises(ValueError, match="same non-zero number"):
        build_attention_metadata([[1]], [0, 1], [1], 2)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention_torch(q, *caches[0], torch.tensor([0, 2]), torch.tensor([2, 2]), torch.tensor([[1]]))


# -- the real model ---------------------------------------------------------------------------------------------------
# Tolerance for logits on the real model (fp32, values of magnitude ~10-30): 1e-3 absolute. The attention math is the
# same reference code on the same K/V; what differs is only how many rows the linear layers see at once (a batch of two
# requests vs one), and fp32 matmuls may sum in a different order for a different row count. Measured here: 5.5e-5.
LOGITS_ATOL = 1e-3


def _contiguous_logits(model, ids):
    """Logits of every position of ``ids``, prefilled in one pass through chapter 1's contiguous cache."""
    cache = model.new_kv_cache(len(ids))
    return model.compute_logits(model(torch.tensor(ids), attn=cache))


@pytest.mark.slow
@torch.inference_mode()
def test_paged_prefill_and_decode_match_contiguous_cache(model, tokenizer):
    """Chunked paged prefill + greedy decode of two requests batched together == the contiguous cache, per request.

    Request B shares A's first 16 tokens (prefix caching: they are read from A's blocks, not recomputed).
    """
    import minillm

    bs = 4
    a_ids = minillm.chat_prompt_ids(tokenizer, "What is the capital of France?")
    b_ids = a_ids[:16] + tokenizer.encode(" Tell me about Rome.", add_special_tokens=False)
    mgr = KVCacheManager(num_blocks=40, block_size=bs)
    caches = allocate_kv_caches(model.config, 40, bs)
    a, b = Request("a", a_ids), Request("b", b_ids)

    # Step 1: A alone, first chunk of 10 tokens (a chunked prefill ending mid-block).
    mgr.allocate_slots(a, 10)
    forward_paged(model, caches, [a.all_token_ids], [mgr.get_block_ids("a")], [0], [10], bs)
    a.num_computed_tokens = 10
    # Step 2: the rest of A, and B with its prefix-cache hit, in one varlen batch.
    hit_blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 8  # A's blocks 0-1 are full and cached; block 2 (tokens 8-11) is only partly computed
    mgr.allocate_slots(a, a.num_tokens - 10)
    mgr.allocate_slots(b, b.num_tokens - hit, hit, hit_blocks)
    mgr.record_prefix_cache_stats(b, hit)  # admitted (the scheduler's job)
    assert mgr.get_block_ids("b")[:2] == mgr.get_block_ids("a")[:2]
    reqs = [a, b]
    comp, new = [10, hit], [a.num_tokens - 10, b.num_tokens - hit]
    hidden = forward_paged(model, caches, [r.all_token_ids for r in reqs], [mgr.get_block_ids(r.request_id)
                                                                           for r in reqs], comp, new, bs)
    last = torch.tensor([new[0] - 1, new[0] + new[1] - 1])
    step_logits = [model.compute_logits(hidden[last])]
    for r in reqs:
        r.num_computed_tokens = r.num_tokens
    # Decode 5 tokens for both, batched.
    for _ in range(5):
        for r, lg in zip(reqs, step_logits[-1]):
            r.append_output_token_ids(int(lg.argmax()))
            assert mgr.allocate_slots(r, 1) is not None
        hidden = forward_paged(model, caches, [r.all_token_ids for r in reqs],
                               [mgr.get_block_ids(r.request_id) for r in reqs],
                               [r.num_computed_tokens for r in reqs], [1, 1], bs)
        step_logits.append(model.compute_logits(hidden))
        for r in reqs:
            r.num_computed_tokens += 1

    for j, r in enumerate(reqs):
        full = _contiguous_logits(model, r.all_token_ids)
        n_prompt = r.num_prompt_tokens
        want = full[n_prompt - 1: n_prompt - 1 + len(step_logits)]
        got = torch.stack([lg[j] for lg in step_logits])
        err = (got - want).abs().max().item()
        assert err < LOGITS_ATOL, f"request {r.request_id}: max |logit diff| {err:.2e}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert mgr.prefix_cache_stats.hits == 8
    for r in reqs:
        mgr.free(r)
    assert mgr.num_free_blocks == 39
