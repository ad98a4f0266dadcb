"""Small hand-made cases that pin the scheduler's semantics (vLLM V1's ``Scheduler.schedule``), one rule each.

Every case spells out its numbers: block size 4, a budget, a KV cache of a few blocks, prompts of a few tokens.
Without prefix caching unless the case is about it, so block counts are easy to follow.
"""
from __future__ import annotations

import pytest

from minillm.config import SchedulerConfig
from minillm.course.fake_runner import FakeModelRunner, WorkloadRequest, simulate
from minillm.core.sched.output import ModelRunnerOutput
from minillm.core.sched.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue
from minillm.core.sched.scheduler import Scheduler
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams

BS = 4  # block size in every case


def make_scheduler(budget: int = 32, max_num_seqs: int = 8, max_model_len: int = 32, num_blocks: int = 64,
                   caching: bool = False, policy: str = "fcfs", threshold: int = 0, chunked: bool = True
                   ) -> tuple[Scheduler, FakeModelRunner]:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold, policy=policy)
    sched = Scheduler(config, num_gpu_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
    return sched, FakeModelRunner(num_blocks, BS)


def req(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0, arrival: float = 0.0,
        start: int = 0) -> Request:
    return Request(rid, list(range(start, start + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival, priority=priority)


def step(sched: Scheduler, runner: FakeModelRunner):
    so = sched.schedule()
    outs = sched.update_from_output(so, runner.execute_model(so))
    return so, {o.request_id: o for o in outs}


def free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.num_free_blocks


# -- the token budget -------------------------------------------------------------------------------------------
def test_budget_split_running_decodes_first_then_new_prompt_takes_the_rest():
    sched, runner = make_scheduler(budget=16)
    sched.add_request(req("A", 5))
    sched.add_request(req("B", 5, start=100))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 5, "B": 5}
    sched.add_request(req("C", 30, start=200))
    so, _ = step(sched, runner)
    # Two decodes (one token each), then C's first chunk fills the budget exactly.
    assert list(so.num_scheduled_tokens.items()) == [("A", 1), ("B", 1), ("C", 14)]
    # Q6: the total counts C, admitted from the waiting queue in this very step; it runs in this step.
    assert so.total_num_scheduled_tokens == 16 == sched.max_num_scheduled_tokens
    assert [n.req_id for n in so.scheduled_new_reqs] == ["C"]
    assert so.scheduled_cached_reqs.req_ids == ["A", "B"]
    assert sched.requests["C"].status == RequestStatus.RUNNING


def test_chunked_prefill_chunks_a_long_prompt_and_advances_num_computed_tokens_at_schedule_time():
    sched, runner = make_scheduler(budget=8)
    sched.add_request(req("A", 20))
    chunks = []
    for expected_start in (0, 8, 16):
        so = sched.schedule()
        chunks.append(so.num_scheduled_tokens["A"])
        if expected_start == 0:
            assert so.scheduled_new_reqs[0].num_computed_tokens == 0
        else:
            assert so.scheduled_cached_reqs.num_computed_tokens == [expected_start]
        # Advanced as soon as scheduled, before the model runs.
        assert sched.requests["A"].num_computed_tokens == expected_start + chunks[-1]
        outs = sched.update_from_output(so, runner.execute_model(so))
        assert (len(outs) == 1) == (expected_start == 16)  # a token only when the prompt is done
    assert chunks == [8, 8, 4]
    assert sched.requests["A"].num_output_tokens == 1


def test_long_prefill_token_threshold_caps_each_request_per_step():
    sched, runner = make_scheduler(budget=32, threshold=4)
    sched.add_request(req("A", 10))
    sched.add_request(req("B", 10, start=50))
    per_step = [step(sched, runner)[0].num_scheduled_tokens for _ in range(3)]
    assert per_step == [{"A": 4, "B": 4}, {"A": 4, "B": 4}, {"A": 2, "B": 2}]
    assert step(sched, runner)[0].num_scheduled_tokens == {"A": 1, "B": 1}  # decodes are below the threshold


def test_max_num_seqs_limits_running_requests():
    sched, runner = make_scheduler(budget=32, max_num_seqs=2)
    for i, rid in enumerate("ABC"):
        sched.add_request(req(rid, 3, max_tokens=2, start=10 * i))
    so, _ = step(sched, runner)
    assert set(so.num_scheduled_tokens) == {"A", "B"}  # budget left, but no seat for C
    assert sched.get_request_counts() == (2, 1)
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert outs["A"].finish_reason == outs["B"].finish_reason == "length"
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"C": 3}
    assert so.finished_req_ids == {"A", "B"}


def test_chunked_prefill_off_stops_admission_at_a_prompt_that_does_not_fit():
    sched, runner = make_scheduler(budget=32, chunked=False)
    sched.add_request(req("A", 10))
    sched.add_request(req("B", 25, start=100))
    sched.add_request(req("C", 3, start=200))
    so, _ = step(sched, runner)
    # B needs 25 > 22 left: admission stops there; C (which would fit) does not overtake it.
    assert so.num_scheduled_tokens == {"A": 10}
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1, "B": 25, "C": 3}

    sched2, runner2 = make_scheduler(budget=32, chunked=True)
    for r in (req("A", 10), req("B", 25, start=100), req("C", 3, start=200)):
        sched2.add_request(r)
    assert step(sched2, runner2)[0].num_scheduled_tokens == {"A": 10, "B": 22}


