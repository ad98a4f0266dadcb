"""Rolling a request back while a step is in flight for it (async scheduling), on every path that does it: a KV load
rejected whole (``failed_recving``), a load that left blocks invalid (``invalid_block_ids``), a preemption, and an
abort. Each must give the tokens of a synchronous run, leak no block, and leave no placeholder, no in-flight and no
stale-output count on a live request once nothing is in flight.

Under async scheduling step N+1 is planned before step N's output is taken, so when step N's output reports that
its KV load failed, step N+1 has already run on the same missing K/V (from the token step N sampled). The rollback
must take back the request's output placeholders (else the recompute asks for ``num_tokens + placeholders`` tokens:
the runner refuses, or the request gets tokens past its prompt) and drop step N+1's output when it comes back (vLLM
v0.33.0: ``num_stale_output_tokens = num_in_flight_tokens``, ``num_output_placeholders = 0``).

Two levels:

* the scheduler alone, driven as ``EngineCore.step_with_batch_queue`` drives it (plan, execute at once on the
  runner's one thread, take the oldest output once two steps are in flight), with a fake runner that samples a poison
  token whenever it reads a KV slot that holds the wrong token: a dropped output may be poisoned, a kept one never;
* the engine on the tiny random model: vLLM's ``tests/v1/kv_connector/unit/test_kv_load_reject_recompute.py`` on
  ``LLM`` with the connector of ``tests/engine/reject_recompute_connector.py``, and the engine core preempting and aborting
  with a step in flight.
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable

import pytest

from minillm.config import KVTransferConfig, SchedulerConfig
from minillm.core.sched.async_scheduler import AsyncScheduler
from minillm.core.sched.output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from minillm.core.sched.scheduler import Scheduler
from minillm.course.fake_runner import FakeModelRunner, fake_next_token
from minillm.distributed.kv_transfer import KVConnectorRole
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.core import EngineCore
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams
from tests.engine_helpers import TINY, single_thread, tiny_model  # noqa: F401 (fixture)
from tests.engine.reject_recompute_connector import RejectRecomputeConnector, RejectRecomputeMetadata

pytestmark = pytest.mark.usefixtures("single_thread")

BS = 4
NUM_BLOCKS = 48
POISON = 10**6  # what the fake model "samples" from K/V that is not what it should be (outside any vocabulary)
EOS = 2


# -- the scheduler alone ---------------------------------------------------------------------------------------------
class PoisonReadingRunner(FakeModelRunner):
    """:class:`FakeModelRunner` that samples :data:`POISON` where it would raise on a bad read: under async
    scheduling the step after a failed load runs before the scheduler hears of the failure. Every read that went
    wrong is kept in ``poisoned`` as ``(step, request id)``. Asking for a token it does not hold still raises."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.poisoned: list[tuple[int, str]] = []
        self.num_steps = 0

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        scheduled = list(so.num_scheduled_tokens.items())
        for rid, n in scheduled:  # every write before any read, as in a forward pass
            state = self.requests[rid]
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            assert end <= len(state.token_ids), (f"step {self.num_steps}: {rid!r} scheduled up to {end}, the runner "
                                                 f"knows {len(state.token_ids)} tokens")
            for pos in range(start, end):
                self.kv_slots[self._slot(state, pos)] = state.token_ids[pos]
        sampled = []
        for rid, n in scheduled:
            state = self.requests[rid]
            end = state.num_computed_tokens + n
            history = [self.kv_slots[self._slot(state, pos)] for pos in range(end)]
            if history == state.token_ids[:end] and POISON not in history:
                token = fake_next_token(history, self.vocab_size)
            else:
                token = POISON
                self.poisoned.append((self.num_steps, rid))
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                state.token_ids.append(token)
            sampled.append([token])
        self.num_steps += 1
        ids = [rid for rid, _ in scheduled]
        return ModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)}, sampled)


def make_scheduler(async_scheduling: bool, connector_report: str | None = None, num_blocks: int = NUM_BLOCKS,
                   prefix_caching: bool = True, budget: int = 32, max_model_len: int = 64) -> Scheduler:
    cls = AsyncScheduler if async_scheduling else Scheduler
    sched = cls(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=max_model_len),
                num_blocks, BS, enable_prefix_caching=prefix_caching)
    if connector_report is not None:
        config = KVTransferConfig("RejectRecomputeConnector", kv_role="kv_both",
                                  kv_connector_extra_config={"report": connector_report})
        sched.set_kv_connector(RejectRecomputeConnector(config, KVConnectorRole.SCHEDULER, TINY, BS))
    return sched


