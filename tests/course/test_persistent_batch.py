"""The V1 model runner's persistent batch the course keeps for chapter 10 (``minillm/course/persistent_batch.py``):
random sequences of add / append / rewrite / drafts / remove / swap / condense keep every buffer equal to a plain-dict
model of the requests (a hypothesis state machine), and the picture of condense in its docstring holds."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from minillm.course.persistent_batch import BlockTable, InputBatch
from minillm.sampling_params import SamplingParams
from minillm.worker.model_runner import CachedRequestState
from tests.engine_helpers import single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

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