# -- preemption ---------------------------------------------------------------------------------------------------
def _two_full_requests(policy: str, prio_a: int = 0, prio_b: int = 0, len_a: int = 8, len_b: int = 8):
    """A 4-block cache (+ null block) filled by A and B after one step; max_model_len 16 fits either alone."""
    sched, runner = make_scheduler(budget=32, max_model_len=16, num_blocks=5, policy=policy)
    sched.add_request(req("A", len_a, priority=prio_a, arrival=0.0))
    sched.add_request(req("B", len_b, priority=prio_b, arrival=1.0, start=100))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": len_a, "B": len_b}
    assert free_blocks(sched) == 0
    return sched, runner


def test_fcfs_preempts_the_last_running_request_and_admits_nobody_in_that_step():
    sched, runner = _two_full_requests("fcfs", len_b=7)
    sched.add_request(req("C", 1, start=300))  # would fit in a free block, but must not be admitted
    so, _ = step(sched, runner)
    # A's token 8 needs a third block: B (last in the running queue) is preempted by recompute.
    assert so.preempted_req_ids == {"B"}
    assert so.num_scheduled_tokens == {"A": 1}
    assert so.scheduled_new_reqs == []
    b = sched.requests["B"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert [r.request_id for r in sched.waiting] == ["B", "C"]  # back in front of the newcomer
    assert sched.kv_cache_manager.get_block_ids("B") == []
    # Next step: B (8 tokens, 2 blocks) does not fit the one free block, and C may not overtake it.
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1} and not so.preempted_req_ids


def test_fcfs_request_preempts_itself_when_it_is_the_last_one():
    sched, runner = _two_full_requests("fcfs", len_a=7, len_b=8)
    so, _ = step(sched, runner)
    # A's decode fits in its block; B's needs a new block, and B is the last running request: it preempts itself.
    assert so.num_scheduled_tokens == {"A": 1}
    assert so.preempted_req_ids == {"B"}
    assert [r.request_id for r in sched.running] == ["A"]


