"""The engine core: async scheduling gives the synchronous engine's tokens, and the messages that cross the process
boundary carry everything a step needs.

In process, on the tiny random model (fast, so many configurations): for chunked prefill, prefix hits, forced
preemption, staggered arrivals, stop ids, ``min_tokens`` and seeded sampling, the engine with async scheduling
(``AsyncScheduler`` + the batch queue) returns exactly the tokens of the synchronous one, never goes past
``max_tokens``, wastes at most one step per request that stops on a token, and leaves no block, placeholder or
runner state behind. The wire types round-trip through msgpack unchanged.
"""
from __future__ import annotations

import random

import msgspec
import pytest

from minillm.core.sched.async_scheduler import AsyncScheduler
from minillm.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats, UtilityOutput
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.core import EngineCore
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams
from minillm.serial_utils import MsgpackDecoder, MsgpackEncoder
from tests.engine_helpers import TINY, single_thread, tiny_model  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

# name: engine arguments (the tiny model: vocabulary 211, 512 positions)
CONFIGS = {
    "one budget, no chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=512, num_gpu_blocks=200),
    "chunks of 5, block 4": dict(long_prefill_token_threshold=5, max_num_batched_tokens=24, block_size=4,
                                 num_gpu_blocks=300, max_num_seqs=5),
    "tight cache: preemption": dict(max_num_batched_tokens=64, block_size=4, num_gpu_blocks=40, max_model_len=128,
                                    long_prefill_token_threshold=16),
    "priority policy, no prefix cache": dict(scheduling_policy="priority", enable_prefix_caching=False,
                                             max_num_batched_tokens=32, block_size=8, num_gpu_blocks=120),
}


