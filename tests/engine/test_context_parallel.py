"""Context-parallel prefill (chapter 7): splits, the K/V exchanges, and real multi-process runs against one process.

Tolerance for "equal to single-process prefill" (fp32): ``atol = 2e-4`` on logits, final hidden states and last-layer
K/V, plus the same greedy next token. Both computations do the same arithmetic in a different order (matmuls over
fewer rows block differently; the ring merges softmax pieces through their log-sum-exp), so each op differs by a few
fp32 ulps and 30 layers carry that to ~3e-5 on logits of magnitude ~20 (measured worst: 3.4e-5). A wrong causal rule
or a missing K/V block changes them by O(1).

Process tests share one set of 4 worker processes (module fixture; 2-rank runs use the sub-group of ranks 0-1) and
run in one xdist group, because each spawn costs seconds (every worker imports torch).
"""
from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import LlamaConfig, LlamaForCausalLM
from minillm.distributed import (STRATEGIES, ContextParallelAttention, ContextParallelError, ContextParallelExecutor,
                                 expected_bytes_per_layer, make_split)

ATOL = 2e-4
TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def _tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(1234)
    return LlamaForCausalLM(TINY).eval()


# --------------------------------------------------------------------------------------------------------------
# splits and formulas (in-process, fast)
# --------------------------------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(num_tokens=st.integers(1, 300), world_size=st.integers(1, 8), kind=st.sampled_from(["plain", "zigzag"]))
def test_split_covers_every_position_once(num_tokens, world_size, kind):
    pieces = world_size if kind == "plain" else 2 * world_size
    if num_tokens < pieces:
        with pytest.raises(ValueError, match="needs at least"):
            make_split(num_tokens, world_size, kind)
        return
    split = make_split(num_tokens, world_size, kind)
    allpos = torch.cat([split.positions(r) for r in range(world_size)])
    assert sorted(allpos.tolist()) == list(range(num_tokens))
    sizes = [split.num_local_tokens(r) for r in range(world_size)]
    assert max(sizes) - min(sizes) <= (1 if kind == "plain" else 2)
    for r in range(world_size):
        pos = split.positions(r)
        assert torch.all(pos[1:] > pos[:-1])  # local rows are in increasing position order
    assert (num_tokens - 1) in split.positions(split.last_token_rank).tolist()
    # Computed scores >= causal pairs (the diagonal squares include their masked half); equal totals to a full
    # prefill's causal pairs.
    assert all(split.attention_score_entries(r) >= split.causal_pairs(r) for r in range(world_size))
    assert sum(split.causal_pairs(r) for r in range(world_size)) == num_tokens * (num_tokens + 1) // 2


def test_zigzag_takes_pieces_r_and_2n_minus_1_minus_r():
    split = make_split(16, 4, "zigzag")  # 8 pieces of 2
    assert [split.positions(r).tolist() for r in range(4)] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                                               [6, 7, 8, 9]]
    assert split.last_token_rank == 0
    assert make_split(16, 4, "plain").last_token_rank == 3