def _low_priority_first(len_a: int):
    """Priority policy; A (priority 1) arrives alone and runs, then B (priority 0, 8 tokens) and C (priority 0,
    7 tokens) join behind it in the running queue. After two steps each holds 2 blocks: the 6-block cache is full."""
    sched, runner = make_scheduler(budget=32, max_model_len=16, num_blocks=7, policy="priority")
    sched.add_request(req("A", len_a, priority=1, arrival=0.0))
    step(sched, runner)
    sched.add_request(req("B", 8, priority=0, arrival=1.0, start=100))
    sched.add_request(req("C", 7, priority=0, arrival=2.0, start=200))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1, "B": 8, "C": 7} and free_blocks(sched) == 0
    assert [r.request_id for r in sched.running] == ["A", "B", "C"]
    return sched, runner


def test_priority_preempts_the_largest_priority_even_if_already_scheduled_this_step():
    # A's decode (position 7) fits its block and is scheduled first; B's (position 8) needs a block. The victim is
    # A, the largest (priority, arrival_time), already scheduled: its token goes back to the budget. The loop then
    # goes on with C, which moved up one place in the running queue.
    sched, runner = _low_priority_first(len_a=6)
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"A"}
    assert so.num_scheduled_tokens == {"B": 1, "C": 1}
    assert so.total_num_scheduled_tokens == 2
    assert so.scheduled_cached_reqs.req_ids == ["B", "C"]
    assert [r.request_id for r in sched.running] == ["B", "C"]


def test_priority_request_preempts_itself_when_it_has_the_largest_priority():
    # A's decode (position 8) needs a block and A itself is the largest (priority, arrival_time): it preempts
    # itself, freeing its 2 blocks. The loop goes on (vLLM v0.33.0's Scheduler.schedule `continue`s): B (position 8)
    # takes one of them and C (position 7) needs none.
    sched, runner = _low_priority_first(len_a=7)
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"A"}
    assert so.num_scheduled_tokens == {"B": 1, "C": 1}
    assert [r.request_id for r in sched.running] == ["B", "C"]
    assert [r.request_id for r in sched.waiting] == ["A"]


def test_priority_self_preemption_does_not_starve_the_higher_priority_requests_behind_it():
    # The reproduction of issue 23: 16 usable blocks of 4, budget 64. X (priority 0, 24 tokens), then L (priority 5,
    # 14 tokens) behind it, then Y (priority 0, 17 tokens). At step 4 L's decode (position 16) needs a fifth block,
    # none is free, and L is the lowest-priority running request: it preempts itself and frees its 4 blocks. Y, after
    # it in the running queue, needs no new block (position 19 is in its fifth block) and must still get its token;
    # stopping the loop there (right under FCFS only) left 63 of the budget unused and Y without a token.
    sched, runner = make_scheduler(budget=64, max_model_len=64, num_blocks=17, policy="priority")
    arrivals = {0: req("X", 24, max_tokens=30, priority=0, arrival=0.0),
                1: req("L", 14, max_tokens=30, priority=5, arrival=1.0, start=100),
                2: req("Y", 17, max_tokens=30, priority=0, arrival=2.0, start=200)}
    for i in range(4):
        if i in arrivals:
            sched.add_request(arrivals[i])
        step(sched, runner)
    assert free_blocks(sched) == 0
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"L"}
    assert so.num_scheduled_tokens == {"X": 1, "Y": 1}
    assert free_blocks(sched) == 4


def test_priority_victim_ties_broken_by_later_arrival():
    sched, runner = _two_full_requests("priority", prio_a=0, prio_b=0, len_a=8, len_b=7)
    so, _ = step(sched, runner)
    # A needs a block; same priority, so the later arrival B is the victim, and A goes on.
    assert so.preempted_req_ids == {"B"}
    assert so.num_scheduled_tokens == {"A": 1}


