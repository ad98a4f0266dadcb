"""Model Runner V2's state and the batch it builds by index (minillm/worker/states.py, block_table.py,
input_batch.py).

1. Random sequences of add / remove / resend / context updates keep :class:`RequestState` equal to a plain-dict model,
   and a request never changes slot while it holds one; :class:`BlockTables` rows, gathered by ``idx_mapping``, and
   their slot mapping equal the formula (hypothesis).
2. On real engine steps (chunked prefill, prefix-cache hits, preemption, n-gram drafts, requests finishing and
   aborted mid-batch, failed KV loads), the :class:`InputBatch` the runner builds from its slots with the input
   kernels equals chapter 6's ``prepare_inputs(...)`` request by request, dtypes included, in v0.33.0's row order.
3. A fresh ModelRunner fed only ``pickle.loads(pickle.dumps(scheduler_output))`` of every step of an engine run
   (what crosses a process boundary) samples the same tokens and proposes the same drafts.
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from minillm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.parts import EngineParts
from minillm.sampling_params import SamplingParams
from minillm.worker.block_table import BlockTables
from minillm.worker.input_batch import InputBatch
from minillm.worker.model_runner import BatchInputs, ModelRunner, prepare_inputs, sort_batch_req_ids
from minillm.worker.states import RequestState
from tests.engine_helpers import TINY, run_step, single_thread, tiny_model  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

_TINY_MODEL = tiny_model()


# -- 1. the slots against a plain-dict model ----------------------------------------------------------------------
MAX_REQS, MAX_LEN = 4, 12
token = st.integers(0, 2**31 - 1)  # the whole int32 range: the slots must not truncate ids


class RequestStateMachine(RuleBasedStateMachine):
    """The model: request id -> its tokens, prompt length, prefill length and computed tokens; and the slot each
    request got when it arrived (``slot_of``), which must not change while it holds it."""

    ids = Bundle("ids")

    def __init__(self) -> None:
        super().__init__()
        self.states = RequestState(MAX_REQS, MAX_LEN, num_speculative_steps=2)
        self.reqs: dict[str, dict] = {}
        self.slot_of: dict[str, int] = {}
        self.counter = 0

    @rule(target=ids, data=st.data())
    def add(self, data):
        rid = f"r{self.counter}"
        self.counter += 1
        tokens = data.draw(st.lists(token, min_size=1, max_size=MAX_LEN + 2))
        prompt_len = data.draw(st.integers(1, len(tokens)))
        computed = data.draw(st.integers(0, len(tokens)))
        if len(self.reqs) == MAX_REQS or len(tokens) > MAX_LEN:
            with pytest.raises(ValueError, match="slots .max_num_reqs. is taken|more than max_model_len"):
                self.states.add_request(rid, prompt_len, tokens, computed)
            return rid  # refused, nothing changed: the id may be added again later
        idx = self.states.add_request(rid, prompt_len, tokens, computed)
        assert idx not in self.slot_of.values()
        self.slot_of[rid] = idx
        self.reqs[rid] = dict(tokens=tokens, prompt_len=prompt_len, prefill_len=len(tokens), computed=computed)
        return rid

    @rule(rid=consumes(ids))
    def remove(self, rid):
        idx = self.states.remove_request(rid)
        assert idx == self.slot_of.pop(rid, None)
        self.reqs.pop(rid, None)

    @rule(rid=ids, data=st.data())
    def resend(self, rid, data):
        if rid not in self.reqs:
            return
        tokens = data.draw(st.lists(token, min_size=self.reqs[rid]["prompt_len"], max_size=MAX_LEN))
        self.states.replace_tokens(self.slot_of[rid], tokens)
        self.reqs[rid].update(tokens=tokens, prefill_len=len(tokens))

    @rule(rid=ids, data=st.data())
    def computed(self, rid, data):
        if rid not in self.reqs:
            return
        n = data.draw(st.integers(0, len(self.reqs[rid]["tokens"])))
        self.states.set_num_computed_tokens(self.slot_of[rid], n)
        self.reqs[rid]["computed"] = n

    @invariant()
    def slots_equal_the_model(self):
        s = self.states
        assert s.req_id_to_index == self.slot_of
        assert s.index_to_req_id == {i: r for r, i in self.slot_of.items()}
        assert sorted(s.free_indices + list(self.slot_of.values())) == list(range(MAX_REQS))
        for rid, want in self.reqs.items():
            i = self.slot_of[rid]
            assert s.token_ids(rid) == want["tokens"]
            assert int(s.last_sampled_tokens[i, 0]) == want["tokens"][-1]
            assert (s.prompt_len.np[i], s.prefill_len.np[i]) == (want["prompt_len"], want["prefill_len"])
            assert int(s.num_computed_tokens[i]) == s.num_computed_tokens_np[i] == want["computed"]
            assert s.num_computed_prefill_tokens[i] == min(want["computed"], want["prefill_len"])


TestRequestStateMachine = RequestStateMachine.TestCase
TestRequestStateMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_request_state_refuses_bad_sizes_and_ids():
    with pytest.raises(ValueError, match="max_num_reqs must be an integer >= 1, got 0"):
        RequestState(0, 8)
    with pytest.raises(ValueError, match="num_speculative_steps must be an integer >= 0, got -1"):
        RequestState(2, 8, num_speculative_steps=-1)
    states = RequestState(2, 8)
    states.add_request("A", 2, [1, 2, 3], 0)
    with pytest.raises(ValueError, match="request 'A' already holds slot 1"):
        states.add_request("A", 2, [1, 2, 3], 0)
    with pytest.raises(ValueError, match=r"'B': prompt_len must be in 1..3 \(its tokens\), got 4"):
        states.add_request("B", 4, [1, 2, 3], 0)
    assert states.remove_request("nobody") is None and states.free_indices == [0]


def test_a_freed_slot_is_taken_again_and_nothing_moves():
    """A B C arrive (slots 3 2 1: the free list is popped from its end, as vLLM's); B leaves, D arrives in B's slot."""
    states = RequestState(4, 8)
    for k, rid in enumerate("ABC"):
        states.add_request(rid, 1, [k + 1], 0)
    assert states.req_id_to_index == {"A": 3, "B": 2, "C": 1}
    states.remove_request("B")
    assert states.add_request("D", 1, [9], 0) == 2
    assert states.req_id_to_index == {"A": 3, "C": 1, "D": 2} and states.token_ids("C") == [3]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 16]), max_reqs=st.integers(1, 5))
def test_block_tables_gather_and_map_slots_by_index(data, block_size, max_reqs):
    width = 6
    tables = BlockTables(block_size, max_reqs, width)
    rows: dict[int, list[int]] = {}
    for _ in range(data.draw(st.integers(1, 12))):
        slot = data.draw(st.integers(0, max_reqs - 1))
        overwrite = data.draw(st.booleans()) or slot not in rows
        blocks = data.draw(st.lists(st.integers(1, 1000), max_size=width))
        before = list(rows.get(slot, []))
        if (0 if overwrite else len(before)) + len(blocks) > width:
            with pytest.raises(ValueError, match="more than a block-table row holds"):
                tables.append_block_ids(slot, blocks, overwrite)
            continue
        tables.append_block_ids(slot, blocks, overwrite)
        rows[slot] = list(blocks) if overwrite else before + list(blocks)
    if not rows:
        return
    order = data.draw(st.permutations(sorted(rows)))
    idx_mapping = torch.tensor(order, dtype=torch.int64)
    table = tables.gather_block_tables(idx_mapping).tolist()
    assert table == [rows[s] + [0] * (width - len(rows[s])) for s in order]
    # Each row schedules tokens within the blocks it holds.
    lens = [data.draw(st.integers(0, len(rows[s]) * block_size)) for s in order]
    starts = [data.draw(st.integers(0, len(rows[s]) * block_size - n)) for s, n in zip(order, lens)]
    qsl = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)
    positions = torch.tensor([p for st_, n in zip(starts, lens) for p in range(st_, st_ + n)], dtype=torch.int64)
    slots = tables.compute_slot_mappings(idx_mapping, qsl, positions).tolist()
    assert slots == [rows[s][p // block_size] * block_size + p % block_size
                     for s, st_, n in zip(order, starts, lens) for p in range(st_, st_ + n)]


def test_batch_order_puts_verifications_and_decodes_first():
    """vLLM v0.33.0's sort_batch_req_ids: drafts first, then one-token decodes, then by tokens (stable)."""
    sched = {"p": 9, "d1": 1, "e": 3, "v": 3, "d2": 1, "e2": 3}
    assert sort_batch_req_ids(sched, {"v": [4, 5]}) == ["v", "d1", "d2", "e", "e2", "p"]


# -- 2. the batch built by index equals chapter 6's prepare_inputs on real engine steps ---------------------------
def assert_same_batch(got: InputBatch, want: BatchInputs, what: str) -> None:
    """Request by request (the rows are in another order), dtypes and devices included (exact: integers)."""
    assert sorted(got.req_ids) == sorted(want.req_ids), what
    assert got.input_ids.dtype == want.input_ids.dtype == torch.int64, what
    assert got.positions.dtype == want.positions.dtype == torch.int64, what
    assert got.slot_mapping.dtype == want.slot_mapping.dtype == torch.int64, what
    for name in ("query_start_loc", "seq_lens", "block_table"):
        assert getattr(got, name).dtype == getattr(want, name).dtype == torch.int32, f"{what}: {name}"
    assert got.block_table.shape == want.block_table.shape, what
    gq, wq = got.query_start_loc.tolist(), want.query_start_loc.tolist()
    cu = got.cu_num_logits_np.tolist()
    for b, rid in enumerate(got.req_ids):
        w = want.req_ids.index(rid)
        for name in ("input_ids", "positions", "slot_mapping"):
            g, x = getattr(got, name)[gq[b]:gq[b + 1]], getattr(want, name)[wq[w]:wq[w + 1]]
            assert g.tolist() == x.tolist(), f"{what}: {rid} {name} {g.tolist()} vs {x.tolist()}"
        assert int(got.seq_lens[b]) == int(want.seq_lens[w]), f"{what}: {rid} seq_len"
        assert got.block_table[b].tolist() == want.block_table[w].tolist(), f"{what}: {rid} blocks"
        assert bool(got.discard_request_mask[b]) == bool(want.discard_request_mask[w]), f"{what}: {rid} discard"
        assert got.draft_token_ids[b] == want.draft_token_ids[w], f"{what}: {rid} drafts"
        d = len(want.draft_token_ids[w])
        assert got.logits_indices[cu[b]:cu[b + 1]].tolist() == list(range(gq[b + 1] - 1 - d, gq[b + 1])), what
    assert got.attn_metadata.max_query_len == want.attn_metadata.max_query_len, what
    assert got.attn_metadata.max_seq_len == want.attn_metadata.max_seq_len, what


class Watch:
    """At every step of an engine, compares the batch the runner builds from its slots with chapter 6's
    ``prepare_inputs`` on the same requests, and checks that no request changes slot while it holds one."""

    def __init__(self, engine: LLMEngine) -> None:
        self.runner = runner = engine.model_runner
        self.steps = self.discards = self.reused = 0
        self.max_drafts = 0
        self._slots: dict[str, int] = {}
        self._held: dict[int, set[str]] = {}  # slot -> the requests that ever held it
        self._build = runner.prepare_inputs
        runner.prepare_inputs = self._both  # an instance attribute shadows the method for this runner only

    def _both(self, so: SchedulerOutput) -> InputBatch:
        runner, states = self.runner, self.runner.req_states
        what = f"step {self.steps}"
        assert set(so.num_scheduled_tokens) <= set(states.req_id_to_index), what
        for rid, i in states.req_id_to_index.items():
            if rid in self._slots:  # held a slot at the previous step and still does: the same one
                assert self._slots[rid] == i, f"{what}: {rid} moved from slot {self._slots[rid]} to {i}"
            elif self._held.get(i, {rid}) != {rid}:
                self.reused += 1  # a slot another request held before
            self._held.setdefault(i, set()).add(rid)
        self._slots = dict(states.req_id_to_index)
        got = self._build(so)
        assert got.req_ids == sort_batch_req_ids(so.num_scheduled_tokens, so.scheduled_spec_decode_tokens), what
        assert got.idx_mapping.tolist() == [states.req_id_to_index[r] for r in got.req_ids], what
        want = prepare_inputs(so, runner.request_views(so.num_scheduled_tokens), runner.block_size, runner.device)
        assert_same_batch(got, want, what)
        self.steps += 1
        self.discards += int(got.discard_request_mask.sum())
        self.max_drafts = max([self.max_drafts] + [len(d) for d in got.draft_token_ids])
        return got


def run_engine(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
               aborts: dict[int, list[str]] | None = None) -> dict[str, list[int]]:
    """Abort some requests and add others at the steps given as keys; step until done. Returns the tokens of each
    request that finished (aborted ones send none)."""
    tokens: dict[str, list[int]] = {}
    aborts = dict(aborts or {})
    step = 0
    while arrivals or engine.has_unfinished_requests():
        engine.abort_request(aborts.pop(step, []))  # first: an aborted id may come back as a new request
        for rid, prompt, params in arrivals.pop(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        assert step < 1000, "the engine does not make progress"
    return tokens


def _ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompt(start: int, n: int) -> list[int]:
    return [(start + 7 * j) % TINY.vocab_size for j in range(n)]


SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=8)
SCENARIOS = {
    # Prompts in chunks of at most 5 tokens under a budget of 8: mid-prefill rows every step.
    "chunked_prefill": (dict(max_num_batched_tokens=8, long_prefill_token_threshold=5),
                        {0: [("a", _prompt(1, 13), SamplingParams.greedy(max_tokens=6)), ("b", _prompt(2, 7), SEEDED),
                             ("c", _prompt(3, 20), SamplingParams.greedy(max_tokens=4))]}),
    # b shares a's first 20 tokens and arrives later: its first 5 blocks are prefix-cache hits.
    "prefix_hits": (dict(enable_prefix_caching=True),
                    {0: [("a", list(range(1, 21)), SamplingParams.greedy(max_tokens=6))],
                     2: [("b", list(range(1, 21)) + [40, 41], SamplingParams.greedy(max_tokens=6)),
                         ("c", list(range(1, 21)) + [50], SEEDED)]}),
    # 12 usable blocks for two requests that grow to 7 blocks each: one is preempted and resumed.
    "preemption": (dict(num_gpu_blocks=13, enable_prefix_caching=True),
                   {0: [("a", list(range(1, 21)), SamplingParams.greedy(max_tokens=6)),
                        ("c", list(range(50, 70)), SEEDED)],
                    2: [("b", list(range(1, 21)) + [40, 41], SamplingParams.greedy(max_tokens=6))]}),
    # Prompts that repeat a pattern: prompt lookup drafts, the runner verifies.
    "ngram_drafts": (dict(speculative_config=_ngram(3), max_num_batched_tokens=12),
                     {0: [("a", [5, 9, 17] * 6, SamplingParams.greedy(max_tokens=16)),
                          ("b", [40, 41, 42, 43] * 5, SamplingParams(temperature=0.8, seed=3, max_tokens=12)),
                          ("c", [7] * 12, SamplingParams.greedy(max_tokens=10))]}),
    # Requests of different lengths arriving over time, one aborted: slots empty mid-batch and get condensed.
    "finishes_mid_batch": (dict(max_num_seqs=4),
                           {0: [(f"r{k}", _prompt(k, 3 + k), SamplingParams.greedy(max_tokens=m))
                                for k, m in enumerate([2, 9, 4, 12])],
                            3: [("late", _prompt(9, 5), SEEDED)], 5: [("later", _prompt(11, 4), SEEDED)]}),
}


def _engine(**kwargs) -> LLMEngine:
    args = dict(block_size=4, num_gpu_blocks=200, max_model_len=48)
    args.update(kwargs)
    return LLMEngine(_TINY_MODEL, None, EngineArgs(**args))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_persistent_batch_equals_prepare_inputs_on_engine_steps(name):
    engine_args, arrivals = SCENARIOS[name]
    engine = _engine(**engine_args)
    watch = Watch(engine)
    aborts = {6: ["r3"]} if name == "finishes_mid_batch" else None
    run_engine(engine, {k: list(v) for k, v in arrivals.items()}, aborts)
    assert watch.steps > 5
    # Each scenario really does what it is named for.
    stats = engine.stats
    if name == "chunked_prefill":
        assert watch.discards > 0
    if name == "prefix_hits":
        assert stats.num_cached_prompt_tokens > 0
    if name == "preemption":
        assert stats.num_preemptions > 0
    if name == "ngram_drafts":
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0 and watch.max_drafts > 1
    if name == "finishes_mid_batch":
        assert watch.reused > 0  # a slot freed mid-batch was taken by a later request, nothing moved
    runner = engine.model_runner
    assert not runner.requests_info and runner.req_states.num_reqs == 0  # every slot back on the free list
    assert sorted(runner.req_states.free_indices) == list(range(runner.max_num_reqs))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 4, 16]), budget=st.sampled_from([6, 16, 64]),
       threshold=st.sampled_from([0, 3]), max_num_seqs=st.sampled_from([2, 5]), prefix_caching=st.booleans(),
       tight_cache=st.booleans(), k=st.sampled_from([0, 2]))
