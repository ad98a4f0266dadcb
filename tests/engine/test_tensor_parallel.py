"""Tensor parallelism (chapter 9): the parallel layers, a simulated TP forward in one process, and real gloo ranks.

Tolerances (fp32) for "equal to the single-process model". A column-parallel matmul computes the same dot products
as the full one but over a differently shaped matrix (BLAS may block it differently), and a row-parallel layer
splits each dot product into ``tp_size`` partial sums added by the all-reduce: the same numbers added in another
order, a few fp32 ulps per op, carried through every layer. Measured max |diff| of the last-token logits in the
real gloo runs: tiny random model 7.6e-6 (2 ranks) and 2.9e-6 (4 ranks) on the prompt below, at most 1.1e-5 over 5
other random prompts; SmolLM2 on 3 ranks 3.1e-5 on the prompt below (logits up to ~29), at most 4.8e-5 over 3 other
chat prompts. The tolerances are about 10x the worst: ``ATOL_TINY = 1e-4``, ``ATOL_SMOLLM = 5e-4``. A head paired with
the wrong KV head, a missing all-reduce or swapped shards move them by more than 1
(``test_typical_tp_mistakes_are_far_outside_the_tolerance``).

Process tests share one executor of 4 worker processes (module fixture) serving SmolLM2 and the tiny model; 2- and
3-rank jobs use the sub-group of the first ranks.
"""
from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minillm import LlamaConfig, LlamaForCausalLM
from minillm.distributed import (JobExecutor, TensorParallelGroup, expected_all_gather_bytes,
                                 expected_all_reduce_bytes, expected_num_all_reduces, run_tensor_parallel,
                                 simulate_all_gather, simulate_all_reduce)
from minillm.model.llama_tp import (TensorParallelLlamaForCausalLM, check_tensor_parallel_config, shard_summary,
                                    simulate_tensor_parallel_forward, simulate_tensor_parallel_logits)
from minillm.model.parallel_layers import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                           QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                           check_head_split)

ATOL_TINY = 1e-4  # measured <= 1.1e-5 (2 and 4 ranks); see the module docstring
ATOL_SMOLLM = 5e-4  # measured <= 4.8e-5 (3 ranks)
SMOLLM = LlamaConfig()  # SmolLM2-135M's shape: the defaults
TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
# Untied head, a vocabulary 4 ranks cannot split evenly (63 rows each, 2 padding rows on the last), 1 KV head.
TINY_UNTIED = LlamaConfig(vocab_size=250, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=12, max_position_embeddings=512,
                          tie_word_embeddings=False)


def _random_model(config: LlamaConfig, seed: int = 1234) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1: make them random too, so a rank using the wrong norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _linear(out_f: int, in_f: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


# --------------------------------------------------------------------------------------------------------------
# the layers, in one process
# --------------------------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(tp=st.integers(1, 5), out_per=st.integers(1, 6), in_f=st.integers(1, 12), n=st.integers(1, 4),
       bias=st.booleans())
def test_column_parallel_shards_concatenate_to_the_full_output(tp, out_per, in_f, n, bias):
    full = _linear(out_per * tp, in_f, bias, seed=tp * 100 + in_f)
    x = torch.randn(n, in_f)
    shards = [ColumnParallelLinear(full, r, tp) for r in range(tp)]
    assert all(s.weight.shape == (out_per, in_f) for s in shards)
    assert [(s.start, s.end) for s in shards] == [(r * out_per, (r + 1) * out_per) for r in range(tp)]
    torch.testing.assert_close(torch.cat([s(x) for s in shards], dim=-1), full(x), atol=1e-5, rtol=0)


@settings(max_examples=60, deadline=None)
@given(tp=st.integers(1, 5), in_per=st.integers(1, 6), out_f=st.integers(1, 12), n=st.integers(1, 4),
       bias=st.booleans())
def test_row_parallel_partials_sum_to_the_full_output(tp, in_per, out_f, n, bias):
    full = _linear(out_f, in_per * tp, bias, seed=tp * 100 + out_f)
    x = torch.randn(n, in_per * tp)
    shards = [RowParallelLinear(full, r, tp) for r in range(tp)]
    assert all(s.weight.shape == (out_f, in_per) for s in shards)
    partials = [s.partial(x[:, s.start:s.end]) for s in shards]
    torch.testing.assert_close(simulate_all_reduce(partials), full(x), atol=1e-5, rtol=0)
    # The bias is added by rank 0 only, so the sum counts it once.
    assert [s.bias is not None for s in shards] == [bias and r == 0 for r in range(tp)]