def test_resumed_request_recomputes_prompt_and_outputs_and_keeps_its_tokens():
    sched, runner = make_scheduler(budget=32, max_model_len=16, num_blocks=5)
    sched.add_request(req("A", 4, max_tokens=10))
    sched.add_request(req("B", 4, max_tokens=10, start=100))
    for _ in range(5):
        so, _ = step(sched, runner)
        assert not so.preempted_req_ids
    b = sched.requests["B"]
    assert b.num_output_tokens == 5 and free_blocks(sched) == 0
    outputs_before = list(b.output_token_ids)
    so, _ = step(sched, runner)  # A needs its third block: B is preempted with 5 outputs
    assert so.preempted_req_ids == {"B"}
    while "A" in sched.requests:
        so, _ = step(sched, runner)
    # A finished; now B comes back as a *resumed* request and recomputes 4 prompt + 5 output tokens.
    so, outs = step(sched, runner)
    cached = so.scheduled_cached_reqs
    assert so.scheduled_new_reqs == []
    assert cached.req_ids == ["B"] and cached.resumed_req_ids == {"B"}
    assert so.num_scheduled_tokens == {"B": 9}
    assert cached.num_computed_tokens == [0]
    assert cached.all_token_ids["B"] == list(range(100, 104)) + outputs_before
    assert len(cached.new_block_ids[0]) == 3  # all its blocks, to replace the ones the runner dropped
    assert outs["B"].new_token_ids and b.output_token_ids[:5] == outputs_before

    # Its final output equals that of a run with a cache big enough that nothing is preempted.
    while "B" in sched.requests:
        step(sched, runner)
    ref = simulate(make_scheduler(budget=32, max_model_len=16, num_blocks=64)[0],
                   [WorkloadRequest("B", list(range(100, 104)), 10)])
    assert b.output_token_ids == ref.outputs["B"]
    assert b.num_preemptions == 1


def test_preemption_with_prefix_caching_resumes_from_its_own_cached_blocks():
    sched, runner = make_scheduler(budget=32, max_model_len=16, num_blocks=5, caching=True)
    sched.add_request(req("A", 4, max_tokens=7))
    sched.add_request(req("B", 4, max_tokens=10, start=100))
    for _ in range(6):
        so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"B"}
    while "A" in sched.requests:
        step(sched, runner)
    so, _ = step(sched, runner)
    # B's two full blocks were freed tail first, keeping their hashes. A's third block reused (evicted) B's second
    # one; B's first block survived, so B resumes with a 4-token prefix hit and recomputes the other 5 tokens.
    assert so.scheduled_cached_reqs.resumed_req_ids == {"B"}
    assert so.scheduled_cached_reqs.num_computed_tokens == [4]
    assert so.num_scheduled_tokens == {"B": 5}


# -- prefix caching -----------------------------------------------------------------------------------------------
def test_prefix_hit_skips_cached_full_blocks_but_never_the_last_token():
    sched, runner = make_scheduler(budget=64, caching=True)
    sched.add_request(req("A", 10))
    step(sched, runner)
    a_blocks = sched.kv_cache_manager.get_block_ids("A")
    sched.add_request(Request("B", list(range(8)) + [500, 501, 502], SamplingParams(max_tokens=4)))
    sched.add_request(Request("C", list(range(8)), SamplingParams(max_tokens=4)))  # whole prompt cached
    so, _ = step(sched, runner)
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    assert new["B"].num_computed_tokens == 8 and so.num_scheduled_tokens["B"] == 3
    assert new["B"].block_ids[:2] == a_blocks[:2]
    # C's 8 tokens are all cached, but its last token must be computed for logits: only 1 block is reused.
    assert new["C"].num_computed_tokens == 4 and so.num_scheduled_tokens["C"] == 4
    assert new["C"].block_ids[0] == a_blocks[0]