def test_zigzag_balances_attention_work_exactly_when_pieces_are_equal():
    n, world = 1024, 4
    plain = [make_split(n, world, "plain").attention_score_entries(r) for r in range(world)]
    zig = [make_split(n, world, "zigzag").attention_score_entries(r) for r in range(world)]
    c = n // world
    assert plain == [c * c * (r + 1) for r in range(world)]  # rank r: c queries x (r+1)c keys
    assert len(set(zig)) == 1 and zig[0] == (c // 2) ** 2 * (2 * world + 1)
    assert max(plain) / min(plain) == world


def test_expected_bytes_formula():
    # 4 ranks of 8 tokens, 3 KV heads x 64 dims, fp32: one token's K+V is 2*3*64*4 = 1536 bytes.
    assert expected_bytes_per_layer("allgather", [8] * 4, 0, 3, 64) == 3 * 8 * 1536
    assert expected_bytes_per_layer("ring", [8] * 4, 2, 3, 64) == 3 * 8 * 1536
    # Uneven blocks: all-gather pads to the largest; the ring sends all blocks but the next rank's.
    assert expected_bytes_per_layer("allgather", [3, 2], 1, 1, 1, 1) == 1 * 3 * 2
    assert expected_bytes_per_layer("ring", [3, 2, 2], 0, 1, 1, 1) == (3 + 2) * 2
    with pytest.raises(ValueError, match="strategy"):
        expected_bytes_per_layer("broadcast", [4, 4], 0, 1, 1)


def test_bad_strategy_is_a_value_error():
    with pytest.raises(ValueError, match="strategy"):
        ContextParallelAttention(make_split(8, 2), None, 2, strategy="tree")
    with pytest.raises(ValueError, match="split kind"):
        make_split(8, 2, "striped")


# --------------------------------------------------------------------------------------------------------------
# real processes
# --------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cp(model):
    """Four worker processes serving SmolLM2 (``"smollm"``) and a tiny random Llama (``"tiny"``)."""
    tiny = _tiny_model()
    with ContextParallelExecutor({"smollm": model, "tiny": tiny}, world_size=4, timeout_s=60.0) as ex:
        yield ex, {"smollm": model, "tiny": tiny}


@torch.inference_mode()
def _single_process(model, ids):
    cache = model.new_kv_cache(len(ids))
    hidden = model(ids, attn=cache)
    last = model.config.num_hidden_layers - 1
    return model.compute_logits(hidden[-1:])[0], hidden, torch.stack([cache.keys(last), cache.values(last)])


@pytest.mark.slow
@pytest.mark.xdist_group("context_parallel")
@pytest.mark.parametrize("name", ["tiny", "smollm"])
def test_matches_single_process_prefill(cp, name, tokenizer):
    executor, models = cp
    model = models[name]
    if name == "smollm":
        import minillm

        ids = torch.tensor(minillm.chat_prompt_ids(
            tokenizer, "Tell me about the history of Paris, the capital of France, in a few sentences.")[:45])
    else:
        ids = torch.randint(0, TINY.vocab_size, (45,), generator=torch.Generator().manual_seed(7))
    ref_logits, ref_hidden, ref_kv = _single_process(model, ids)
    cfg = model.config
    for world in (2, 4):
        for strategy in STRATEGIES:
            for kind in ("plain", "zigzag"):
                what = f"{name} world={world} {strategy} {kind}"
                res = executor.prefill(name, ids, world_size=world, strategy=strategy, split=kind)
                split = res.split
                assert res.logits.shape == (cfg.vocab_size,)
                torch.testing.assert_close(res.logits, ref_logits, atol=ATOL, rtol=0, msg=what)
                assert int(res.logits.argmax()) == int(ref_logits.argmax()), what
                torch.testing.assert_close(res.hidden_states(), ref_hidden, atol=ATOL, rtol=0, msg=what)
                torch.testing.assert_close(res.last_layer_kv(), ref_kv, atol=ATOL, rtol=0, msg=what)
                # Only the rank holding the last position computes logits.
                assert [r.logits is not None for r in res.ranks] == [r == split.last_token_rank
                                                                     for r in range(world)], what
                sizes = [split.num_local_tokens(r) for r in range(world)]
                for r, out in enumerate(res.ranks):
                    want = expected_bytes_per_layer(strategy, sizes, r, cfg.num_key_value_heads, cfg.head_dim)
                    assert out.bytes_sent == [want] * cfg.num_hidden_layers, what
                    assert out.score_entries == [split.attention_score_entries(r)] * cfg.num_hidden_layers, what


@pytest.mark.slow
@pytest.mark.xdist_group("context_parallel")
def test_zigzag_evens_out_work_per_rank(cp):
    executor, _ = cp
    ids = torch.randint(0, 49152, (256,), generator=torch.Generator().manual_seed(0))
    imbalance = {}
    for kind in ("plain", "zigzag"):
        res = executor.prefill("smollm", ids, strategy="allgather", split=kind)
        flops = [4 * 9 * 64 * sum(r.score_entries) for r in res.ranks]  # counted in the run
        cpu = [r.attn_cpu_s for r in res.ranks]  # measured in each rank (thread CPU time)
        imbalance[kind] = (max(flops) / (sum(flops) / 4), max(cpu) / (sum(cpu) / 4))
    assert imbalance["plain"][0] == pytest.approx(1.6)  # rank 3 does 4 of the 10 equal shares
    assert imbalance["zigzag"][0] == pytest.approx(1.0)
    # Measured time is noisy on shared cores: only ask that zigzag be more even than plain.
    assert imbalance["zigzag"][1] < imbalance["plain"][1], imbalance


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), "world_size must be an int >= 1, got 0"),
    (dict(world_size=True), "world_size must be an int >= 1, got True"),
    (dict(timeout_s=0), "timeout_s must be a finite number of seconds > 0, got 0"),
    (dict(start_timeout_s=float("inf")), "start_timeout_s must be a finite number"),
])
def test_executor_rejects_bad_arguments_before_starting_workers(kwargs, match):
    args = dict(world_size=2) | kwargs
    with pytest.raises(ValueError, match=match):
        ContextParallelExecutor({"tiny": _tiny_model()}, **args)