def test_persistent_batch_equals_prepare_inputs_on_random_engines(data, block_size, budget, threshold,
                                                                   max_num_seqs, prefix_caching, tight_cache, k):
    max_model_len = 40
    blocks = -(-max_model_len // block_size) + 1 + (2 if tight_cache else 100)
    engine = _engine(block_size=block_size, num_gpu_blocks=blocks, max_num_batched_tokens=budget,
                     max_num_seqs=max_num_seqs, max_model_len=max_model_len, long_prefill_token_threshold=threshold,
                     enable_prefix_caching=prefix_caching, speculative_config=_ngram(k) if k else None)
    common = data.draw(st.lists(st.integers(0, 5), max_size=12))  # few distinct ids: repeats for prompt lookup
    arrivals: dict[int, list] = {}
    for i in range(data.draw(st.integers(1, 5))):
        prompt = common + data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=12))
        params = SamplingParams.greedy(max_tokens=data.draw(st.integers(1, 8)))
        arrivals.setdefault(data.draw(st.integers(0, 4)), []).append((f"q{i}", prompt, params))
    watch = Watch(engine)
    run_engine(engine, arrivals)
    assert watch.steps > 0


def test_persistent_batch_equals_prepare_inputs_when_kv_loads_fail(tmp_path):
    """Chapter 9's consumer engine: a prompt's K/V file is damaged, the blocks it should fill are reported, and the
    scheduler resends the tokens of a request the batch still holds (it sampled from bad K/V): the runner rewrites
    that slot's tokens in place (``RequestState.replace_tokens``) and the batch stays equal to prepare_inputs'."""
    from minillm.distributed.kv_transfer.shared_storage_connector import prompt_key

    def storage(role: str) -> dict:
        return {"kv_connector": "SharedStorageConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}

    args = dict(block_size=4, num_gpu_blocks=160, max_num_batched_tokens=16, max_model_len=64,
                enable_prefix_caching=True)
    prompts = [_prompt(1, 18), _prompt(2, 23), _prompt(3, 9)]
    prefill = LLMEngine(_TINY_MODEL, None, EngineArgs(**args, kv_transfer_config=storage("kv_producer")))
    run_engine(prefill, {0: [(f"p{i}", p, SamplingParams.greedy(max_tokens=1)) for i, p in enumerate(prompts)]})
    (tmp_path / prompt_key(prompts[1]) / "layer_1.safetensors").write_bytes(b"truncated")
    decode = LLMEngine(_TINY_MODEL, None, EngineArgs(**args, kv_transfer_config=storage("kv_consumer")))
    watch = Watch(decode)
    states = decode.model_runner.req_states
    rewrites = []
    replace_tokens = states.replace_tokens
    states.replace_tokens = lambda i, ids: rewrites.append(states.index_to_req_id[i]) or replace_tokens(i, ids)
    got = run_engine(decode, {0: [(f"d{i}", p, SamplingParams.greedy(max_tokens=5)) for i, p in enumerate(prompts)]})
    plain = run_engine(_engine(max_model_len=64), {0: [(f"d{i}", p, SamplingParams.greedy(max_tokens=5))
                                                       for i, p in enumerate(prompts)]})
    assert got == plain
    # d1 recomputes from its bad blocks with its tokens resent; a request the budget left out of a step gets its
    # tokens resent too (the same ones): both keep their slots and are rewritten in place.
    assert decode.kv_connector_worker.stats["loaded_requests"] >= 2 and "d1" in rewrites
    assert watch.steps > 5


def test_a_learners_prepare_inputs_is_called_as_before():
    """With a learner's function in parts.prepare_inputs (chapter 8), the runner calls it with chapter 6's request
    states, read back from its slots."""
    calls = []

    def learners(scheduler_output, requests, block_size, device="cpu"):
        calls.append((type(requests), block_size, device))
        states = engine.model_runner.req_states
        assert list(requests) == list(scheduler_output.num_scheduled_tokens)
        for rid in scheduler_output.num_scheduled_tokens:
            assert states.token_ids(rid) == requests[rid].token_ids
        return prepare_inputs(scheduler_output, requests, block_size, device)

    engine = LLMEngine(_TINY_MODEL, None, EngineArgs(block_size=4, num_gpu_blocks=64, max_model_len=48),
                       parts=EngineParts(prepare_inputs=learners))
    tokens = run_engine(engine, {0: [("a", _prompt(1, 9), SamplingParams.greedy(max_tokens=4))]})
    assert len(tokens["a"]) == 4
    assert len(calls) == engine.stats.num_steps and calls[0] == (dict, 4, engine.model_runner.device)
    plain = run_engine(_engine(num_gpu_blocks=64), {0: [("a", _prompt(1, 9), SamplingParams.greedy(max_tokens=4))]})
    assert plain == tokens


def _new(rid: str, n: int, block: int) -> NewRequestData:
    return NewRequestData(rid, list(range(1, n + 1)), SamplingParams.greedy(), [block], 0)


def test_runner_refuses_more_requests_than_slots():
    runner = ModelRunner(_TINY_MODEL, num_blocks=8, block_size=4, max_num_reqs=1)
    so = SchedulerOutput([_new("A", 3, 1), _new("B", 3, 2)], CachedRequestData(), {"A": 3, "B": 3}, 6)
    with pytest.raises(ValueError, match=r"every one of the 1 slots \(max_num_reqs\) is taken, so 'B' does not fit"):
        runner.execute_model(so)


def test_runner_refuses_a_request_longer_than_max_model_len():
    runner = ModelRunner(_TINY_MODEL, num_blocks=8, block_size=4, max_model_len=4)
    so = SchedulerOutput([_new("A", 5, 1)], CachedRequestData(), {"A": 5}, 5)
    with pytest.raises(ValueError, match=r"'A' would hold 5 tokens, more than max_model_len \(4\)"):
        runner.execute_model(so)


# -- 3. only the SchedulerOutput crosses: a fresh runner fed pickled outputs samples the same tokens ---------------
def test_fresh_runner_fed_pickled_scheduler_outputs_samples_the_same_tokens():
    """Chunked prefill, preemption with resumption, prefix hits, drafts, seeded sampling and finishes: the second
    runner sees nothing but the bytes of each step's SchedulerOutput (no engine-side remove_requests calls, no
    object shared with the scheduler), as an engine-core process would send them."""
    engine = _engine(num_gpu_blocks=14, max_num_batched_tokens=10, long_prefill_token_threshold=5,
                     enable_prefix_caching=True, speculative_config=_ngram(2), max_num_seqs=3)
    runner = engine.model_runner
    steps: list[tuple[bytes, list[list[int]], list[list[int]] | None]] = []
    execute, sample = runner.execute_model, runner.sample_tokens
    wires = []

    def record(out):
        steps.append((wires.pop(0), out.sampled_token_ids, out.draft_token_ids))
        return out

    def recording(so):
        wires.append(pickle.dumps(so))  # before the step: what the scheduler sends
        out = execute(so)
        return None if out is None else record(out)

    runner.execute_model = recording
    runner.sample_tokens = lambda grammar_output=None: record(sample(grammar_output))
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=10)
    arrivals = {0: [("a", [5, 9, 17] * 7, SamplingParams.greedy(max_tokens=10)), ("b", list(range(60, 81)), seeded)],
                1: [("c", [5, 9, 17] * 7 + [3], SamplingParams.greedy(max_tokens=8))],
                4: [("d", _prompt(4, 6), seeded)],
                # "b" is aborted mid-prefill and sent again under the same id before the next step: that step's
                # output names it both finished and new, two requests to the runner (as to vLLM's).
                3: [("b", list(range(60, 75)), seeded)]}
    run_engine(engine, arrivals, aborts={3: ["b"]})
    assert any("b" in so.finished_req_ids and "b" in {n.req_id for n in so.scheduled_new_reqs}
               for so in (pickle.loads(wire) for wire, _, _ in steps))
    assert engine.stats.num_preemptions > 0 and engine.stats.num_draft_tokens > 0
    assert engine.stats.num_cached_prompt_tokens > 0

    fresh = ModelRunner(tiny_model(), engine.num_gpu_blocks, engine.block_size, "torch",
                        eos_token_id=engine.eos_token_id, speculative_config=engine.engine_args.speculative_config,
                        max_num_reqs=3, max_model_len=engine.max_model_len)
    for k, (wire, sampled, drafts) in enumerate(steps):
        out = run_step(fresh, pickle.loads(wire))
        assert out.sampled_token_ids == sampled, f"step {k}"
        assert out.draft_token_ids == drafts, f"step {k}"
    assert any(len(t) > 1 for _, sampled, _ in steps for t in sampled)  # some drafts were accepted