def test_prefix_cache_stats_count_a_waiting_request_once_at_admission():
    """B waits two steps for KV space and is looked up in each; the statistics count it once, when admitted
    (vLLM v0.33.0: Scheduler.schedule calls KVCacheManager.record_prefix_cache_stats after allocate_slots)."""
    sched, runner = make_scheduler(budget=32, max_model_len=16, num_blocks=6, caching=True)  # 5 usable blocks
    mgr = sched.kv_cache_manager
    lookups = []
    get_computed_blocks = mgr.get_computed_blocks
    mgr.get_computed_blocks = lambda r: lookups.append(r.request_id) or get_computed_blocks(r)
    sched.add_request(req("A", 8, max_tokens=1))  # 2 full blocks, finishes at once; they stay cached
    sched.add_request(req("D", 9, max_tokens=3, start=100))  # 3 blocks for 3 steps
    step(sched, runner)
    sched.add_request(Request("B", list(range(8)) + list(range(50, 56)), SamplingParams(max_tokens=2)))
    admitted_at = None
    for i in range(5):
        so, _ = step(sched, runner)
        if "B" in so.num_scheduled_tokens and admitted_at is None:
            admitted_at = i
            assert so.scheduled_new_reqs[0].num_computed_tokens == 8  # A's two blocks hit
    # B needs 4 free blocks (2 free cached hits + 2 new) and D holds 3 of 5 until it finishes.
    assert admitted_at == 2 and lookups.count("B") == 3
    s = mgr.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (3, 8 + 9 + 14, 0 + 0 + 8)  # A, D, B: once each
    assert s.preempted_requests == 0


# -- update_from_output -------------------------------------------------------------------------------------------
def test_sampled_token_of_a_request_mid_prefill_is_ignored():
    sched, _ = make_scheduler(budget=4, max_num_seqs=1)
    sched.add_request(req("A", 10))
    so = sched.schedule()
    outs = sched.update_from_output(so, ModelRunnerOutput(["A"], {"A": 0}, [[7]]))
    assert outs == [] and sched.requests["A"].output_token_ids == []


def test_eos_stops_and_frees_and_is_reported_once():
    sched, _ = make_scheduler(budget=32)
    sched.add_request(Request("A", [5, 6, 7], SamplingParams(max_tokens=8), eos_token_id=2))
    so = sched.schedule()
    assert free_blocks(sched) < sched.kv_cache_manager.num_blocks - 1
    outs = sched.update_from_output(so, ModelRunnerOutput(["A"], {"A": 0}, [[2]]))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("A", [2], "stop")]
    assert "A" not in sched.requests and sched.running == []
    assert free_blocks(sched) == sched.kv_cache_manager.num_blocks - 1
    assert sched.schedule().finished_req_ids == {"A"}
    assert sched.schedule().finished_req_ids == set()


def test_finished_requests_are_freed_after_exactly_max_tokens():
    sched, runner = make_scheduler(budget=32)
    sched.add_request(req("A", 6, max_tokens=3))
    got = []
    while sched.has_unfinished_requests():
        _, outs = step(sched, runner)
        got += outs["A"].new_token_ids if "A" in outs else []
    assert len(got) == 3
    assert free_blocks(sched) == sched.kv_cache_manager.num_blocks - 1


def test_abort_frees_running_and_waiting_requests():
    sched, runner = make_scheduler(budget=8, max_num_seqs=1)
    sched.add_request(req("A", 6))
    sched.add_request(req("B", 6, start=50))
    step(sched, runner)
    sched.finish_requests(["A", "B", "unknown"])
    assert sched.running == [] and len(sched.waiting) == 0 and sched.requests == {}
    assert free_blocks(sched) == sched.kv_cache_manager.num_blocks - 1
    assert sched.schedule().finished_req_ids == {"A", "B"}


# -- queues and policies ------------------------------------------------------------------------------------------
def test_priority_policy_admits_lowest_priority_value_first():
    sched, runner = make_scheduler(budget=32, max_num_seqs=1, policy="priority")
    sched.add_request(req("late_important", 2, priority=0, arrival=5.0))
    sched.add_request(req("early_normal", 2, priority=1, arrival=1.0, start=10))
    sched.add_request(req("early_important", 2, priority=0, arrival=2.0, start=20))
    assert [r.request_id for r in sched.waiting] == ["early_important", "late_important", "early_normal"]
    assert list(step(sched, runner)[0].num_scheduled_tokens) == ["early_important"]


