"""A model runner without a model, and the loop that drives a scheduler with it: scheduling simulated in milliseconds.

:class:`FakeModelRunner` plays the part of the GPU worker honestly, from the :class:`SchedulerOutput` alone:

- it keeps its own copy of every request it was sent (tokens, block ids, context length), adds new ones, drops
  finished and preempted ones, re-creates resumed ones, and checks each message against what it holds;
- its "KV cache" is a flat array of slots (``num_blocks * block_size``); a scheduled token writes its *token id* at
  its slot (slot = block id x block size + offset), and every request then reads its whole history back through its
  block table, so a wrong block table, a bad prefix-cache hit or a stale block makes the runner raise;
- the "model" is :func:`fake_next_token`, a deterministic function of the history read back: like a real model,
  outputs depend only on the tokens, so preemption or chunking cannot change them.

:func:`simulate` runs a workload (requests arriving at given steps) to completion and records every step;
:func:`random_workload` makes seeded workloads; :func:`compare_schedulers` runs two schedulers on the same workloads
and says at which step their outputs first differ (the exercises' check).

vLLM counterpart: none; vLLM's tests use a mock ``ModelRunnerOutput`` the same way
(``tests/v1/core/test_scheduler.py``).
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from minillm.config import SchedulerConfig
from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from minillm.core.sched.scheduler import Scheduler
from minillm.request import Request
from minillm.sampling_params import SamplingParams

_MOD = (1 << 61) - 1


def fake_next_token(token_ids: Sequence[int], vocab_size: int) -> int:
    """A deterministic pseudo-token: a hash of the sequence length and its last four tokens, in ``[0, vocab_size)``."""
    h = len(token_ids)
    for t in token_ids[-4:]:
        h = (h * 1_000_003 + int(t) + 1) % _MOD
    return (h * 0x9E3779B97F4A7C15 % _MOD) % vocab_size


@dataclass
class _RunnerRequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeModelRunner:
    """Executes :class:`SchedulerOutput` s against a fake KV cache of token ids (see the module docstring).

    Args:
        num_blocks: KV blocks (as given to the scheduler).
        block_size: tokens per block.
        vocab_size: pseudo-tokens are drawn from ``range(vocab_size)``.
    """

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 1000) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv_slots = [-1] * (num_blocks * block_size)
        self.requests: dict[str, _RunnerRequestState] = {}

    def _slot(self, state: _RunnerRequestState, position: int) -> int:
        return state.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            if new.req_id in self.requests:
                raise AssertionError(f"request {new.req_id!r} sent as new but the runner already holds it")
            self.requests[new.req_id] = _RunnerRequestState(list(new.prompt_token_ids), list(new.block_ids),
                                                            new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids:
                if rid in self.requests:
                    raise AssertionError(f"resumed request {rid!r} was never dropped by the runner")
                self.requests[rid] = _RunnerRequestState(list(cached.all_token_ids[rid]),
                                                         list(cached.new_block_ids[i]),
                                                         cached.num_computed_tokens[i])
                continue
            state = self.requests.get(rid)
            if state is None:
                raise AssertionError(f"cached request {rid!r} is unknown to the runner")
            if rid in cached.all_token_ids and cached.num_computed_tokens[i] < state.num_computed_tokens:
                # A KV load failed (chapter 9): the scheduler moved the request back and dropped the token this
                # runner appended, so it sends the token ids whole.
                state.token_ids = list(cached.all_token_ids[rid])
                state.num_computed_tokens = cached.num_computed_tokens[i]
            if state.num_computed_tokens != cached.num_computed_tokens[i]:
                raise AssertionError(f"request {rid!r}: scheduler says {cached.num_computed_tokens[i]} computed tokens,"
                                     f" the runner has {state.num_computed_tokens}")
            state.block_ids.extend(cached.new_block_ids[i])

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: write the scheduled tokens into the fake KV cache, read each history back, sample."""
        self._update_states(scheduler_output)
        scheduled = list(scheduler_output.num_scheduled_tokens.items())
        # All writes before any read, as in a real forward pass (K/V are stored before attention reads them), so a
        # prefix hit on a block filled in this same step reads the right tokens.
        for rid, n in scheduled:
            state = self.requests[rid]
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            if end > len(state.token_ids):
                raise AssertionError(f"request {rid!r}: {n} tokens scheduled from position {start}, "
                                     f"but it has only {len(state.token_ids)} tokens")
            if len(state.block_ids) * self.block_size < end:
                raise AssertionError(f"request {rid!r}: {len(state.block_ids)} blocks cannot hold {end} tokens")
            for pos in range(start, end):
                self.kv_slots[self._slot(state, pos)] = state.token_ids[pos]
        req_ids, sampled = [], []
        for rid, n in scheduled:
            state = self.requests[rid]
            end = state.num_computed_tokens + n
            history = [self.kv_slots[self._slot(state, pos)] for pos in range(end)]
            if history != state.token_ids[:end]:
                bad = next(p for p in range(end) if history[p] != state.token_ids[p])
                raise AssertionError(f"request {rid!r}: the KV cache at position {bad} holds token {history[bad]}, "
                                     f"expected {state.token_ids[bad]} (wrong block table or stale prefix hit)")
            token = fake_next_token(history, self.vocab_size)
            state.num_computed_tokens = end
            if end == len(state.token_ids):  # the prompt is done: this token is real and the runner keeps it
                state.token_ids.append(token)
            req_ids.append(rid)
            sampled.append([token])
        return ModelRunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, sampled)


