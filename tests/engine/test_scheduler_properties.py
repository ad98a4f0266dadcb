"""Properties of the scheduler over random workloads, driven by the fake model runner.

Each example draws a configuration (budget, seats, threshold, chunking, policy, block size, a KV cache from
"just one request fits" to "everything fits", prefix caching on or off) and a workload (prompt lengths, output
lengths, arrival steps, priorities, shared prefixes). The fake runner itself checks, every step, that the
SchedulerOutput is consistent with what it was sent before and that every history read back through the block table
holds the right tokens.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.config import SchedulerConfig
from minillm.course.fake_runner import random_workload, simulate
from minillm.core.sched.scheduler import Scheduler
from minillm.request import RequestStatus

BLOCK_SIZES = (1, 2, 4, 8)
MAX_MODEL_LEN = 64


@st.composite
def scenarios(draw):
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.sampled_from([1, 2, 3, 8]))
    if chunked:
        budget = draw(st.integers(max(max_num_seqs, 1), 48))
        threshold = draw(st.sampled_from([0, 0, 1, 5, 16]))
    else:
        budget = draw(st.integers(MAX_MODEL_LEN, 96))
        threshold = 0
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
                             enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold,
                             policy=draw(st.sampled_from(["fcfs", "priority"])))
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    # From the smallest cache the scheduler accepts (one max_model_len request) to one that holds everything.
    num_blocks = MAX_MODEL_LEN // block_size + 1 + draw(st.sampled_from([0, 1, 3, 10, 200]))
    workload = random_workload(draw(st.integers(0, 10**6)), num_requests=draw(st.integers(1, 10)),
                               prompt_len=(1, 40), max_tokens=(1, 20), arrival_steps=draw(st.sampled_from([1, 5, 20])),
                               num_priorities=3, shared_prefix_len=draw(st.sampled_from([0, 8, 16])))
    caching = draw(st.booleans())
    return config, num_blocks, block_size, caching, workload


def _check_step(config: SchedulerConfig, usable_blocks: int):
    def on_step(sched: Scheduler, record) -> None:
        so = record.output
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
        assert len(sched.running) <= config.max_num_seqs
        if config.long_prefill_token_threshold:
            assert max(so.num_scheduled_tokens.values(), default=0) <= config.long_prefill_token_threshold
        # No admission in a step that preempted.
        if so.preempted_req_ids:
            assert not so.scheduled_new_reqs and not so.scheduled_cached_reqs.resumed_req_ids
        assert not (so.preempted_req_ids & set(so.num_scheduled_tokens))
        # Every scheduled request is running and no request computes past its tokens.
        for rid in so.num_scheduled_tokens:
            r = sched.requests[rid]
            assert r.status == RequestStatus.RUNNING and r.num_computed_tokens <= r.num_tokens
        assert 0 <= record.num_used_blocks <= usable_blocks
        # Every step schedules something, unless nothing runs or a request preempted itself (which ends the
        # running loop, and no admission follows a preemption).
        assert so.num_scheduled_tokens or so.preempted_req_ids or not sched.running
    return on_step


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_limits_hold_every_step_and_every_request_finishes_with_its_length(scenario):
    config, num_blocks, block_size, caching, workload = scenario
    sched = Scheduler(config, num_blocks, block_size, enable_prefix_caching=caching)
    result = simulate(sched, workload, on_step=_check_step(config, num_blocks - 1), max_steps=3000)
    # ignore_eos: each request stops by length, exactly at max_tokens or where it reaches max_model_len.
    for w in workload:
        assert len(result.outputs[w.request_id]) == min(w.max_tokens, MAX_MODEL_LEN - len(w.prompt_token_ids))
        assert result.finish_reasons[w.request_id] == "length"
    # No KV block leaks: everything is back in the free queue; nothing is left in the queues.
    assert sched.kv_cache_manager.num_free_blocks == num_blocks - 1
    assert all(b.ref_cnt == 0 for b in sched.kv_cache_manager.block_pool.blocks[1:])
    assert sched.running == [] and len(sched.waiting) == 0 and sched.requests == {}


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_outputs_do_not_depend_on_chunking_preemption_or_prefix_caching(scenario):
    """The fake model, like a real one, is a function of the tokens: whatever the schedule, the outputs match a
    run with one big step per request, a cache that holds everything and no prefix caching."""
    config, num_blocks, block_size, caching, workload = scenario
    result = simulate(Scheduler(config, num_blocks, block_size, enable_prefix_caching=caching), workload,
                      max_steps=3000)
    roomy = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=64, max_model_len=MAX_MODEL_LEN,
                            policy=config.policy)
    reference = simulate(Scheduler(roomy, 1024, block_size, enable_prefix_caching=False), workload)
    assert result.outputs == reference.outputs
    assert not any(reference.num_preemptions.values())


def test_a_cache_that_fits_only_one_request_at_a_time_still_finishes_everything():
    """The tightest cache the scheduler accepts, long requests that cannot share it, both policies: no deadlock,
    and preemption really happens."""
    for policy in ("fcfs", "priority"):
        config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
                                 policy=policy)
        workload = random_workload(7, num_requests=8, prompt_len=(30, 40), max_tokens=(15, 20), arrival_steps=3,
                                   num_priorities=3)
        sched = Scheduler(config, MAX_MODEL_LEN // 4 + 1, 4, enable_prefix_caching=False)
        result = simulate(sched, workload, max_steps=3000)
        assert all(len(result.outputs[w.request_id]) == w.max_tokens for w in workload)
        assert sum(result.num_preemptions.values()) > 0
        assert sched.kv_cache_manager.num_free_blocks == MAX_MODEL_LEN // 4