def test_queues_prepend_semantics():
    a, b, c = req("a", 1, arrival=0), req("b", 1, arrival=1), req("c", 1, arrival=2)
    fcfs = FCFSRequestQueue()
    fcfs.add_request(b)
    fcfs.add_request(c)
    fcfs.prepend_request(a)
    assert [r.request_id for r in fcfs] == ["a", "b", "c"] and fcfs.pop_request() is a
    prio = PriorityRequestQueue()
    for r in (c, a, b):
        prio.prepend_request(r)  # no front in a heap: order by (priority, arrival)
    assert [prio.pop_request().request_id for _ in range(3)] == ["a", "b", "c"]
    with pytest.raises(IndexError):
        prio.peek_request()
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        create_request_queue("lifo")


# -- refused input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_batched_tokens=16, max_model_len=32, enable_chunked_prefill=False), "chunked prefill off"),
    (dict(long_prefill_token_threshold=8, enable_chunked_prefill=False, max_num_batched_tokens=2048),
     "needs enable_chunked_prefill"),
    (dict(max_num_batched_tokens=4, max_num_seqs=8), "max_num_seqs"),
    (dict(policy="lifo"), "policy must be one of"),
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(long_prefill_token_threshold=5000), "must not exceed max_model_len"),
])
def test_scheduler_config_refuses_invalid_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_scheduler_refuses_a_kv_cache_smaller_than_one_request_and_bad_requests():
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        make_scheduler(max_model_len=32, num_blocks=8)  # 7 usable blocks x 4 = 28 tokens < 32
    sched, _ = make_scheduler(max_model_len=32)
    sched.add_request(req("A", 4))
    with pytest.raises(ValueError, match="already in the scheduler"):
        sched.add_request(req("A", 4))
    with pytest.raises(ValueError, match="no room for an output"):
        sched.add_request(req("long", 32))


# -- the notebook's trace and stepper ---------------------------------------------------------------------------------
def test_trace_step_explains_each_request_and_the_stepper_runs_headless():
    from minillm.course.widgets.scheduler_stepper import SchedulerStepper, format_trace

    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=128,
                             long_prefill_token_threshold=8)
    st = SchedulerStepper(config, num_gpu_blocks=64, block_size=4,
                          requests=[("A", 5, 10, 0), ("B", 6, 10, 0), ("C", 40, 4, 0)])
    st.step()
    st.step()
    for rid, n in [("D", 3), ("E", 10), ("F", 6)]:
        st.add_request(n, 4, 0, rid)
    text = st.step()
    rows = {r.request_id: r for r in st.last_rows}
    assert [(r.request_id, r.granted) for r in st.last_rows] == [("A", 1), ("B", 1), ("C", 8), ("D", 3), ("E", 3),
                                                                  ("F", 0)]
    assert rows["A"].why == "decode: 1 token"
    assert "long_prefill_token_threshold" in rows["C"].why
    assert rows["E"].why.startswith("admitted: chunk") and rows["E"].budget_left == 3
    assert rows["F"].why == "not admitted: budget exhausted"
    assert "F" in text and format_trace(st.last_rows).count("\n") == 7
    with pytest.raises(ValueError, match="max_num_seqs"):
        st.set_budget(4)
    assert st.set_budget(24) and st.scheduler.max_num_scheduled_tokens == 24
    ui = st.ui()  # builds the ipywidgets tree without a front-end
    assert len(ui.children) == 3