# -- workloads and the simulation loop ------------------------------------------------------------------------------
@dataclass
class WorkloadRequest:
    """A request of a simulated workload: it arrives before step ``arrival_step`` is scheduled."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_step: int = 0
    priority: int = 0

    def make_request(self, index: int = 0) -> Request:
        # Arrival time orders ties in priority and FCFS; the index keeps arrivals within one step distinct.
        return Request(self.request_id, self.prompt_token_ids, SamplingParams(max_tokens=self.max_tokens,
                                                                              ignore_eos=True),
                       arrival_time=self.arrival_step + index * 1e-6, priority=self.priority)


def random_workload(seed: int, num_requests: int = 8, prompt_len: tuple[int, int] = (1, 40),
                    max_tokens: tuple[int, int] = (1, 12), arrival_steps: int = 6, num_priorities: int = 1,
                    vocab_size: int = 1000, shared_prefix_len: int = 0) -> list[WorkloadRequest]:
    """A seeded random workload.

    Args:
        seed: the random seed (same seed, same workload).
        num_requests: how many requests.
        prompt_len / max_tokens: inclusive ranges to draw each request's prompt length and output length from.
        arrival_steps: arrivals are spread over steps ``0 .. arrival_steps - 1``.
        num_priorities: priorities are drawn from ``range(num_priorities)``.
        shared_prefix_len: when > 0, about half the prompts start with the same prefix of this length (prefix hits).
    """
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(shared_prefix_len)]
    out = []
    for i in range(num_requests):
        n = rng.randint(*prompt_len)
        ids = [rng.randrange(vocab_size) for _ in range(n)]
        if shared_prefix_len and rng.random() < 0.5:
            ids = prefix + ids
        out.append(WorkloadRequest(f"r{i}", ids, rng.randint(*max_tokens), rng.randrange(max(arrival_steps, 1)),
                                   rng.randrange(num_priorities)))
    return out


@dataclass
class StepRecord:
    """What one simulated step did.

    Attributes:
        step: the step number (0-based).
        output: the scheduler's output.
        kinds: request id -> ``"prefill"`` (prompt or recompute chunk) or ``"decode"`` for each scheduled request.
        num_running / num_waiting: queue lengths after scheduling.
        num_used_blocks: KV blocks held by requests after scheduling.
        token_budget: the budget in force.
    """

    step: int
    output: SchedulerOutput
    kinds: dict[str, str]
    num_running: int
    num_waiting: int
    num_used_blocks: int
    token_budget: int


@dataclass
class SimulationResult:
    """Outputs and per-step records of :func:`simulate`."""

    outputs: dict[str, list[int]]
    finish_reasons: dict[str, str]
    steps: list[StepRecord] = field(default_factory=list)
    first_token_step: dict[str, int] = field(default_factory=dict)
    finish_step: dict[str, int] = field(default_factory=dict)
    num_preemptions: dict[str, int] = field(default_factory=dict)


class SimulationStalled(RuntimeError):
    """The workload did not finish within ``max_steps`` (a deadlock or livelock)."""


def simulate(scheduler: Scheduler, workload: Sequence[WorkloadRequest], runner: FakeModelRunner | None = None,
             max_steps: int = 10_000, on_step: Callable[[Scheduler, StepRecord], Any] | None = None
             ) -> SimulationResult:
    """Run ``workload`` on ``scheduler`` with a :class:`FakeModelRunner` until every request finishes.

    Raises:
        SimulationStalled: if it has not finished after ``max_steps`` steps.
    """
    kv = scheduler.kv_cache_manager
    runner = runner or FakeModelRunner(kv.num_blocks, scheduler.block_size)
    pending = sorted(enumerate(workload), key=lambda p: (p[1].arrival_step, p[0]))
    result = SimulationResult({w.request_id: [] for w in workload}, {})
    requests: dict[str, Request] = {}
    # A request is in prefill from its admission (new or resumed) until a step completes all its tokens.
    prefilling: set[str] = set()
    step = 0
    while pending or scheduler.has_unfinished_requests():
        if step >= max_steps:
            raise SimulationStalled(f"{scheduler.get_num_unfinished_requests()} requests still unfinished after "
                                    f"{max_steps} steps (running={len(scheduler.running)}, "
                                    f"waiting={len(scheduler.waiting)}, free blocks={kv.num_free_blocks})")
        while pending and pending[0][1].arrival_step <= step:
            index, w = pending.pop(0)
            requests[w.request_id] = w.make_request(index)
            scheduler.add_request(requests[w.request_id])
        so = scheduler.schedule()
        prefilling |= {n.req_id for n in so.scheduled_new_reqs} | so.scheduled_cached_reqs.resumed_req_ids
        kinds = {rid: ("prefill" if rid in prefilling else "decode") for rid in so.num_scheduled_tokens}
        # Caught up with all its tokens after this step: its next step is a decode.
        prefilling -= {rid for rid in so.num_scheduled_tokens
                       if requests[rid].num_computed_tokens == requests[rid].num_tokens}
        record = StepRecord(step, so, kinds, len(scheduler.running), len(scheduler.waiting),
                            kv.num_blocks - 1 - kv.num_free_blocks, scheduler.max_num_scheduled_tokens)
        result.steps.append(record)
        if on_step is not None:
            on_step(scheduler, record)
        mro = runner.execute_model(so)
        for out in scheduler.update_from_output(so, mro):
            result.outputs[out.request_id].extend(out.new_token_ids)
            result.first_token_step.setdefault(out.request_id, step)
            if out.finish_reason is not None:  # finished
                result.finish_reasons[out.request_id] = out.finish_reason
                result.finish_step[out.request_id] = step
        step += 1
    result.num_preemptions = {rid: r.num_preemptions for rid, r in requests.items()}
    return result


def summarize_output(so: SchedulerOutput) -> dict[str, Any]:
    """A plain, comparable view of a :class:`SchedulerOutput` (every field, sets sorted)."""
    c = so.scheduled_cached_reqs
    return {
        "scheduled_new_reqs": [(n.req_id, n.block_ids, n.num_computed_tokens) for n in so.scheduled_new_reqs],
        "scheduled_cached_reqs": {"req_ids": list(c.req_ids), "resumed_req_ids": sorted(c.resumed_req_ids),
                                  "new_block_ids": [list(b) for b in c.new_block_ids],
                                  "num_computed_tokens": list(c.num_computed_tokens)},
        "num_scheduled_tokens": dict(so.num_scheduled_tokens),
        "total_num_scheduled_tokens": so.total_num_scheduled_tokens,
        "preempted_req_ids": sorted(so.preempted_req_ids),
        "finished_req_ids": sorted(so.finished_req_ids),
    }


def _first_difference(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    for key in want:
        if got[key] != want[key]:
            return f"{key}: got {got[key]!r}, expected {want[key]!r}"
    return None


def compare_schedulers(scheduler_cls: type, reference_cls: type = Scheduler, num_workloads: int = 40,
                       policy: str = "fcfs", seed: int = 0) -> int:
    """Run ``scheduler_cls`` and ``reference_cls`` side by side on random workloads and small KV caches.

    Each workload draws its own budget, threshold, seat count, cache size and chunked-prefill setting. Both
    schedulers see the same arrivals and the same fake runner; every step's :class:`SchedulerOutput` must match, and
    so must every request's status, ``num_computed_tokens``, ``num_preemptions`` and token count after the step.
    Some workloads must preempt (the caches are small on purpose), or the comparison would not cover preemption.

    Raises:
        AssertionError: naming the workload, its configuration, the step and the first differing field.

    Returns:
        The number of steps compared.
    """
    rng = random.Random(seed)
    num_steps = num_preemptions = 0
    for w in range(num_workloads):
        block_size = rng.choice([2, 4, 8])
        max_model_len = 64
        chunked = rng.random() < 0.8
        budget = rng.choice([8, 16, 32]) if chunked else rng.choice([64, 96])
        config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=rng.choice([2, 4, 8]),
                                 max_model_len=max_model_len, enable_chunked_prefill=chunked,
                                 long_prefill_token_threshold=rng.choice([0, 0, 6]) if chunked else 0, policy=policy)
        num_blocks = max_model_len // block_size + 1 + rng.choice([0, 2, 8, 40])
        caching = rng.random() < 0.7
        workload = random_workload(seed * 1000 + w, num_requests=rng.randint(2, 10), prompt_len=(1, 40),
                                   max_tokens=(1, 16), arrival_steps=rng.choice([1, 4, 12]),
                                   num_priorities=3 if policy == "priority" else 1,
                                   shared_prefix_len=rng.choice([0, 8]))
        scheds = [cls(config, num_blocks, block_size, enable_prefix_caching=caching)
                  for cls in (scheduler_cls, reference_cls)]
        pending = sorted(enumerate(workload), key=lambda p: (p[1].arrival_step, p[0]))
        runners = [FakeModelRunner(num_blocks, block_size) for _ in scheds]
        step = 0
        made: list[list[Request]] = [[], []]
        where = (f"workload {w} ({len(workload)} requests, {config}, num_gpu_blocks={num_blocks}, "
                 f"block_size={block_size}, prefix caching={caching})")
        while pending or scheds[1].has_unfinished_requests():
            while pending and pending[0][1].arrival_step <= step:
                index, wr = pending.pop(0)
                for s, mine in zip(scheds, made, strict=True):
                    mine.append(wr.make_request(index))
                    s.add_request(mine[-1])
            outs = [s.schedule() for s in scheds]
            diff = _first_difference(summarize_output(outs[0]), summarize_output(outs[1]))
            if diff:
                raise AssertionError(f"{where}, step {step}: {diff}")
            for s, r, so in zip(scheds, runners, outs, strict=True):
                s.update_from_output(so, r.execute_model(so))
            for ours, ref in zip(*made, strict=True):
                got = (ours.status.name, ours.num_computed_tokens, ours.num_preemptions, ours.num_tokens)
                want = (ref.status.name, ref.num_computed_tokens, ref.num_preemptions, ref.num_tokens)
                if got != want:
                    raise AssertionError(f"{where}, after step {step}: request {ref.request_id!r} has (status, "
                                         f"num_computed_tokens, num_preemptions, num_tokens) = {got}, expected {want}")
            step += 1
            num_steps += 1
            if step > 5000:
                raise AssertionError(f"{where}: not finished after 5000 steps")
        num_preemptions += sum(r.num_preemptions for r in made[1])
    if num_workloads >= 20 and num_preemptions == 0:
        raise AssertionError("no request was preempted in any workload: the comparison did not cover preemption")
    print(f"All {num_steps} steps of {num_workloads} workloads agree with the reference "
          f"({num_preemptions} preemptions among them).")
    return num_steps
