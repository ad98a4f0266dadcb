"""The persistent batch (InputBatch, BlockTable) and the runner that keeps it.

1. Random sequences of add / append / rewrite / drafts / remove / swap / condense keep every buffer equal to a
   plain-dict model of the requests (a hypothesis state machine).
2. On real engine steps (chunked prefill, prefix-cache hits, preemption, n-gram drafts, requests finishing and
   aborted mid-batch), the BatchInputs the runner gathers from the persistent batch equal
   ``prepare_inputs(...)``'s field by field, dtypes included, and the batch holds exactly the scheduled requests.
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
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from minillm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.parts import EngineParts
from minillm.sampling_params import SamplingParams
from minillm.worker.block_table import BlockTable
from minillm.worker.input_batch import InputBatch
from minillm.worker.model_runner import BatchInputs, CachedRequestState, ModelRunner, prepare_inputs
from tests.engine_helpers import TINY, single_thread, tiny_model  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

_TINY_MODEL = tiny_model()


# -- 1. the buffers against a plain-dict model --------------------------------------------------------------------
MAX_REQS, MAX_LEN, BS = 4, 12, 4  # block-table rows are ceil(12 / 4) = 3 wide
WIDTH = -(-MAX_LEN // BS)
token = st.integers(0, 2**31 - 1)  # the whole int32 range: the buffer must not truncate ids


class InputBatchMachine(RuleBasedStateMachine):
    """The model: request id -> its tokens, prompt length, computed tokens and blocks (``reqs``), and the drafts
    written for it since its tokens last changed (``drafts``)."""

    ids = Bundle("ids")

    def __init__(self) -> None:
        super().__init__()
        self.batch = InputBatch(MAX_REQS, MAX_LEN, BS)
        self.reqs: dict[str, dict] = {}
        self.drafts: dict[str, list[int]] = {}
        self.counter = 0
        self.condensed = True  # no hole since the last condense()

    def _slot(self, rid: str) -> int:
        return self.batch.req_id_to_index[rid]

    @rule(target=ids, data=st.data())
    def add(self, data):
        n = data.draw(st.integers(1, MAX_LEN))
        state = CachedRequestState(f"r{self.counter}", data.draw(st.integers(1, n)), SamplingParams.greedy(),
                                   data.draw(st.lists(token, min_size=n, max_size=n)),
                                   data.draw(st.lists(st.integers(1, 99), max_size=WIDTH)),
                                   data.draw(st.integers(0, n)))
        self.counter += 1
        if len(self.reqs) == MAX_REQS:
            with pytest.raises(ValueError, match="the batch is full.*max_num_reqs"):
                self.batch.add_request(state)
            return state.req_id  # an id the batch does not hold
        holes = [i for i, r in enumerate(self.batch.req_ids) if r is None]
        slot = self.batch.add_request(state)
        assert slot == (holes[0] if holes else len(self.reqs))  # the lowest hole first, as vLLM
        self.reqs[state.req_id] = dict(tokens=list(state.token_ids), prompt=state.num_prompt_tokens,
                                       computed=state.num_computed_tokens, blocks=list(state.block_ids))
        self.drafts[state.req_id] = []
        return state.req_id

    @rule(data=st.data())
    def add_too_long(self, data):
        extra = data.draw(st.sampled_from(["tokens", "blocks"]))
        n = MAX_LEN + 1 if extra == "tokens" else 1
        state = CachedRequestState("too-big", 1, SamplingParams.greedy(), [1] * n,
                                   [1] * (WIDTH + 1 if extra == "blocks" else 1), 0)
        before = (list(self.batch.req_ids), dict(self.batch.req_id_to_index))
        with pytest.raises(ValueError, match="max_model_len|max_num_reqs"):
            self.batch.add_request(state)
        assert (list(self.batch.req_ids), dict(self.batch.req_id_to_index)) == before  # nothing changed

    @rule(rid=ids, data=st.data())
    def append_tokens(self, rid, data):
        if rid not in self.reqs:
            return
        m = self.reqs[rid]
        new = data.draw(st.lists(token, min_size=1, max_size=3))
        if len(m["tokens"]) + len(new) > MAX_LEN:
            with pytest.raises(ValueError, match="max_model_len"):
                self.batch.append_token_ids(self._slot(rid), new)
            return
        self.batch.append_token_ids(self._slot(rid), new)
        m["tokens"] += new
        self.drafts[rid] = []

    @rule(rid=ids, data=st.data())
    def rewrite_tokens(self, rid, data):
        if rid in self.reqs:
            tokens = data.draw(st.lists(token, min_size=self.reqs[rid]["prompt"], max_size=MAX_LEN))
            self.batch.set_token_ids(self._slot(rid), tokens)
            self.reqs[rid]["tokens"] = tokens
            self.drafts[rid] = []

    @rule(rid=ids, data=st.data())
    def write_drafts(self, rid, data):
        if rid not in self.reqs:
            return
        room = MAX_LEN - len(self.reqs[rid]["tokens"])
        drafts = data.draw(st.lists(token, min_size=1, max_size=room + 1))
        if len(drafts) > room:
            with pytest.raises(ValueError, match="max_model_len"):
                self.batch.update_req_spec_token_ids(rid, drafts)
            return
        self.batch.update_req_spec_token_ids(rid, drafts)
        self.drafts[rid] = drafts

    @rule(rid=ids, data=st.data())
    def append_blocks(self, rid, data):
        if rid not in self.reqs:
            return
        m = self.reqs[rid]
        new = data.draw(st.lists(st.integers(1, 99), max_size=2))
        if len(m["blocks"]) + len(new) > WIDTH:
            with pytest.raises(ValueError, match="max_num_blocks_per_req"):
                self.batch.block_table.append_row(new, self._slot(rid))
            return
        self.batch.block_table.append_row(new, self._slot(rid))
        m["blocks"] += new

    @rule(rid=ids, computed=st.integers(0, MAX_LEN))
    def set_computed(self, rid, computed):
        if rid in self.reqs:
            self.batch.num_computed_tokens_cpu[self._slot(rid)] = computed
            self.reqs[rid]["computed"] = computed

    @rule(rid=consumes(ids))
    def remove(self, rid):
        slot = self.batch.req_id_to_index.get(rid)
        assert self.batch.remove_request(rid) == slot  # None for an id it does not hold
        if rid in self.reqs:
            del self.reqs[rid], self.drafts[rid]
            self.condensed = False
        assert self.batch.remove_request(rid) is None  # a second removal is a no-op

    @rule()
    def condense(self):
        self.batch.condense()
        self.condensed = True
        # Drafts are written after condense() in a step; a move copies only the tokens.
        for rid in self.drafts:
            self.drafts[rid] = []
        assert sorted(self.batch.req_id_to_index.values()) == list(range(len(self.reqs)))
        assert len(self.batch.req_ids) == len(self.reqs)

    @precondition(lambda self: self.condensed and len(self.reqs) >= 2)
    @rule(data=st.data())
    def swap(self, data):
        i1, i2 = data.draw(st.permutations(range(len(self.reqs))))[:2]
        self.batch.swap_states(i1, i2)
        for rid in self.drafts:
            self.drafts[rid] = []

    @invariant()
    def buffers_equal_the_model(self):
        b = self.batch
        assert b.num_reqs == len(self.reqs) and set(b.req_id_to_index) == set(self.reqs)
        used = set()
        for rid, m in self.reqs.items():
            i = b.req_id_to_index[rid]
            assert b.req_ids[i] == rid
            used.add(i)
            n = len(m["tokens"])
            assert b.num_tokens_no_spec[i] == n and b.get_token_ids(rid).tolist() == m["tokens"]
            assert b.token_ids_cpu[i, n:n + len(self.drafts[rid])].tolist() == self.drafts[rid]
            assert b.num_prompt_tokens[i] == m["prompt"] and b.num_computed_tokens_cpu[i] == m["computed"]
            nb = len(m["blocks"])
            assert b.block_table.num_blocks_per_row[i] == nb
            assert b.block_table.block_table[i, :nb].tolist() == m["blocks"]
        # Past each row's blocks, and in every free row, only the null block: the gathered table's padding.
        for i in range(MAX_REQS):
            nb = b.block_table.num_blocks_per_row[i] if i in used else 0
            assert not b.block_table.block_table[i, nb:].any()
        assert all(r is None for i, r in enumerate(b.req_ids) if i not in used)


TestInputBatchMachine = InputBatchMachine.TestCase
TestInputBatchMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_condense_moves_the_last_requests_into_the_lowest_holes():
    """The picture in the module docstring: A B C D E, remove B and D, condense: E moves into slot 1."""
    batch = InputBatch(8, 16, 4)
    for k, rid in enumerate("ABCDE"):
        batch.add_request(CachedRequestState(rid, 2, SamplingParams.greedy(), [k, k + 10], [k + 1], 1))
    batch.remove_request("B")
    batch.remove_request("D")
    batch.condense()
    assert batch.req_ids == ["A", "E", "C"]
    assert batch.get_token_ids("E").tolist() == [4, 14] and batch.block_table.block_table[1, 0] == 5
    assert not batch.block_table.block_table[3:].any()  # the rows E and D left are empty


@pytest.mark.parametrize("args, match", [
    (dict(max_num_reqs=0, max_model_len=8, block_size=4), "max_num_reqs must be an integer >= 1, got 0"),
    (dict(max_num_reqs=2, max_model_len=8.0, block_size=4), "max_model_len must be an integer >= 1, got 8.0"),
    (dict(max_num_reqs=2, max_model_len=8, block_size=True), "block_size must be an integer >= 1, got True"),
])
def test_input_batch_refuses_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        InputBatch(**args)
    with pytest.raises(ValueError, match="max_num_blocks_per_req must be an integer >= 1, got -1"):
        BlockTable(2, -1)


def test_drafts_move_with_their_request():
    """Drafts sit after a slot's tokens (update_req_spec_token_ids) until the step that verifies them is over: a
    swap (the attention backend's reorder, challenge 10) or a condense takes them along, whichever slot is longer."""
    batch = InputBatch(4, 16, 4)
    for k, (rid, tokens) in enumerate([("A", [1, 2, 3, 4, 5]), ("B", [6]), ("C", [7, 8])]):
        batch.add_request(CachedRequestState(rid, len(tokens), SamplingParams.greedy(), tokens, [k + 1], 0))
    batch.update_req_spec_token_ids("B", [90, 91, 92, 93, 94, 95])  # B's tokens and drafts outrun A's tokens
    batch.update_req_spec_token_ids("C", [80])
    row = {rid: lambda r=rid: batch.token_ids_cpu[batch.req_id_to_index[r], :7].tolist() for rid in "BC"}
    before = row["B"]()
    batch.swap_states(0, 1)
    assert batch.req_ids == ["B", "A", "C"] and row["B"]() == before == [6, 90, 91, 92, 93, 94, 95]
    assert batch.get_token_ids("A").tolist() == [1, 2, 3, 4, 5]
    batch.remove_request("B")
    batch.condense()  # C moves from slot 2 into slot 0, its draft with it
    assert batch.req_ids == ["C", "A"] and batch.token_ids_cpu[0, :3].tolist() == [7, 8, 80]
    batch.append_token_ids(0, [81])  # the step is over: its sampled token replaces the draft
    assert batch.num_spec_tokens[0] == 0 and batch.get_token_ids("C").tolist() == [7, 8, 81]


def test_swap_states_needs_two_requests():
    batch = InputBatch(4, 8, 4)
    batch.add_request(CachedRequestState("A", 1, SamplingParams.greedy(), [3], [1], 0))
    with pytest.raises(ValueError, match="two occupied slots"):
        batch.swap_states(0, 1)


# -- 2. the gathered batch equals prepare_inputs on real engine steps ----------------------------------------------
def assert_same_batch(got: BatchInputs, want: BatchInputs, what: str) -> None:
    """Field by field, dtypes and devices included (exact: these are integers)."""
    assert got.req_ids == want.req_ids, what
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_table", "slot_mapping",
                 "logits_indices"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.device == w.device, f"{what}: {name} {g.dtype} vs {w.dtype}"
        assert torch.equal(g, w), f"{what}: {name} {g.tolist()} vs {w.tolist()}"
    assert got.discard_request_mask.dtype == want.discard_request_mask.dtype == np.bool_, what
    assert got.discard_request_mask.tolist() == want.discard_request_mask.tolist(), what
    assert got.draft_token_ids == want.draft_token_ids, what
    assert got.attn_metadata.max_query_len == want.attn_metadata.max_query_len, what
    assert got.attn_metadata.max_seq_len == want.attn_metadata.max_seq_len, what


class Watch:
    """Runs both builds at every step of an engine (the persistent batch is what the step uses), compares them, and
    checks the batch holds exactly the scheduled requests, dense and equal to their states."""

    def __init__(self, engine: LLMEngine) -> None:
        self.runner = runner = engine.model_runner
        self.steps = self.discards = self.moves = 0
        self.max_drafts = 0
        self._slots: dict[str, int] = {}
        runner._prepare_inputs = self._both  # an instance attribute shadows the method for this runner only

    def _both(self, so: SchedulerOutput) -> BatchInputs:
        runner, batch = self.runner, self.runner.input_batch
        what = f"step {self.steps}"
        assert set(batch.req_id_to_index) == set(so.num_scheduled_tokens), what
        assert sorted(batch.req_id_to_index.values()) == list(range(batch.num_reqs)), what  # condensed
        for rid, i in batch.req_id_to_index.items():
            state = runner.requests[rid]
            assert batch.get_token_ids(rid).tolist() == state.token_ids, f"{what}: {rid} tokens"
            n = batch.block_table.num_blocks_per_row[i]
            assert batch.block_table.block_table[i, :n].tolist() == state.block_ids, f"{what}: {rid} blocks"
            assert batch.num_computed_tokens_cpu[i] == state.num_computed_tokens, f"{what}: {rid} computed"
            assert batch.num_prompt_tokens[i] == state.num_prompt_tokens, what
            self.moves += rid in self._slots and self._slots[rid] != i
        self._slots = dict(batch.req_id_to_index)
        got = ModelRunner._prepare_inputs(runner, so)
        want = prepare_inputs(so, runner.requests, runner.block_size, runner.device)
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
        assert watch.moves > 0  # condense() moved a request into a hole
    assert not engine.model_runner.requests and engine.model_runner.input_batch.req_ids == []  # no hole left


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
    that slot's tokens in place (``set_token_ids``) and the batch stays equal to prepare_inputs'."""
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
    batch = decode.model_runner.input_batch
    rewrites = []
    set_token_ids = batch.set_token_ids
    batch.set_token_ids = lambda i, ids: rewrites.append(batch.req_ids[i]) or set_token_ids(i, ids)
    got = run_engine(decode, {0: [(f"d{i}", p, SamplingParams.greedy(max_tokens=5)) for i, p in enumerate(prompts)]})
    plain = run_engine(_engine(max_model_len=64), {0: [(f"d{i}", p, SamplingParams.greedy(max_tokens=5))
                                                       for i, p in enumerate(prompts)]})
    assert got == plain
    assert decode.kv_connector_worker.stats["loaded_requests"] >= 2 and rewrites == ["d1"]
    assert watch.steps > 5


def test_a_learners_prepare_inputs_is_called_as_before():
    """With a learner's function in parts.prepare_inputs (chapter 8), the runner calls it with the request states,
    never the persistent batch; the batch is kept all the same."""
    calls = []

    def learners(scheduler_output, requests, block_size, device="cpu"):
        calls.append((type(requests), block_size, device))
        batch = engine.model_runner.input_batch
        for rid in scheduler_output.num_scheduled_tokens:
            assert batch.get_token_ids(rid).tolist() == requests[rid].token_ids
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
    with pytest.raises(ValueError, match=r"the batch is full: 1 requests \(max_num_reqs\).*'B'"):
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
    execute = runner.execute_model

    def recording(so):
        wire = pickle.dumps(so)  # before the step: what the scheduler sends
        out = execute(so)
        steps.append((wire, out.sampled_token_ids, out.draft_token_ids))
        return out

    runner.execute_model = recording
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
        out = fresh.execute_model(pickle.loads(wire))
        assert out.sampled_token_ids == sampled, f"step {k}"
        assert out.draft_token_ids == drafts, f"step {k}"
    assert any(len(t) > 1 for _, sampled, _ in steps for t in sampled)  # some drafts were accepted