def reject_loads(report: str) -> Callable[[PoisonReadingRunner, SchedulerOutput], KVConnectorOutput]:
    """What the connector's worker side does in a step (before the runner executes it): load nothing, leave the
    promised slots holding a wrong token, report the failure."""

    def fail(runner: PoisonReadingRunner, so: SchedulerOutput) -> KVConnectorOutput:
        meta = so.kv_connector_metadata
        out = KVConnectorOutput()
        for rid, block_ids, start, end in meta.loads if isinstance(meta, RejectRecomputeMetadata) else ():
            for pos in range(start, end):
                runner.kv_slots[block_ids[pos // BS] * BS + pos % BS] = -7
            if report == "invalid_blocks":
                out.invalid_block_ids.update(block_ids[start // BS:(end - 1) // BS + 1])
            else:
                out.failed_recving.add(rid)
        return out

    return fail


def check_idle(sched: Scheduler) -> None:
    """Nothing in flight: every live request has its outputs back, with nothing counted as coming."""
    for rid, r in sched.requests.items():
        assert (r.num_output_placeholders, r.num_in_flight_tokens, r.num_stale_output_tokens) == (0, 0, 0), (rid, r)
    assert not sched._steps_in_flight


def drive(sched: Scheduler, arrivals: dict[int, list[Request]], async_scheduling: bool,
          fail: Callable[[PoisonReadingRunner, SchedulerOutput], KVConnectorOutput] | None = None,
          aborts: dict[int, list[str]] | None = None, idle_at: set[int] = frozenset()
          ) -> tuple[dict[str, list[int]], PoisonReadingRunner]:
    """Run to completion, one turn of ``EngineCore.step_with_batch_queue`` (or ``EngineCore.step``) per turn: plan a
    step when there is work and run it at once (the executor's one thread runs steps in order); under async, take
    the oldest output only when two steps are in flight or nothing more can be planned. Before turn ``t``: the ids of
    ``aborts[t]`` are aborted, then ``arrivals[t]`` added; at each turn of ``idle_at`` every step in flight is taken
    first (the engine goes idle). Ends with the plan that sends the last finished ids. Returns each request id's
    output tokens (a re-added id: its last request's) and the runner."""
    aborts = aborts or {}
    num_blocks = sched.kv_cache_manager.num_blocks
    runner = PoisonReadingRunner(num_blocks, BS)
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    tokens: dict[str, list[int]] = defaultdict(list)
    last = max([*arrivals, *aborts, *idle_at, 0])

    def take_oldest() -> None:
        so, out = in_flight.popleft()
        for o in sched.update_from_output(so, out):
            assert POISON not in o.new_token_ids, f"{o.request_id!r} kept a token sampled from K/V that was not there"
            tokens[o.request_id] += o.new_token_ids
        if not in_flight:
            check_idle(sched)

    for turn in range(500):
        if turn in idle_at:
            while in_flight:
                take_oldest()
        for rid in aborts.get(turn, ()):
            sched.finish_requests([rid])
        for request in arrivals.get(turn, ()):
            tokens.pop(request.request_id, None)
            sched.add_request(request)
        can_plan = sched.has_unfinished_requests() or bool(sched.pending_kv_sends)
        if not can_plan and not in_flight:
            if turn > last:
                break
            continue
        if can_plan:
            so = sched.schedule()
            kv_output = fail(runner, so) if fail is not None else None
            out = runner.execute_model(so)
            out.kv_connector_output = kv_output
            in_flight.append((so, out))
            if async_scheduling and len(in_flight) < 2 and so.total_num_scheduled_tokens:
                continue
        take_oldest()
    else:
        raise AssertionError("no progress in 500 turns")
    # v0.33.0's Scheduler.has_requests: the finished ids still count; one more (empty) plan sends them.
    assert sched.has_requests() == bool(sched.finished_req_ids)
    if sched.has_requests():
        so = sched.schedule()
        assert so.total_num_scheduled_tokens == 0 and so.finished_req_ids
        assert sched.update_from_output(so, runner.execute_model(so)) == []
    assert not sched.has_requests() and not sched.requests and not runner.requests
    assert sched.kv_cache_manager.num_free_blocks == num_blocks - 1, "every block is back (all but the null block)"
    return dict(tokens), runner


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens of ``prompt`` run alone, synchronously, nothing failing (the fake model depends on tokens only)."""
    sched = make_scheduler(False)
    tokens, _ = drive(sched, {0: [greedy("x", prompt, max_tokens)]}, async_scheduling=False)
    return tokens["x"]


def greedy(rid: str, prompt: list[int], max_tokens: int, arrival: float = 0.0) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=EOS,
                   arrival_time=arrival)


PROMPT = [(7 * j + 3) % 200 + 1 for j in range(22)]  # 5 full blocks and 2 tokens: the connector promises 20
OTHER = [(11 * j + 5) % 200 + 1 for j in range(9)]


@pytest.mark.parametrize("report", ["failed_recving", "invalid_blocks"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_rejected_load_recomputes_to_the_same_tokens(report, async_scheduling):
    """vLLM's ``test_kv_load_reject_recompute.py::test_reject_recompute_matches_baseline`` at the scheduler: the
    connector promises 20 of the 22 prompt tokens and every load fails. Under async scheduling the step planned
    after the failed one reads the missing K/V too (the runner samples poison twice): both outputs are dropped."""
    sched = make_scheduler(async_scheduling, report)
    tokens, runner = drive(sched, {0: [greedy("a", PROMPT, 8)], 1: [greedy("b", OTHER, 6, 1.0)]}, async_scheduling,
                           reject_loads(report))
    assert tokens == {"a": alone(PROMPT, 8), "b": alone(OTHER, 6)}
    assert sched.connector.stats["promised_loads"] == 2  # a's 20 tokens, b's 8: both loads fail
    poisoned_a = [step for step, rid in runner.poisoned if rid == "a"]
    assert poisoned_a == ([0, 1] if async_scheduling else [0]), runner.poisoned


@pytest.mark.parametrize("report", ["failed_recving", "invalid_blocks"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_that_hit_the_unloaded_blocks_in_the_prefix_cache_recomputes_too(report, async_scheduling):
    """A second request with the same prompt arrives a turn later: under async scheduling it is admitted in the
    step planned before the failure is known, with a prefix-cache hit on the 5 blocks the load never filled (the
    connector promises it nothing more). It keeps them as computed (the first request rewrites them in place before
    it reads them again, v0.33.0's rule for a shared invalid block) and drops the output it sampled from them.
    For ``failed_recving``, which names requests, not blocks, this held in no mode before: the second request kept
    a token sampled from the missing K/V."""
    sched = make_scheduler(async_scheduling, report)
    tokens, runner = drive(sched, {0: [greedy("a", PROMPT, 8)], 1: [greedy("b", PROMPT, 8, 1.0)]},
                           async_scheduling, reject_loads(report))
    assert tokens == {"a": alone(PROMPT, 8), "b": alone(PROMPT, 8)}
    assert ("b" in {rid for _, rid in runner.poisoned}) == async_scheduling


def test_recompute_rolls_back_async_placeholders():
    """Port of vLLM's ``tests/v1/kv_connector/unit/test_kv_load_reject_recompute.py::
    test_recompute_rolls_back_async_placeholders``: a rejected synchronous load rolls the request back to 0 with its
    in-flight placeholders (here two real plans put them there: the prompt's last chunk and one decode, where vLLM
    sets ``num_output_placeholders = 2`` by hand), and the output of the one step still in flight is marked stale
    (vLLM: ``async_tokens_to_discard == 1``; v0.33.0 and here: ``num_stale_output_tokens``). Then the recompute asks
    for the prompt alone, not the prompt plus the placeholders."""
    sched = make_scheduler(True, "invalid_blocks", prefix_caching=False)
    prompt = list(range(10, 10 + 4 * BS))
    request = greedy("r", prompt, 8)
    sched.add_request(request)
    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == {"r": BS} and so1.scheduled_new_reqs[0].num_external_computed_tokens == 3 * BS
    so2 = sched.schedule()
    assert so2.num_scheduled_tokens == {"r": 1} and request.num_output_placeholders == 2
    # Every block of the request failed to load; the token the step sampled is EOS (vLLM's use_eos=True).
    failed = ModelRunnerOutput(["r"], {"r": 0}, [[EOS]],
                               kv_connector_output=KVConnectorOutput(invalid_block_ids=set(so1.scheduled_new_reqs[0]
                                                                                           .block_ids)))
    assert sched.update_from_output(so1, failed) == []
    assert request.request_id in sched.requests and request.status == RequestStatus.RUNNING
    assert request.num_computed_tokens == 0 and request.num_output_placeholders == 0
    assert request.num_stale_output_tokens == request.num_in_flight_tokens == 1
    assert sched.update_from_output(so2, ModelRunnerOutput(["r"], {"r": 0}, [[EOS]])) == []
    assert (request.num_stale_output_tokens, request.num_in_flight_tokens, request.num_output_tokens) == (0, 0, 0)
    so3 = sched.schedule()
    assert so3.num_scheduled_tokens == {"r": len(prompt)}
    assert so3.scheduled_cached_reqs.all_token_ids == {"r": prompt}, "the runner's appended token is replaced"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_preemption_with_a_step_in_flight_drops_its_output_and_resamples_it(async_scheduling):
    """11 usable blocks for two requests of 31 tokens (chapter 10's scenario "a preemption with a step in flight"):
    ``b`` is preempted while steps are in flight for it, once with 20 recomputed tokens in flight. Their outputs are
    stale (dropped, not applied to the preempted request), and after resuming it gives the tokens it gives alone.
    vLLM v0.33.0 delivers a preempted request's stale tokens instead; minillm samples them again. (vLLM's
    ``tests/v1/core/test_async_scheduler.py::test_preempt`` has ``test_abort``'s body, ported below; it preempts
    nothing.)"""
    sched = make_scheduler(async_scheduling, num_blocks=12, budget=64, prefix_caching=False, max_model_len=40)
    prompts = {"a": list(range(1, 16)), "b": list(range(100, 115))}
    preempted_in_flight = []
    preempt = sched._preempt_request

    def spying(request):
        preempted_in_flight.append(request.num_in_flight_tokens)
        preempt(request)

    sched._preempt_request = spying
    tokens, _ = drive(sched, {0: [greedy(rid, p, 16, i) for i, (rid, p) in enumerate(prompts.items())]},
                      async_scheduling, idle_at={10})
    assert tokens == {rid: alone(p, 16) for rid, p in prompts.items()}
    assert preempted_in_flight and (max(preempted_in_flight) > 1) == async_scheduling, preempted_in_flight


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_abort_with_steps_in_flight_and_the_id_back_at_once(async_scheduling):
    """``a`` is aborted while two steps for it are in flight and comes back under the same id with another prompt
    before they return: their outputs belong to the aborted request and are dropped (the scheduler matches a step's
    output to the Request it scheduled, not to whoever holds the id by then), and the new ``a`` gives the tokens it
    gives alone. The idle turn after checks that no live request keeps a count of outputs to come."""
    sched = make_scheduler(async_scheduling)
    tokens, _ = drive(sched, {0: [greedy("a", PROMPT, 12), greedy("b", OTHER, 10)], 4: [greedy("a", OTHER[:5], 6)]},
                      async_scheduling, aborts={4: ["a"]}, idle_at={7})
    assert tokens == {"a": alone(OTHER[:5], 6), "b": alone(OTHER, 10)}


def test_abort():
    """Port of vLLM's ``tests/v1/core/test_async_scheduler.py::test_abort``: ten requests, two plans always in
    flight, one request aborted before each update, in a scrambled order. A request aborted k-th got exactly k
    tokens: the outputs of the steps still in flight for it reach nobody."""
    sched = AsyncScheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16, max_model_len=64), 128, BS)
    requests = [greedy(f"r{i}", [(17 * i + j) % 200 + 1 for j in range(10)], 20, float(i)) for i in range(10)]
    for request in requests:
        sched.add_request(request)
    plans = deque([sched.schedule(), sched.schedule()])
    abort_order = [0, 8, 3, 1, 6, 4, 2, 5, 7, 9]
    to_abort = list(abort_order)
    while plans:
        if to_abort:
            sched.finish_requests(requests[to_abort.pop(0)].request_id, RequestStatus.FINISHED_ABORTED)
        so = plans.popleft()
        ids = list(so.num_scheduled_tokens)
        sched.update_from_output(so, ModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)},
                                                       [[i] for i in range(len(ids))]))
        so = sched.schedule()
        if so.num_scheduled_tokens:
            plans.append(so)
    for i, request in enumerate(requests):
        assert request.status == RequestStatus.FINISHED_ABORTED
        assert request.num_output_tokens == abort_order.index(i)
    assert not sched.requests and not sched._steps_in_flight
    assert sched.kv_cache_manager.num_free_blocks == 127


# -- the engine on the tiny model ------------------------------------------------------------------------------------
LLM_ARGS = dict(tokenizer=None, num_gpu_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=32)
ENGINE_PROMPT = [(7 * j + 3) % 200 + 1 for j in range(22)]
GREEDY8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def reject_config(report: str) -> dict:
    return {"kv_connector": "RejectRecomputeConnector", "kv_connector_module_path": "tests.engine.reject_recompute_connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"report": report}}


def generate(monkeypatch, prompts: list[list[int]], multiprocess: bool = False, **args) -> tuple[list, dict]:
    """``LLM(tiny_model(), ...).generate(prompts)``'s token ids, and what the engine holds afterwards."""
    from minillm.entrypoints.llm import LLM

    monkeypatch.setenv("MINILLM_ENABLE_V1_MULTIPROCESSING", "1" if multiprocess else "0")
    llm = LLM(tiny_model(), **{**LLM_ARGS, **args})
    try:
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY8, use_tqdm=False)]
        engine = llm.llm_engine
        state = {"free_blocks": engine.engine_core.call_utility("get_num_free_blocks"),
                 "num_blocks": engine.num_gpu_blocks}
        if not multiprocess:
            core = engine.engine_core.engine_core
            state["live"] = {rid: (r.num_output_placeholders, r.num_in_flight_tokens, r.num_stale_output_tokens)
                             for rid, r in core.scheduler.requests.items()}
            state["runner"] = dict(core.model_runner.requests)
            if core.kv_connector_worker is not None:
                state["rejected_loads"] = core.kv_connector_worker.stats["rejected_loads"]
        return tokens, state
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("report", ["invalid_blocks", "failed_recving"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_reject_recompute_matches_baseline(monkeypatch, report, async_scheduling):
    """Port of vLLM's ``tests/v1/kv_connector/unit/test_kv_load_reject_recompute.py::
    test_reject_recompute_matches_baseline`` on ``LLM`` (in-process, the tiny model instead of opt-125m, prefix
    caching off as there): a connector that promises a block-aligned prefix and rejects the load recomputes to the
    greedy tokens of no connector at all. Before the fix, async scheduling asked the runner for the prompt plus the
    in-flight placeholders (``scheduled tokens 0..24 but the runner knows 22 tokens``)."""
    baseline, _ = generate(monkeypatch, [ENGINE_PROMPT], async_scheduling=False, enable_prefix_caching=False)
    recovered, state = generate(monkeypatch, [ENGINE_PROMPT], async_scheduling=async_scheduling,
                                enable_prefix_caching=False, kv_transfer_config=reject_config(report))
    assert len(baseline[0]) == 8 and recovered == baseline
    assert state["rejected_loads"] == 1
    assert state["free_blocks"] == state["num_blocks"] - 1 and not state["live"] and not state["runner"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_reject_recompute_with_a_prefix_cache_hit_on_the_rejected_blocks(monkeypatch, async_scheduling):
    """The same prompt twice, prefix caching on, the whole load rejected (``failed_recving``): the second request
    takes the first one's unfilled blocks from the prefix cache in the very step of the failed load. Both must
    recompute to the baseline (before the fix the second got other tokens, synchronous scheduling too)."""
    baseline, _ = generate(monkeypatch, [ENGINE_PROMPT], async_scheduling=False)
    recovered, state = generate(monkeypatch, [ENGINE_PROMPT, ENGINE_PROMPT], async_scheduling=async_scheduling,
                                max_num_batched_tokens=64, kv_transfer_config=reject_config("failed_recving"))
    assert recovered == baseline * 2
    assert state["free_blocks"] == state["num_blocks"] - 1 and not state["live"] and not state["runner"]


@pytest.mark.timeout(300)
def test_reject_recompute_in_the_engine_core_process(monkeypatch):
    """The port above with the engine core in its own process (``LLM``'s default), async scheduling: the connector
    is imported there from ``kv_connector_module_path``, and the request returns its 8 tokens."""
    baseline, _ = generate(monkeypatch, [ENGINE_PROMPT], async_scheduling=False, enable_prefix_caching=False)
    recovered, state = generate(monkeypatch, [ENGINE_PROMPT], multiprocess=True, async_scheduling=True,
                                enable_prefix_caching=False, kv_transfer_config=reject_config("invalid_blocks"))
    assert recovered == baseline and state["free_blocks"] == state["num_blocks"] - 1


def run_core(core: EngineCore, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
             aborts: dict[int, list[str]] | None = None, checks: Callable[[EngineCore, int], None] | None = None
             ) -> dict[str, list[int]]:
    """Step ``core`` (``step_fn``) until it has no work, adding and aborting at the given turns; each id's tokens
    (a re-added id: its last request's)."""
    aborts = aborts or {}
    tokens: dict[str, list[int]] = {}
    turn = 0
    while turn <= max([*arrivals, *aborts]) or core.has_requests():
        for rid in aborts.get(turn, ()):
            core.abort_requests([rid])
        for rid, prompt, params in arrivals.get(turn, ()):
            tokens[rid] = []
            core.add_request(Request(rid, prompt, params))
        outputs, _ = core.step_fn()
        for out in outputs.outputs if outputs is not None else ():
            tokens[out.request_id] += out.new_token_ids
        if checks is not None:
            checks(core, turn)
        turn += 1
        assert turn < 1000, "no progress"
    return tokens


def assert_idle_and_clean(core: EngineCore) -> None:
    assert not core.batch_queue and not core.scheduler.requests and not core.scheduler._steps_in_flight
    assert core.get_num_free_blocks() == core.num_gpu_blocks - 1
    assert not core.model_runner.requests


@pytest.mark.timeout(300)
def test_engine_core_preempts_with_a_step_in_flight():
    """A KV cache too small for three requests at once, async scheduling: preemptions happen while a step is in
    flight for the victim, and every request still gets the synchronous engine's tokens; nothing is left behind."""
    args = EngineArgs(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=64, max_model_len=48,
                      enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    arrivals = {0: [(f"r{i}", [(first + 3 * j) % 200 + 1 for j in range(15)], params)
                    for i, first in enumerate((1, 60, 120))]}
    model = tiny_model()
    want = run_core(EngineCore(model, args), arrivals)
    core = EngineCore(model, args, async_scheduling=True)
    preempted_in_flight = []
    preempt = core.scheduler._preempt_request

    def spying(request: Request) -> None:
        if request.num_in_flight_tokens:
            preempted_in_flight.append(request.request_id)
        preempt(request)

    core.scheduler._preempt_request = spying

    def checks(core: EngineCore, turn: int) -> None:
        if not core.batch_queue:
            for r in core.scheduler.requests.values():
                assert (r.num_output_placeholders, r.num_in_flight_tokens, r.num_stale_output_tokens) == (0, 0, 0)

    got = run_core(core, arrivals, checks=checks)
    assert got == want and all(len(t) == 14 for t in got.values())
    assert preempted_in_flight and core.stats.num_preemptions > 0
    assert_idle_and_clean(core)


@pytest.mark.timeout(300)
def test_engine_core_aborts_with_a_step_in_flight_and_takes_the_id_back():
    """Async scheduling: ``a`` is aborted while the batch queue holds a step for it, and a new request comes back
    at once as ``a``. The steps in flight finish; their tokens for the old ``a`` reach nobody; the new ``a`` and
    ``b`` get the tokens they get alone, synchronously. The runner and the KV cache end empty, and the idle step
    (item of vLLM's ``test_engine_core``) then sends the last finished ids."""
    args = EngineArgs(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=32, max_model_len=64)
    model = tiny_model()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    new_a = [(5 * j + 7) % 200 + 1 for j in range(6)]
    arrivals = {0: [("a", ENGINE_PROMPT, params), ("b", OTHER, params)], 4: [("a", new_a, params)]}
    core = EngineCore(model, args, async_scheduling=True)
    in_flight_at_abort = []
    abort = core.abort_requests

    def spying(ids, *rest):
        in_flight_at_abort.append([so.num_scheduled_tokens.get("a", 0) for _, so, _ in core.batch_queue])
        abort(ids, *rest)

    core.abort_requests = spying
    got = run_core(core, arrivals, aborts={4: ["a"]})
    assert in_flight_at_abort and any(in_flight_at_abort[0]), "a step for the aborted request was in flight"
    for rid, prompt in (("a", new_a), ("b", OTHER)):
        assert got[rid] == run_core(EngineCore(model, args), {0: [(rid, prompt, params)]})[rid], rid
    assert_idle_and_clean(core)
    core.step()  # the idle step: nothing to run, the finished ids to send
    assert not core.scheduler.finished_req_ids and not core.scheduler.has_requests()