# -- the real model, through the simple runner ----------------------------------------------------------------------
@pytest.mark.slow
def test_simple_runner_on_the_real_model_matches_plain_greedy_generation(model, tokenizer):
    """Chunked prefill (budget 8), two requests sharing steps, one arriving later and one preempted-free run: the
    greedy tokens equal minillm.generate's, one prompt at a time. (Chunking changes the float summation order by
    ~1e-6; these prompts' top-2 logit gaps are far larger, so the argmax cannot flip.)"""
    import minillm
    from minillm.course.simple_runner import run_timed

    prompts = [minillm.chat_prompt_ids(tokenizer, "What is the capital of France?"), [1, 504, 3458, 282]]
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=128)
    run = run_timed(model, config, [("a", prompts[0], 5, 0), ("b", prompts[1], 5, 2)])
    for rid, ids in zip("ab", prompts):
        assert run.outputs[rid] == minillm.generate(model, ids, 5, eos_token_id=-1)
    assert max(run.step_tokens) <= 8
    assert run.first_token_step["a"] == -(-len(prompts[0]) // 8) - 1  # ceil(prompt / budget) steps of prefill
    assert len(run.itl["a"]) == 4 and run.throughput > 0
    assert len(run.itl_cpu["a"]) == 4 and all(x > 0 for x in run.itl_cpu["a"])  # each gap ran the model once
    assert 0 < run.total_cpu_seconds and run.cpu_throughput > 0


def test_compare_schedulers_catches_a_forgotten_preemption_count():
    """The check of exercise 4.3 compares each request's state too, not only the SchedulerOutputs: a preemption
    that forgets ``num_preemptions += 1`` schedules exactly the same tokens, yet must be caught."""
    from minillm.course.fake_runner import compare_schedulers

    class ForgetsToCount(Scheduler):
        def _preempt_request(self, request):
            before = request.num_preemptions
            super()._preempt_request(request)
            request.num_preemptions = before

    assert compare_schedulers(Scheduler, num_workloads=20) > 0
    with pytest.raises(AssertionError, match="num_preemptions"):
        compare_schedulers(ForgetsToCount, num_workloads=20)


class _NeverArrives:
    """A KV connector's scheduler side for which request ``"remote"``'s K/V is always still on its way."""

    def bind_kv_cache_manager(self, kv_cache_manager):
        pass

    def on_new_request(self, request):
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return (None, False) if request.request_id == "remote" else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return None

    def request_finished(self, request, block_ids):
        return False, None

    def update_connector_output(self, kv_output):
        pass


def test_num_waiting_for_remote_kvs_is_never_stale_after_a_preempting_step():
    """It counts the waiting requests whose K/V has not arrived. A step that preempts runs no waiting pass: a
    request aborted just before such a step must still leave the count (it used to stay at its old value)."""
    from minillm.config import SchedulerConfig
    from minillm.core.sched.scheduler import Scheduler
    from minillm.request import Request, RequestStatus
    from minillm.sampling_params import SamplingParams

    def drive(abort_before: int | None) -> tuple[int, Scheduler]:
        """Decode "a" and "b" while "remote" waits; returns the step that preempted, and the scheduler then."""
        config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=32)
        sched = Scheduler(config, num_gpu_blocks=10, block_size=4)  # 9 usable blocks = 36 tokens
        sched.set_kv_connector(_NeverArrives())
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        sched.add_request(Request("remote", list(range(8)), params))
        for rid in ("a", "b"):
            sched.add_request(Request(rid, list(range(50, 66)), params))
        for step in range(40):
            if step == abort_before:
                sched.finish_requests(["remote"], RequestStatus.FINISHED_ABORTED)
            so = sched.schedule()
            if so.preempted_req_ids:
                return step, sched
            assert sched.num_waiting_for_remote_kvs == (1 if abort_before is None or step < abort_before else 0)
            for rid in so.num_scheduled_tokens:
                r = sched.requests[rid]
                if r.num_computed_tokens >= r.num_tokens:
                    r.append_output_token_ids(1)
        raise AssertionError("no step preempted")

    preempting_step, sched = drive(None)
    assert preempting_step > 0 and sched.num_waiting_for_remote_kvs == 1   # "remote" still waits
    step, sched = drive(abort_before=preempting_step)
    assert step == preempting_step and "remote" not in sched.requests
    assert sched.num_waiting_for_remote_kvs == 0