def test_row_parallel_needs_its_input_slice_and_a_group():
    full = _linear(6, 8, False, seed=0)
    shard = RowParallelLinear(full, 1, 2)
    with pytest.raises(ValueError, match=r"input slice of 4 features, got 8 \(pass x\[\.\.\., 4:8\]"):
        shard.partial(torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="no TensorParallelGroup to all-reduce with"):
        shard(torch.randn(3, 4))
    # One rank: the partial is the whole output, no group needed (as vLLM skips the all-reduce on one GPU).
    torch.testing.assert_close(RowParallelLinear(full, 0, 1)(torch.ones(2, 8)), full(torch.ones(2, 8)))


def test_merged_column_parallel_pairs_gate_and_up_features_on_each_rank():
    gate, up = _linear(12, 5, False, seed=1), _linear(12, 5, False, seed=2)
    x = torch.randn(3, 5)
    for tp in (1, 2, 3, 4):
        for r in range(tp):
            g, u = (m := MergedColumnParallelLinear([gate, up], r, tp)).split(m(x))
            sl = slice(r * 12 // tp, (r + 1) * 12 // tp)
            torch.testing.assert_close(g, gate(x)[:, sl])
            torch.testing.assert_close(u, up(x)[:, sl])


@settings(max_examples=60, deadline=None)
@given(tp=st.integers(1, 6), vocab=st.integers(1, 40), hidden=st.integers(1, 6))
def test_vocab_parallel_embedding_partials_sum_to_the_full_lookup(tp, vocab, hidden):
    torch.manual_seed(vocab)
    full = nn.Embedding(vocab, hidden)
    ids = torch.arange(vocab).flip(0)
    shards = [VocabParallelEmbedding(full, r, tp) for r in range(tp)]
    rows = -(-vocab // tp)
    assert all(s.weight.shape == (rows, hidden) for s in shards)  # equal shapes: the last rank is padded
    # Every id is held by exactly one rank, in order, and the ranges cover the vocabulary.
    assert [s.start for s in shards] == [min(r * rows, vocab) for r in range(tp)]
    assert shards[-1].end == vocab
    partials = [s.partial(ids) for s in shards]
    owners = torch.stack([(p != 0).any(-1) for p in partials])  # [tp, n]: which rank wrote each id
    assert owners.sum(0).le(1).all()
    torch.testing.assert_close(simulate_all_reduce(partials), full(ids), atol=0, rtol=0)


@pytest.mark.parametrize("vocab, tp", [(256, 4), (250, 4), (49152, 3), (7, 3)])
def test_parallel_lm_head_slices_concatenate_to_the_full_logits(vocab, tp):
    torch.manual_seed(0)
    emb = nn.Embedding(vocab, 8)
    hidden = torch.randn(3, 8)
    full_logits = hidden @ emb.weight.T
    embs = [VocabParallelEmbedding(emb, r, tp) for r in range(tp)]
    heads = [ParallelLMHead(e, r, tp) for r, e in enumerate(embs)]
    # Tied: the head *is* the embedding's shard (no second copy), as the full SmolLM2 ties lm_head to embed_tokens.
    assert all(h.weight is e.weight for h, e in zip(heads, embs))
    got = simulate_all_gather([h.partial(hidden) for h in heads], dim=-1)[:, :vocab]
    torch.testing.assert_close(got, full_logits.float(), atol=1e-5, rtol=0)
    untied = [ParallelLMHead(emb.weight, r, tp) for r in range(tp)]
    torch.testing.assert_close(simulate_all_gather([h.partial(hidden) for h in untied])[:, :vocab], got)
    with pytest.raises(ValueError, match="cannot tie rank 0/2"):
        ParallelLMHead(embs[0], 0, 2) if tp != 2 else ParallelLMHead(embs[1], 0, 2)


# (num_heads, num_kv_heads, tp_size): split KV heads, one KV head per rank, and replicated KV heads.
HEAD_SPLITS = [(4, 2, 1), (4, 2, 2), (4, 2, 4), (9, 3, 3), (9, 3, 9), (8, 1, 4), (8, 4, 2), (8, 2, 8), (12, 4, 4),
               (12, 2, 6)]


@pytest.mark.parametrize("num_heads, num_kv_heads, tp", HEAD_SPLITS)
def test_qkv_split_keeps_every_query_head_with_its_kv_head(num_heads, num_kv_heads, tp):
    d, hidden = 4, 10
    q = _linear(num_heads * d, hidden, False, seed=1)
    k = _linear(num_kv_heads * d, hidden, False, seed=2)
    v = _linear(num_kv_heads * d, hidden, False, seed=3)
    x = torch.randn(5, hidden)
    group = num_heads // num_kv_heads
    full_q = q(x).view(5, num_heads, d)
    full_k, full_v = k(x).view(5, num_kv_heads, d), v(x).view(5, num_kv_heads, d)
    shards = [QKVParallelLinear(q, k, v, num_heads, num_kv_heads, d, r, tp) for r in range(tp)]
    assert sorted(h for s in shards for h in s.query_heads) == list(range(num_heads))  # each query head once
    replicas = max(1, tp // num_kv_heads)
    for r, s in enumerate(shards):
        assert s.num_kv_head_replicas == replicas
        if tp > num_kv_heads:  # replicated: rank r holds KV head r // replicas, like vLLM's QKVParallelLinear
            assert s.kv_heads == [r // replicas]
        for j, h in enumerate(s.query_heads):
            # The KV head that query head h uses in the full model is on this rank, at the local index the
            # attention will read (local query j -> local KV j // local group).
            assert s.kv_heads[s.kv_head_of_local_query[j]] == h // group
            assert s.kv_head_of_local_query[j] == j // (s.num_heads // s.num_kv_heads)
        lq, lk, lv = s(x)
        torch.testing.assert_close(lq.view(5, s.num_heads, d), full_q[:, s.query_heads], atol=1e-6, rtol=0)
        torch.testing.assert_close(lk.view(5, s.num_kv_heads, d), full_k[:, s.kv_heads], atol=1e-6, rtol=0)
        torch.testing.assert_close(lv.view(5, s.num_kv_heads, d), full_v[:, s.kv_heads], atol=1e-6, rtol=0)
    held = [h for s in shards for h in s.kv_heads]
    assert sorted(set(held)) == list(range(num_kv_heads)) and all(held.count(h) == replicas for h in set(held))


@pytest.mark.parametrize("num_heads, num_kv_heads, tp, match", [
    # vLLM's own message (vllm/config/model.py, ModelConfig.verify_with_parallel_config): SmolLM2 on 2 ranks.
    (9, 3, 2, r"Total number of attention heads \(9\) must be divisible by tensor parallel size \(2\)\."),
    (9, 3, 4, r"Total number of attention heads \(9\) must be divisible by tensor parallel size \(4\)\."),
    (6, 3, 2, r"Total number of KV heads \(3\) must be divisible by tensor parallel size \(2\)"),
    (12, 4, 6, r"Tensor parallel size \(6\) must be a multiple of the number of KV heads \(4\)"),
    (4, 2, 0, "tp_size must be an int >= 1, got 0"),
    (4, 2, True, "tp_size must be an int >= 1, got True"),
    (4, 2, 2.0, "tp_size must be an int >= 1, got 2.0"),
])
def test_impossible_head_splits_are_value_errors(num_heads, num_kv_heads, tp, match):
    with pytest.raises(ValueError, match=match):
        check_head_split(num_heads, num_kv_heads, tp)
    if isinstance(tp, int) and not isinstance(tp, bool) and tp > 0:
        with pytest.raises(ValueError, match=match):
            QKVParallelLinear(_linear(num_heads * 4, 8, False, 0), _linear(num_kv_heads * 4, 8, False, 0),
                              _linear(num_kv_heads * 4, 8, False, 0), num_heads, num_kv_heads, 4, 0, tp)


def test_other_bad_shards_are_value_errors():
    full = _linear(6, 9, False, seed=0)
    with pytest.raises(ValueError, match=r"out_features \(6\) must be divisible by tensor parallel size \(4\)"):
        ColumnParallelLinear(full, 0, 4)
    with pytest.raises(ValueError, match=r"in_features \(9\) must be divisible by tensor parallel size \(2\)"):
        RowParallelLinear(full, 0, 2)
    with pytest.raises(ValueError, match=r"tp_rank must be an int in \[0, 2\), got 2"):
        ColumnParallelLinear(full, 2, 2)
    with pytest.raises(ValueError, match=r"tp_rank must be an int in \[0, 3\), got -1"):
        VocabParallelEmbedding(nn.Embedding(10, 2), -1, 3)
    with pytest.raises(ValueError, match="tp_size must be an int >= 1, got 0"):
        VocabParallelEmbedding(nn.Embedding(10, 2), 0, 0)
    with pytest.raises(ValueError, match=r"intermediate_size \(1536\) must be divisible by tensor parallel size \(9\)"):
        check_tensor_parallel_config(SMOLLM, 9)
    with pytest.raises(ValueError, match=r"attention heads \(9\) must be divisible by tensor parallel size \(2\)"):
        check_tensor_parallel_config(SMOLLM, 2)
    with pytest.raises(TypeError, match="built from an nn.Linear"):
        ColumnParallelLinear(nn.ReLU(), 0, 1)


def test_one_rank_group_needs_no_communication():
    g = TensorParallelGroup(None)
    assert (g.rank, g.world_size) == (0, 1)
    t = torch.arange(6.0).view(2, 3)
    assert g.all_reduce(t) is t and g.all_gather(t) is t
    assert g.stats() == {"bytes_all_reduced": 0, "num_all_reduces": 0, "bytes_all_gathered": 0,
                         "num_all_gathers": 0, "comm_wait_s": 0.0}
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0, got 0"):
        TensorParallelGroup(None, timeout_s=0)
    with pytest.raises(ValueError, match="at least one partial"):
        simulate_all_reduce([])
    with pytest.raises(ValueError, match="same shape"):
        simulate_all_reduce([torch.zeros(2), torch.zeros(3)])


# --------------------------------------------------------------------------------------------------------------
# a whole TP forward simulated in one process
# --------------------------------------------------------------------------------------------------------------

@torch.inference_mode()
@pytest.mark.parametrize("config, tp_sizes", [(TINY, (1, 2, 4)), (TINY_UNTIED, (1, 2, 4))])
def test_simulated_tensor_parallel_forward_equals_the_full_model(config, tp_sizes):
    model = _random_model(config)
    ids = torch.randint(0, config.vocab_size, (19,), generator=torch.Generator().manual_seed(3))
    ref_hidden = model(ids)
    ref_logits = model.compute_logits(ref_hidden)
    for tp in tp_sizes:
        shards = [TensorParallelLlamaForCausalLM(model, tp_rank=r, tp_size=tp) for r in range(tp)]
        hidden = simulate_tensor_parallel_forward(shards, ids)
        logits = simulate_tensor_parallel_logits(shards, hidden)
        torch.testing.assert_close(hidden, ref_hidden, atol=ATOL_TINY, rtol=0, msg=f"tp={tp}")
        torch.testing.assert_close(logits, ref_logits, atol=ATOL_TINY, rtol=0, msg=f"tp={tp}")
        assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
        # What the summary says each rank holds is what the shard holds.
        for s, summary in zip(shards, shard_summary(config, tp)):
            assert s.param_bytes() == summary.param_bytes
            assert s.model.layers[0].self_attn.qkv_proj.query_heads == summary.query_heads
            assert s.model.layers[0].self_attn.qkv_proj.kv_heads == summary.kv_heads
            shapes = dict(s.named_parameters())
            for name, shape in summary.weights.items():
                assert tuple(shapes[f"{name}.weight"].shape) == shape, name
        assert shard_summary(config, tp)[0].full_param_bytes == sum(p.numel() * 4 for p in model.parameters())
    # A shard of a multi-rank split cannot run on its own: it has nobody to all-reduce with.
    with pytest.raises(RuntimeError, match="no TensorParallelGroup"):
        TensorParallelLlamaForCausalLM(model, tp_rank=0, tp_size=2)(ids)
    # One rank with no group is the plain model.
    torch.testing.assert_close(TensorParallelLlamaForCausalLM(model)(ids), ref_hidden, atol=ATOL_TINY, rtol=0)


def test_typical_tp_mistakes_are_far_outside_the_tolerance():
    """The tolerance has teeth: three typical mistakes, each simulated, move the logits (up to ~74 here) by more than
    1, i.e. 10^4 x ATOL_TINY: two ranks' o_proj shards swapped (heads projected with another rank's columns), a rank
    reading another rank's KV head (GQA grouping broken), one all-reduce left out (rank 0's partial used alone)."""
    model = _random_model(TINY)
    ids = torch.arange(12)

    def shards(tp):
        return [TensorParallelLlamaForCausalLM(model, tp_rank=r, tp_size=tp) for r in range(tp)]

    def max_diff(ranks, forward=simulate_tensor_parallel_forward):
        return (simulate_tensor_parallel_logits(ranks, forward(ranks, ids)) - ref).abs().max().item()

    def forward_missing_one_all_reduce(ranks, input_ids):
        positions = torch.arange(len(input_ids))
        h = simulate_all_reduce([s.embed_partial(input_ids) for s in ranks])
        for i in range(TINY.num_hidden_layers):
            h = h + ranks[0].model.layers[i].attn_partial(positions, h)  # the mistake: no sum over ranks
            h = h + simulate_all_reduce([s.model.layers[i].mlp_partial(h) for s in ranks])
        return ranks[0].model.norm(h)

    with torch.inference_mode():
        ref = model.compute_logits(model(ids))
        swapped = shards(2)
        o0, o1 = (s.model.layers[1].self_attn.o_proj for s in swapped)
        o0.weight, o1.weight = o1.weight, o0.weight
        wrong_kv = shards(4)  # ranks 0, 1 hold KV head 0; ranks 2, 3 KV head 1
        qkv0, qkv2 = (wrong_kv[r].model.layers[0].self_attn.qkv_proj for r in (0, 2))
        q_rows = qkv0.output_sizes_per_partition[0]
        qkv0.weight.data[q_rows:] = qkv2.weight.data[q_rows:]
        diffs = {"swapped o_proj": max_diff(swapped), "wrong KV head": max_diff(wrong_kv),
                 "missing all-reduce": max_diff(shards(2), forward_missing_one_all_reduce)}
    assert all(d > 1.0 for d in diffs.values()), diffs


def test_shard_summary_of_smollm2():
    one, three = (shard_summary(SMOLLM, k) for k in (1, 3))
    assert one[0].param_bytes == one[0].full_param_bytes == 134_515_008 * 4  # SmolLM2-135M: 134.5 M parameters
    assert [s.query_heads for s in three] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [s.kv_heads for s in three] == [[0], [1], [2]]
    assert [s.vocab_range for s in three] == [(0, 16384), (16384, 32768), (32768, 49152)]
    assert three[1].intermediate_range == (512, 1024)
    assert three[0].weights["model.layers.0.self_attn.qkv_proj"] == (5 * 64, 576)  # 3 query + 1 K + 1 V head
    # 3 ranks hold a third each, except the norms (2 per layer + the final one), which every rank holds whole.
    assert 3 * three[0].param_bytes - one[0].param_bytes == 2 * (61 * 576 * 4)
    assert three[0].kv_cache_bytes_per_token * 3 == one[0].kv_cache_bytes_per_token
    # 9 ranks would suit the heads (each KV head replicated on 3 ranks) but not the MLP's 1536 features.
    check_head_split(9, 3, 9)
    with pytest.raises(ValueError, match=r"intermediate_size \(1536\)"):
        shard_summary(SMOLLM, 9)


def test_replicated_kv_heads_stop_shrinking_the_kv_cache():
    one, two, four = (shard_summary(TINY, k) for k in (1, 2, 4))
    assert [s.kv_heads for s in four] == [[0], [0], [1], [1]] and four[0].num_kv_head_replicas == 2
    assert two[0].kv_cache_bytes_per_token == four[0].kv_cache_bytes_per_token == one[0].kv_cache_bytes_per_token // 2


def test_all_reduce_bytes_formula():
    # SmolLM2, 20 tokens, fp32: (1 + 2*30) all-reduces of [20, 576].
    assert expected_num_all_reduces(SMOLLM, 3) == 61
    assert expected_all_reduce_bytes(SMOLLM, 20, 3) == 61 * 20 * 576 * 4 == 2_810_880
    assert expected_all_reduce_bytes(SMOLLM, 20, 1) == 0  # one rank sends nothing
    assert expected_all_gather_bytes(SMOLLM, 1, 3) == 16384 * 4
    assert expected_all_gather_bytes(TINY_UNTIED, 2, 4) == 2 * 63 * 4
    with pytest.raises(ValueError, match="num_tokens must be an int >= 0, got -1"):
        expected_all_reduce_bytes(SMOLLM, -1, 3)


# --------------------------------------------------------------------------------------------------------------
# real processes, real gloo all-reduces
# --------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp_executor(model):
    """Four worker processes serving SmolLM2 (``"smollm"``) and the tiny random Llama (``"tiny"``); jobs of 2, 3 and
    4 ranks run on the first ranks. Closed (every worker gone) when the module is done."""
    tiny = _random_model(TINY)
    with JobExecutor({"smollm": model, "tiny": tiny}, world_size=4, timeout_s=60.0) as ex:
        yield ex, {"smollm": model, "tiny": tiny}
    assert ex.alive_ranks == []


@torch.inference_mode()
def _reference(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    return model.compute_logits(model(torch.tensor(ids))[-1:])[0]


def _check_run(res, ref: torch.Tensor, config: LlamaConfig, num_tokens: int, tp: int, atol: float) -> None:
    what = f"tp={tp}"
    assert res.tp_size == tp and [r["rank"] for r in res.ranks] == list(range(tp))
    torch.testing.assert_close(res.logits, ref, atol=atol, rtol=0, msg=what)
    assert int(res.logits.argmax()) == int(ref.argmax()), what
    # After the all-gather every rank has the very same logits (gloo's all-reduce gives every rank the same sum).
    assert all(torch.equal(r["logits"], res.logits) for r in res.ranks), what
    summary = shard_summary(config, tp)
    for r, out in enumerate(res.ranks):
        assert out["bytes_all_reduced"] == expected_all_reduce_bytes(config, num_tokens, tp), what
        assert out["num_all_reduces"] == expected_num_all_reduces(config, tp) == 1 + 2 * config.num_hidden_layers
        assert out["bytes_all_gathered"] == expected_all_gather_bytes(config, 1, tp), what
        assert out["num_all_gathers"] == 1
        assert out["param_bytes"] == summary[r].param_bytes, what


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tiny_model_on_2_and_4_ranks_matches_one_process(tp_executor):
    executor, models = tp_executor
    ids = torch.randint(0, TINY.vocab_size, (24,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = _reference(models["tiny"], ids)
    for tp in (2, 4):  # 4 ranks, 2 KV heads: each KV head replicated on 2 ranks
        res = run_tensor_parallel(executor, "tiny", ids, tp_size=tp, return_hidden=True)
        _check_run(res, ref, TINY, len(ids), tp, ATOL_TINY)
        assert res.hidden.shape == (len(ids), TINY.hidden_size)
    one = run_tensor_parallel(executor, "tiny", ids, tp_size=1)
    assert torch.equal(one.logits, ref)  # one rank: the same arithmetic as the full model
    assert one.ranks[0]["bytes_all_reduced"] == 0 and one.ranks[0]["num_all_reduces"] == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_smollm2_on_3_ranks_matches_one_process(tp_executor, tokenizer):
    import minillm

    executor, models = tp_executor
    ids = minillm.chat_prompt_ids(tokenizer, "Tell me about the history of Paris, the capital of France, in a few "
                                             "sentences.")
    ref = _reference(models["smollm"], ids)
    res = run_tensor_parallel(executor, "smollm", ids, tp_size=3)
    _check_run(res, ref, SMOLLM, len(ids), 3, ATOL_SMOLLM)
    assert res.ranks[0]["bytes_all_reduced"] == 61 * len(ids) * 576 * 4


_BAD_RUNS = [
    # (arguments of run_tensor_parallel(executor, ...), what the ValueError must say)
    (dict(model="smollm", tp_size=2),
     r"Total number of attention heads \(9\) must be divisible by tensor parallel size \(2\)\."),
    (dict(model="smollm", tp_size=4), r"attention heads \(9\) must be divisible by tensor parallel size \(4\)"),
    (dict(model="tiny", tp_size=3), r"attention heads \(4\) must be divisible by tensor parallel size \(3\)"),
    (dict(model="tiny", tp_size=5), r"tp_size must be an int in \[1, 4\] \(the executor's world_size\), got 5"),
    (dict(model="tiny", tp_size=0), r"tp_size must be an int in \[1, 4\].*got 0"),
    (dict(model="tiny", tp_size=True), r"tp_size must be an int in \[1, 4\].*got True"),
    (dict(model="llama-70b", tp_size=2), "unknown model 'llama-70b'"),
    (dict(model="tiny", tp_size=2, input_ids=[]), "at least one token"),
    (dict(model="tiny", tp_size=2, input_ids=[1, 256]), r"token ids must be in \[0, 256\).*got 256"),
    (dict(model="tiny", tp_size=2, input_ids=[[1, 2]]), "flat list of int token ids"),
    (dict(model="tiny", tp_size=2, timeout_s=0), "timeout_s must be a finite number of seconds > 0, got 0"),
]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bad_runs_are_refused_in_the_parent_and_the_executor_stays_usable(tp_executor):
    executor, models = tp_executor
    for kwargs in _BAD_RUNS:
        args, match = dict(input_ids=[1, 2, 3]) | kwargs[0], kwargs[1]
        with pytest.raises(ValueError, match=match):
            run_tensor_parallel(executor, **args)
    assert not executor.is_failed and executor.alive_ranks == [0, 1, 2, 3]
    # Still serving.
    ids = [0, TINY.vocab_size - 1, 5]
    res = run_tensor_parallel(executor, "tiny", torch.tensor(ids, dtype=torch.int32), tp_size=2)
    torch.testing.assert_close(res.logits, _reference(models["tiny"], ids), atol=ATOL_TINY, rtol=0)


def _collectives_job(ctx, stall_rank: int | None = None) -> dict:
    """A ``run_job`` job (module-level so workers can import it): the group's collectives on plain tensors,
    or, with ``stall_rank``, that rank sleeping past the timeout while the others all-reduce."""
    group = TensorParallelGroup(ctx.group, timeout_s=ctx.timeout_s)
    if stall_rank is not None:
        if ctx.rank == stall_rank:
            time.sleep(ctx.timeout_s + 60)
        group.all_reduce(torch.ones(4), what="test all-reduce")
    base = torch.arange(6.0).view(2, 3) * (ctx.rank + 1)
    strided = base.T  # [3, 2], not contiguous: reduced through a copy and written back
    summed = group.all_reduce(strided)
    gathered = group.all_gather(torch.full((1, 2), float(ctx.rank)), dim=0)
    return {"summed": summed, "same_object": summed is strided, "gathered": gathered, **group.stats()}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_group_collectives_and_a_stalled_rank_raises_collective_error():
    from minillm.distributed import WorkerError

    with JobExecutor({"tiny": _random_model(TINY)}, world_size=2, timeout_s=30.0) as ex:
        outs = ex.run_job(_collectives_job, world_size=2)
        want = torch.arange(6.0).view(2, 3).T * (1 + 2)
        for r, out in enumerate(outs):
            assert torch.equal(out["summed"], want) and out["same_object"]  # in place, on every rank
            assert torch.equal(out["gathered"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
            assert (out["bytes_all_reduced"], out["num_all_reduces"]) == (6 * 4, 1)
            assert (out["bytes_all_gathered"], out["num_all_gathers"]) == (2 * 4, 1)  # this rank's own slice
        # What no rank could run is refused here, and the executor serves on.
        with pytest.raises(ValueError, match="module-level function"):
            ex.run_job(lambda ctx: ctx.rank)
        with pytest.raises(ValueError, match=r"world_size must be an int in \[1, 2\], got 3"):
            ex.run_job(_collectives_job, world_size=3)
        assert not ex.is_failed and len(ex.run_job(_collectives_job, world_size=1)) == 1
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="rank 0 failed") as info:
            ex.run_job(_collectives_job, world_size=2, kwargs={"stall_rank": 1}, timeout_s=2.0)
        assert "CollectiveError" in str(info.value) and "rank 0: test all-reduce of (4,)" in str(info.value)
        assert time.monotonic() - t0 < 2.0 + 15.0  # the timeout fired; nobody waited for the sleeper
    assert ex.alive_ranks == []
