"""The model runner: the flat batch it builds from a SchedulerOutput, and the vectorized SDPA attention backend."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.attention.paged import PagedAttention, allocate_kv_caches, build_attention_metadata
from minillm.attention.torch_sdpa import TorchSDPAAttention
from minillm.config import LlamaConfig
from minillm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minillm.sampling_params import SamplingParams
from minillm.worker.model_runner import ModelRunner
from tests.engine_helpers import run_step, single_thread, tiny_model  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


# -- the SDPA backend equals the per-request reference -----------------------------------------------------------------
@settings(max_examples=40)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 16]), num_reqs=st.integers(1, 5))
def test_sdpa_backend_matches_paged_reference(data, block_size, num_reqs):
    """Random mixes of decodes, fresh prompts and chunks with context (prefix hits) through both backends."""
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    ctx = data.draw(st.lists(st.integers(0, 40), min_size=num_reqs, max_size=num_reqs))
    new = data.draw(st.lists(st.sampled_from([1, 1, 2, 3, 5, 8, 9, 17]), min_size=num_reqs, max_size=num_reqs))
    num_blocks = 1 + sum(-(-(c + n) // block_size) for c, n in zip(ctx, new))
    perm = data.draw(st.permutations(list(range(1, num_blocks))))  # blocks scattered through the cache
    block_ids, k0 = [], 0
    for c, n in zip(ctx, new):
        nb = -(-(c + n) // block_size)
        block_ids.append(list(perm[k0:k0 + nb]))
        k0 += nb
    g = torch.Generator().manual_seed(len(perm))
    caches = allocate_kv_caches(cfg, num_blocks, block_size)
    for kc, vc in caches:  # history already in the cache (random), garbage elsewhere
        kc.normal_(generator=g)
        vc.normal_(generator=g)
    copies = [(kc.clone(), vc.clone()) for kc, vc in caches]
    md = build_attention_metadata(block_ids, ctx, new, block_size)
    t = sum(new)
    q = torch.randn(t, 6, 8, generator=g)
    k = torch.randn(t, 2, 8, generator=g)
    v = torch.randn(t, 2, 8, generator=g)
    ref = PagedAttention(caches, md, backend="torch").forward(0, q, k, v)
    out = TorchSDPAAttention(copies, md).forward(0, q, k, v)
    # fp32, values O(1), different summation order (SDPA vs einsum): agreement to ~1e-6; 1e-5 leaves margin.
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(copies[0][0], caches[0][0], atol=0, rtol=0)  # the same K/V were written
    torch.testing.assert_close(copies[0][1], caches[0][1], atol=0, rtol=0)


# -- the flat batch -------------------------------------------------------------------------------------------------
def _new(req_id, prompt, block_ids, num_computed=0, **params):
    return NewRequestData(req_id, prompt, SamplingParams.greedy(**params), block_ids, num_computed)


def test_prepare_inputs_builds_the_flat_batch_by_hand():
    """Two new requests (one with a 4-token prefix-cache hit) and, next step, a decode plus a chunk."""
    runner = ModelRunner(tiny_model(), num_blocks=16, block_size=4)
    a = list(range(10, 16))          # 6 tokens, whole prompt
    b = list(range(20, 31))          # 11 tokens, 4 cached, chunk of 5 now
    so = SchedulerOutput([_new("A", a, [3, 7]), _new("B", b, [5, 2, 9], num_computed=4)], CachedRequestData(),
                         {"A": 6, "B": 5}, 11)
    out = run_step(runner, so)
    x = runner.last_inputs
    # Rows sorted as vLLM's Model Runner V2 does (sort_batch_req_ids): decodes first, then by tokens, shortest first.
    assert x.req_ids == ["B", "A"] and out.req_ids == ["B", "A"]
    assert x.idx_mapping.tolist() == [runner.req_states.req_id_to_index[r] for r in ("B", "A")]
    assert x.input_ids.tolist() == b[4:9] + a
    assert x.positions.tolist() == [4, 5, 6, 7, 8] + [0, 1, 2, 3, 4, 5]
    assert x.query_start_loc.tolist() == [0, 5, 11]
    assert x.seq_lens.tolist() == [9, 6]
    assert x.block_table.tolist() == [[5, 2, 9], [3, 7, 0]]
    # B: positions 4-7 in block 2 (slots 8-11), position 8 in block 9 (36); A: block 3 holds positions 0-3 (slots
    # 12-15), block 7 positions 4-5 (28, 29).
    assert x.slot_mapping.tolist() == [8, 9, 10, 11, 36] + [12, 13, 14, 15, 28, 29]
    assert x.logits_indices.tolist() == [4, 10]
    assert x.discard_request_mask.tolist() == [True, False]  # B is mid-prefill: its token is sampled, then dropped
    assert out.sampled_token_ids[0] == [] and len(out.sampled_token_ids[1]) == 1
    tok_a = out.sampled_token_ids[1][0]
    assert runner.req_states.token_ids("A") == a + [tok_a] and runner.req_states.token_ids("B") == b

    cached = CachedRequestData(req_ids=["A", "B"], new_block_ids=[[], [11]], num_computed_tokens=[6, 9],
                               num_output_tokens=[1, 0])
    run_step(runner, SchedulerOutput([], cached, {"A": 1, "B": 2}, 3))
    x = runner.last_inputs
    assert x.req_ids == ["A", "B"]  # A decodes: first
    assert x.input_ids.tolist() == [tok_a, b[9], b[10]]  # A's from last_sampled_tokens, B's from its prompt
    assert x.positions.tolist() == [6, 9, 10]
    assert x.block_table.tolist() == [[3, 7, 0, 0], [5, 2, 9, 11]]
    assert x.slot_mapping.tolist() == [30, 37, 38]
    assert x.logits_indices.tolist() == [0, 2]
    assert x.discard_request_mask.tolist() == [False, False]


def test_runner_resumes_a_preempted_request_from_all_its_tokens():
    runner = ModelRunner(tiny_model(), num_blocks=16, block_size=4)
    run_step(runner, SchedulerOutput([_new("A", [1, 2, 3], [4])], CachedRequestData(), {"A": 3}, 3))
    first = runner.requests["A"].token_ids[-1]
    # Preempted, then resumed with new blocks: the runner recomputes prompt + output from position 0.
    cached = CachedRequestData(req_ids=["A"], resumed_req_ids={"A"}, new_block_ids=[[6]], num_computed_tokens=[0],
                               num_output_tokens=[1], all_token_ids={"A": [1, 2, 3, first]})
    run_step(runner, SchedulerOutput([], cached, {"A": 4}, 4, preempted_req_ids=set()))
    x = runner.last_inputs
    assert x.input_ids.tolist() == [1, 2, 3, first]
    assert x.slot_mapping.tolist() == [24, 25, 26, 27]
    assert runner.requests["A"].token_ids[:4] == [1, 2, 3, first]


def test_runner_samples_every_request_and_discards_the_mid_prefill_rows(monkeypatch):
    """As vLLM v0.33.0 (gpu_model_runner.py: discard_request_mask): logits at logits_indices for every scheduled
    request, one sampled row each (int32 [num_reqs, 1]), and the token of a request still mid-prefill dropped."""
    model = tiny_model()
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    rows = []
    orig = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: rows.append(h.shape[0]) or orig(h))
    so = SchedulerOutput([_new("A", [1] * 8, [1, 2]), _new("B", [2] * 9, [3, 4, 5]), _new("C", [3] * 2, [6])],
                         CachedRequestData(), {"A": 8, "B": 4, "C": 2}, 14)
    out = run_step(runner, so)
    assert rows == [3]  # A and C finish their prompts; B is mid-prefill, and its row is computed too
    x, sampler_output = runner.last_inputs, runner.last_sampler_output
    assert x.discard_request_mask.tolist() == [False, True, False]
    ids = sampler_output.sampled_token_ids
    assert ids.shape == (3, 1) and ids.dtype == torch.int32
    assert out.sampled_token_ids == [[int(ids[0, 0])], [], [int(ids[2, 0])]]  # B's row never reaches the output
    assert runner.requests["B"].token_ids == [2] * 9  # nor the request: its next token is its own prompt's
    assert len(runner.requests["A"].token_ids) == 9 and len(runner.requests["C"].token_ids) == 3


def _run_seeded(chunks: list[int], num_decodes: int, *, others: bool = False) -> tuple[list[int], list[int]]:
    """One seeded request (temperature 1) on a fresh runner: its 10-token prompt in ``chunks``, then
    ``num_decodes`` decodes. With ``others``, a second seeded request rides along, decoding every step.
    Returns the seeded request's sampled tokens and the number of rows of each step's sampler output."""
    runner = ModelRunner(tiny_model(), num_blocks=16, block_size=4)
    prompt = list(range(40, 50))
    params = dict(temperature=1.0, seed=7, max_tokens=16)
    new = [NewRequestData("S", prompt, SamplingParams(**params), [1, 2, 3, 4, 5], 0)]
    sched = {"S": chunks[0]}
    if others:
        new.append(NewRequestData("O", [5, 6], SamplingParams(temperature=1.0, seed=99, max_tokens=32),
                                  [6, 7, 8, 9], 0))
        sched["O"] = 2
    run_step(runner, SchedulerOutput(new, CachedRequestData(), sched, sum(sched.values())))
    row_counts = [runner.last_sampler_output.sampled_token_ids.shape[0]]
    done = chunks[0]
    steps = list(chunks[1:]) + [1] * num_decodes
    for n in steps:
        req_ids, computed, sched = ["S"], [done], {"S": n}
        if others:
            o = runner.requests["O"]
            req_ids.append("O")
            computed.append(len(o.token_ids) - 1)
            sched["O"] = 1
        cached = CachedRequestData(req_ids=req_ids, new_block_ids=[[] for _ in req_ids], num_computed_tokens=computed,
                                   num_output_tokens=[len(runner.requests[r].output_token_ids) for r in req_ids])
        run_step(runner, SchedulerOutput([], cached, sched, sum(sched.values())))
        row_counts.append(runner.last_sampler_output.sampled_token_ids.shape[0])
        done += n
    return runner.requests["S"].output_token_ids, row_counts


def test_seeded_request_samples_the_same_with_and_without_chunked_prefill():
    """The discarded draws of a mid-prefill seeded request leave its generator where it was (vLLM v0.33.0 rewinds
    it in gpu_model_runner.py:GPUModelRunner._bookkeeping_sync), so chunking does not change its samples."""
    whole, rows_whole = _run_seeded([10], 6)
    chunked, rows_chunked = _run_seeded([3, 3, 4], 6)
    assert rows_whole == [1] * 7 and rows_chunked == [1] * 9  # the 2 mid-prefill steps were sampled too
    assert len(whole) == 7 and chunked == whole
    assert len(set(whole)) > 1  # really random (the tiny model's vocabulary is 211)
    # The same next to another seeded request that decodes every step (its rows are kept).
    assert _run_seeded([3, 3, 4], 6, others=True)[0] == whole
    assert _run_seeded([1] * 10, 6, others=True)[0] == whole


def test_runner_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ModelRunner(tiny_model(), num_blocks=4, block_size=4, attention_backend="flash")



def test_a_step_is_two_calls_execute_model_then_sample_tokens():
    """v0.33.0's Model Runner V2: execute_model runs the forward pass and returns None when there is something to
    sample; sample_tokens samples it (the engine core computes the grammar bitmask in between: None here)."""
    runner = ModelRunner(tiny_model(), num_blocks=16, block_size=4)
    with pytest.raises(RuntimeError, match="sample_tokens needs a step whose execute_model returned None"):
        runner.sample_tokens(None)
    so = SchedulerOutput([_new("A", [1, 2, 3], [4])], CachedRequestData(), {"A": 3}, 3)
    assert runner.execute_model(so) is None
    with pytest.raises(ValueError, match="no structured outputs: grammar_output must be None"):
        runner.sample_tokens(object())
    out = runner.sample_tokens(None)  # the refused bitmask left the step to sample
    assert out.req_ids == ["A"] and len(out.sampled_token_ids[0]) == 1
    assert runner.req_states.token_ids("A") == [1, 2, 3, *out.sampled_token_ids[0]]
    # A plan without tokens (only finished ids) gets its output from execute_model itself.
    empty = SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"A"})
    out = runner.execute_model(empty)
    assert out is not None and out.req_ids == [] and runner.req_states.num_reqs == 0


def test_an_abandoned_step_does_not_block_the_next():
    """A step whose sampling never came (Ctrl-C or an error between the two calls; the engine core aborts its
    requests) is dropped by the next execute_model."""
    runner = ModelRunner(tiny_model(), num_blocks=16, block_size=4)
    assert runner.execute_model(SchedulerOutput([_new("A", [1, 2, 3], [4])], CachedRequestData(), {"A": 3}, 3)) is None
    so = SchedulerOutput([_new("B", [5, 6], [5])], CachedRequestData(), {"B": 2}, 2, finished_req_ids={"A"})
    out = run_step(runner, so)
    assert out.req_ids == ["B"] and set(runner.req_states.req_id_to_index) == {"B"}


def test_slots_are_freed_in_sorted_order_whatever_order_the_ids_come_in():
    """Which slot the next request takes must not depend on a set's order (string hashes differ from process to
    process, and from tensor-parallel rank to rank): remove_requests frees in sorted order, as finish_requests."""
    free_lists = []
    for order in (["B", "D"], ["D", "B"]):
        runner = ModelRunner(tiny_model(), num_blocks=16, block_size=4, max_num_reqs=4)
        new = [_new(rid, [k + 1, k + 2], [k + 1]) for k, rid in enumerate("ABCD")]
        run_step(runner, SchedulerOutput(new, CachedRequestData(), dict.fromkeys("ABCD", 2), 8))
        runner.remove_requests(order)
        free_lists.append(list(runner.req_states.free_indices))
    assert free_lists[0] == free_lists[1] == [2, 0]  # B held slot 2, D slot 0: B's goes back first