def workload(seed: int, seeded_sampling: bool) -> list[tuple[int, str, list[int], SamplingParams, int]]:
    """``(arrival step, id, prompt, params, priority)``: shared prefixes (prefix hits), stop ids, min_tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(211) for _ in range(21)]
    out = []
    for i in range(12):
        body = [rng.randrange(211) for _ in range(rng.randrange(1, 40))]
        prompt = system + body if i % 3 == 0 else body
        kind = i % 4
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 14), ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[rng.randrange(211)],
                                    min_tokens=2)
        elif kind == 2 and seeded_sampling:
            params = SamplingParams(temperature=1.0, top_k=20, seed=1000 + i, max_tokens=10, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 9), ignore_eos=True)
        out.append((rng.randrange(6), f"r{i}", prompt, params, rng.randrange(3)))
    return out


def run(engine: LLMEngine, requests) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    pending = sorted(requests, key=lambda r: r[0])
    step = 0
    while pending or engine.has_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params, prio = pending.pop(0)
            engine.add_request(rid, prompt, params, priority=prio)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 3000, "no progress"
    return tokens


def make(async_scheduling: bool, **args) -> LLMEngine:
    return LLMEngine(tiny_model(), None, EngineArgs(async_scheduling=async_scheduling, **args))


def assert_idle_and_clean(engine: LLMEngine) -> None:
    core = engine.engine_core.engine_core
    assert not core.batch_queue and not core.scheduler.requests
    assert engine.get_num_free_blocks() == engine.num_gpu_blocks - 1
    assert not core.model_runner.requests and not core.model_runner.req_states.req_id_to_index


@pytest.mark.parametrize("name", list(CONFIGS))
def test_async_scheduling_gives_the_synchronous_tokens(name):
    args = CONFIGS[name]
    preempting = "preemption" in name
    # Seeded sampling is compared only without preemption: a request preempted while a step is in flight for it
    # loses that step's draw (its token is dropped), so its generator is one draw further on when it resumes.
    requests = workload(seed=len(name), seeded_sampling=not preempting)
    sync_engine, async_engine = make(False, **args), make(True, **args)
    assert isinstance(async_engine.scheduler, AsyncScheduler) and async_engine.async_scheduling
    want, got = run(sync_engine, requests), run(async_engine, requests)
    assert got == want
    for _, rid, prompt, params, _ in requests:
        assert 1 <= len(got[rid]) <= params.max_tokens
    if preempting:
        assert sync_engine.stats.num_preemptions > 0 and async_engine.stats.num_preemptions > 0
    if args.get("enable_prefix_caching", True) and not preempting:
        assert async_engine.stats.num_cached_prompt_tokens == sync_engine.stats.num_cached_prompt_tokens > 0
    # The async engine computes at most one token more per request than the synchronous one (the step already
    # planned when a request stops on a token), and more only when some request stopped early.
    extra = async_engine.stats.num_scheduled_tokens - sync_engine.stats.num_scheduled_tokens
    early = sum(len(got[rid]) < p.max_tokens for _, rid, _, p, _ in requests)
    if not preempting:
        assert 0 <= extra <= early
    for engine in (sync_engine, async_engine):
        assert_idle_and_clean(engine)


def test_async_scheduling_plans_the_next_step_while_one_runs():
    """One request, 6 tokens: the first turn only launches a step (no outputs yet), and the request never runs a
    step past its max_tokens (the step in flight samples the last one)."""
    engine = make(True, max_num_batched_tokens=64)
    core = engine.engine_core.engine_core
    engine.add_request("a", list(range(10)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    outputs, executed = core.step_with_batch_queue()
    assert outputs is None and executed and len(core.batch_queue) == 1
    request = core.scheduler.requests["a"]
    assert request.num_computed_tokens == 10 and request.num_tokens == 10 and request.num_output_placeholders == 1
    outputs, executed = core.step_with_batch_queue()  # plans the first decode, then waits for the prefill
    assert executed and len(outputs.outputs) == 1 and len(core.batch_queue) == 1
    # the decode in flight is counted as computed before its input token is known
    assert request.num_computed_tokens == 11 and request.num_tokens == 11 and request.num_output_placeholders == 1
    tokens = list(outputs.outputs[0].new_token_ids)
    while core.has_requests():
        outputs, _ = core.step_with_batch_queue()
        if outputs is not None:
            tokens += [t for o in outputs.outputs for t in o.new_token_ids]
    assert len(tokens) == 6
    assert core.stats.num_scheduled_tokens == 10 + 5  # the prompt, then one decode per token after the first
    assert core.stats.num_steps == 6


def test_a_request_preempted_with_a_step_in_flight_drops_its_token_and_resumes():
    engine = make(True, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=12, max_model_len=40)
    core = engine.engine_core.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = make(False, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=12, max_model_len=40)
    requests = [(0, "a", list(range(15)), params, 0), (0, "b", list(range(100, 115)), params, 0)]
    assert run(engine, requests) == run(reference, requests)
    assert core.stats.num_preemptions > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reset_prefix_cache_preempts_every_running_request_and_the_tokens_stay(async_scheduling):
    """vLLM's reset after new weights (Scheduler.reset_prefix_cache(reset_running_requests=True)): every running
    request is preempted between two steps, back to the waiting queue in running order, and the reset succeeds; the
    runner still holds them, and the next plan resumes them with their tokens resent; greedy tokens are those of a
    run without the reset."""
    args = dict(max_num_batched_tokens=64, block_size=4, num_gpu_blocks=24, max_model_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    requests = [(0, "a", list(range(12)), params, 0), (0, "b", list(range(100, 109)), params, 0)]
    want = run(make(False, **args), requests)
    engine = make(async_scheduling, **args)
    core = engine.engine_core.engine_core
    sched = core.scheduler
    for _, rid, prompt, p, _ in requests:
        engine.add_request(rid, prompt, p)
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_requests():
        if step == 4:
            assert core.reset_prefix_cache() is False  # the running requests hold blocks
            assert core.reset_prefix_cache(reset_running_requests=True) is True
            assert not sched.running and [r.request_id for r in sched.waiting] == ["a", "b"]
            assert all(r.status.name == "PREEMPTED" and r.num_computed_tokens == 0 for r in sched.waiting)
            assert sched.kv_cache_manager.num_free_blocks == engine.num_gpu_blocks - 1
            assert sched.kv_cache_manager.block_pool.num_cached_blocks == 0
            assert set(core.model_runner.req_states.req_id_to_index) == {"a", "b"}
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        if step == 4:
            plan = core.last_scheduler_output
            assert plan.scheduled_cached_reqs.resumed_req_ids == {"a", "b"}
            assert set(plan.scheduled_cached_reqs.all_token_ids) == {"a", "b"}
        step += 1
        assert step < 200, "no progress"
    assert tokens == want
    assert_idle_and_clean(engine)


def test_async_scheduling_is_refused_with_ngram_drafts_and_a_learners_scheduler():
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="Async scheduling is not supported by the V1 model runner with "
                                         "ngram-based speculative decoding"):
        EngineArgs(async_scheduling=True, speculative_config=spec)
    # vLLM v0.33.0 by platform: None is on for a GPU unless incompatible, off on a CPU; True asks for it anywhere.
    assert not EngineArgs(speculative_config=spec).resolved_async_scheduling("cuda")
    assert EngineArgs().resolved_async_scheduling("cuda") and EngineArgs().resolved_async_scheduling("cuda:1")
    assert not EngineArgs().resolved_async_scheduling("cpu")
    assert EngineArgs(async_scheduling=True).resolved_async_scheduling("cpu")
    assert not EngineArgs(async_scheduling=False).resolved_async_scheduling("cuda")
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
        EngineArgs(async_scheduling="yes")

    from minillm.core.sched.scheduler import Scheduler
    from minillm.engine.parts import EngineParts

    class Mine(Scheduler):  # chapter 4's kind: it counts no placeholders, so it would schedule wrong under async
        def _schedule_running(self, step):
            return super()._schedule_running(step)

    with pytest.raises(ValueError, match="async scheduling needs a scheduler that counts output placeholders.*"
                                         "a replaced scheduler \\(Mine\\) needs async_scheduling=False"):
        EngineCore(tiny_model(), EngineArgs(), EngineParts(scheduler_cls=Mine), async_scheduling=True)
    assert isinstance(EngineCore(tiny_model(), EngineArgs(), EngineParts(scheduler_cls=Mine)).scheduler, Mine)


def test_async_scheduling_takes_a_replaced_scheduler_that_counts_placeholders():
    """A subclass of AsyncScheduler, or a Scheduler subclass that overrides _update_after_schedule (exercise 10.2),
    is used as given, as vLLM's SchedulerConfig.get_scheduler_cls does; it gives the synchronous tokens."""
    from minillm.engine.parts import EngineParts

    class Counting(AsyncScheduler):
        pass

    from tests.course.test_exercises_10 import Reference as OwnCount  # AsyncScheduler's accounting, on the base class

    args = dict(long_prefill_token_threshold=5, max_num_batched_tokens=24, block_size=4, num_gpu_blocks=300,
                enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    requests = [(0, "a", list(range(3, 20)), params, 0), (1, "b", list(range(40, 49)), params, 0)]
    want = run(make(False, **args), requests)
    for cls in (Counting, OwnCount):
        engine = LLMEngine(tiny_model(), None, EngineArgs(async_scheduling=True, **args),
                           parts=EngineParts(scheduler_cls=cls))
        assert type(engine.scheduler) is cls and engine.engine_core.engine_core.batch_queue is not None
        assert run(engine, requests) == want
        assert_idle_and_clean(engine)


def test_the_wire_types_round_trip_through_msgpack():
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=-3, max_tokens=7, stop=["ab", "c"],
                            stop_token_ids=[4], logprobs=2, min_tokens=1, repetition_penalty=1.1)
    request = EngineCoreRequest("r1", [1, 2, 3], params, 2, 1234.5, priority=-1)
    encoder = MsgpackEncoder()
    back = MsgpackDecoder(EngineCoreRequest).decode(encoder.encode(request))
    assert back == request and back.sampling_params == params
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r1", [5, 6], "stop", 6, [{5: -0.1, 7: -2.0}, {6: -0.5}], 16),
                 EngineCoreOutput("r2", [9])],
        scheduler_stats=SchedulerStats(num_running_reqs=1, num_free_blocks=9), timestamp=3.5)
    data = encoder.encode(outputs)
    assert MsgpackDecoder(EngineCoreOutputs).decode(data) == outputs
    util = EngineCoreOutputs(utility_output=UtilityOutput(7, None, {"a": [1, 2]}))
    assert MsgpackDecoder(EngineCoreOutputs).decode(encoder.encode(util)) == util
    with pytest.raises(msgspec.ValidationError):  # a message of the wrong shape is refused, never half-read
        MsgpackDecoder(EngineCoreRequest).decode(encoder.encode(["r1", "not a list", params, None, 0.0]))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_timeline_shows_when_step_n_plus_1_is_planned(async_scheduling):
    """Synchronous: every step is scheduled after the previous one was executed and updated from. Async: the
    k-th update always comes after k + 1 schedules (step N+1 was planned before step N's output was taken)."""
    engine = make(async_scheduling, max_num_batched_tokens=64)
    core = engine.engine_core.engine_core
    core.start_timeline()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    run(engine, [(0, "a", list(range(20)), params, 0), (2, "b", list(range(30, 45)), params, 0)])
    events = core.take_timeline()
    assert core.timeline is None and core.model_executor.timeline is None  # recording stopped
    kinds = [k for k, _, _ in events]
    assert set(kinds) == {"schedule", "execute", "update"} and all(a <= b for _, a, b in events)
    if not async_scheduling:
        assert kinds == ["schedule", "execute", "update"] * (len(kinds) // 3)
        return
    num_schedules = num_updates = 0
    for kind in kinds:
        num_schedules += kind == "schedule"
        num_updates += kind == "update"
        if kind == "update" and num_updates < kinds.count("update"):  # the last one has nothing after it
            assert num_schedules >= num_updates + 1, kinds