_IDS = list(range(16))
_BAD_PREFILLS = [
    # (arguments of prefill("tiny", ...), what the ValueError must say)
    (dict(input_ids=_IDS, world_size=5), r"world_size must be an int in \[1, 4\], got 5"),
    (dict(input_ids=_IDS, world_size=0), r"world_size must be an int in \[1, 4\], got 0"),
    (dict(input_ids=list(range(5)), world_size=4, split="zigzag"), "needs at least 8 tokens"),
    (dict(input_ids=[]), "needs at least 4 tokens"),
    (dict(input_ids=_IDS, split="striped"), "split kind"),
    (dict(input_ids=_IDS, strategy="tree"), "strategy"),
    (dict(input_ids=_IDS[:-1] + [TINY.vocab_size]), r"token ids must be in \[0, 256\).*got 256"),
    (dict(input_ids=[-1] + _IDS[1:]), r"token ids must be in \[0, 256\).*got -1"),
    (dict(input_ids=torch.full((16,), 10**6)), r"token ids must be in \[0, 256\).*got 1000000"),
    (dict(input_ids=torch.zeros(2, 8, dtype=torch.long)), r"1-D tensor \[num_tokens\], got shape \(2, 8\)"),
    (dict(input_ids=[[1, 2], [3, 4]] * 4), r"flat list of int token ids.*\[1, 2\]"),
    (dict(input_ids=torch.zeros(16)), "integer token ids, got dtype torch.float32"),
    (dict(input_ids=[1.0] * 16), "flat list of int token ids.*1.0"),
    (dict(input_ids=[True] * 16), "flat list of int token ids.*True"),
    (dict(input_ids="the prompt as text"), "1-D integer tensor or a list of ints, got str"),
    (dict(input_ids=_IDS, timeout_s=0), "timeout_s must be a finite number of seconds > 0, got 0"),
    (dict(input_ids=_IDS, timeout_s=float("nan")), "timeout_s must be a finite number of seconds > 0, got nan"),
    (dict(input_ids=_IDS, fail_rank=4), r"fail_rank must be None or an int in \[0, 4\), got 4"),
    (dict(input_ids=_IDS, world_size=2, fail_rank=2), r"fail_rank must be None or an int in \[0, 2\), got 2"),
    (dict(input_ids=_IDS, fail_rank=-1), "fail_rank must be None or an int"),
    (dict(input_ids=_IDS, fail_rank=0, fail_at_layer=3), r"fail_at_layer must be an int in \[0, 3\), got 3"),
    (dict(input_ids=_IDS, fail_rank=0, fail_mode="crash"), "fail_mode must be 'raise' or 'hang'"),
]


@pytest.mark.slow
@pytest.mark.xdist_group("context_parallel")
def test_prefill_rejects_bad_arguments(cp):
    """Every bad argument is a ValueError raised in the caller before anything is sent: the workers never see it,
    and the executor stays open and usable (a worker-side failure would have closed it)."""
    executor, models = cp
    for kwargs, match in _BAD_PREFILLS:
        with pytest.raises(ValueError, match=match):
            executor.prefill("tiny", **kwargs)
    with pytest.raises(ValueError, match="unknown model 'llama-70b'"):
        executor.prefill("llama-70b", _IDS)
    assert not executor.is_failed and executor.alive_ranks == [0, 1, 2, 3]
    # Still serving, and the edges of the vocabulary are accepted (a tensor of any integer dtype, or a list).
    edge = [0, TINY.vocab_size - 1] * 8
    ref = _single_process(models["tiny"], torch.tensor(edge))[0]
    for ids in (edge, torch.tensor(edge, dtype=torch.int32)):
        res = executor.prefill("tiny", ids, world_size=4, split="zigzag")
        torch.testing.assert_close(res.logits, ref, atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.xdist_group("context_parallel")
def test_a_failing_rank_fails_the_caller_fast_with_its_error():
    with ContextParallelExecutor({"tiny": _tiny_model()}, world_size=2, timeout_s=60.0) as ex:
        ids = list(range(20))
        assert ex.prefill("tiny", ids, strategy="ring").logits.shape == (TINY.vocab_size,)
        t0 = time.monotonic()
        with pytest.raises(ContextParallelError, match="rank 1 failed") as info:
            ex.prefill("tiny", ids, strategy="ring", fail_rank=1, fail_at_layer=1)
        assert "deliberate failure on rank 1 at layer 1" in str(info.value)
        assert time.monotonic() - t0 < 15.0  # well under the 60 s collective timeout: no waiting it out
        with pytest.raises(ContextParallelError, match="rank 1 failed"):  # and every later job
            ex.prefill("tiny", ids)
        assert ex.alive_ranks == []


@pytest.mark.slow
@pytest.mark.xdist_group("context_parallel")
def test_a_stalled_rank_trips_the_collective_timeout():
    with ContextParallelExecutor({"tiny": _tiny_model()}, world_size=2) as ex:
        t0 = time.monotonic()
        with pytest.raises(ContextParallelError, match="rank 0 failed") as info:
            ex.prefill("tiny", list(range(20)), strategy="allgather", timeout_s=2.0, fail_rank=1, fail_at_layer=0,
                       fail_mode="hang")
        assert "CollectiveError" in str(info.value) and "all_gather of K/V at layer 0" in str(info.value)
        assert time.monotonic() - t0 < 2.0 + 10.0


@pytest.mark.slow
@pytest.mark.xdist_group("context_parallel")
def test_a_worker_that_dies_silently_is_reported_not_waited_for():
    with ContextParallelExecutor({"tiny": _tiny_model()}, world_size=1) as ex:
        ex.procs[0].kill()  # like a segfault or the OOM killer: no Python error, no report
        ex.procs[0].join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(ContextParallelError, match=r"rank 0 \(pid \d+\) died with exit code -9"):
            ex.prefill("tiny", list(range(8)))
        assert time.monotonic() - t0 < 10.0
