"""Exercise 10.1's check: the learner's ``update_states`` replays a real engine run's plans beside the package's.

A plan (``SchedulerOutput``) is all that reaches the model runner, so the check records the plans of an
:class:`~minillm.engine.core.EngineCore` on the tiny model (pickled before each step, as they would cross a process
boundary, in the order the runner executes them) and the tokens each step sampled. Then two persistent batches
replay them, one updated by the learner's function, one by the course's
:func:`minillm.course.persistent_batch.update_states` (V1's ``_update_states``); after each step both get the
step's sampled tokens and context lengths as the runner writes them after sampling (:func:`apply_sampled`).
After every update the two must agree on

- the request states (``requests``: which ids, and each one's ``token_ids``, ``block_ids``, ``num_computed_tokens``,
  ``num_prompt_tokens`` and whether it has its own generator);
- the batch: which requests it holds, no holes, the slot order, and per slot its tokens, context length, prompt
  length, block-table row and the draft tokens written right after its tokens.

The runs (:data:`SCENARIOS`) make the scheduler go through every case: new requests, chunked prefill (a budget of 10
tokens, chunks of 5), n-gram drafts (one of them on a request that ``condense`` moves), requests finishing mid-batch
(holes that ``condense`` fills), preemption and resumption (KV caches of 19 and 21 usable blocks of 4 tokens), a
running request left out by the budget, a request aborted and sent again under the same id (finished and new in one
plan), with async scheduling, a request preempted while a step was in flight for it, whose tokens the scheduler
resends without that step's token, a failed KV load, after which the scheduler resends the tokens of a request
that still holds its slot, and every running request preempted between two steps (:data:`RESETS`), so that the next
plan resumes requests that still hold their slots.
"""
from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from minillm.course.exercises.ch10.tiny import tiny_llama
from minillm.course.persistent_batch import InputBatch, update_states
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.core import EngineCore
from minillm.model.llama import LlamaForCausalLM
from minillm.request import Request
from minillm.sampling_params import SamplingParams
from minillm.worker.model_runner import CachedRequestState

UpdateStates = Callable[[InputBatch, dict[str, CachedRequestState], SchedulerOutput], None]


@dataclass
class RecordedStep:
    """One step of a recorded run.

    Attributes:
        plan: the step's ``SchedulerOutput``, pickled before the step ran.
        req_ids: the runner's rows, in its batch order.
        sampled_token_ids: per row, the tokens the step kept (``[]`` mid-prefill; several with accepted drafts).
    """

    plan: bytes
    req_ids: list[str]
    sampled_token_ids: list[list[int]]


@dataclass
class Recording:
    """A recorded run: its steps and the sizes of the persistent batch that replays them."""

    name: str
    steps: list[RecordedStep]
    max_num_reqs: int
    max_model_len: int
    block_size: int


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _seeded(seed: int, max_tokens: int) -> SamplingParams:
    # Seeded (the runner gives it a generator of its own), but top_k=1 leaves one token to draw: the same on every
    # CPU, whatever random numbers its kernels draw, so the drafts and the plans that follow are too.
    return SamplingParams(temperature=1.0, top_k=1, seed=seed, max_tokens=max_tokens, ignore_eos=True)


_NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
_PROMPTS = {"a": [5, 9, 17] * 7, "b": list(range(60, 81)), "c": [5, 9, 17] * 7 + [3],
            "d": [(4 + 7 * j) % 211 for j in range(12)], "e": list(range(100, 109))}
_FIRST = [("a", _PROMPTS["a"], _greedy(10)), ("b", _PROMPTS["b"], _seeded(5, 10)), ("c", _PROMPTS["c"], _greedy(8)),
          ("d", _PROMPTS["d"], _seeded(7, 6)), ("e", _PROMPTS["e"], _greedy(4))]

# "b"'s prompt is promised by a KV connector whose load fails (ch10/failed_load.py): the scheduler recomputes it in the
# blocks it holds, and resends its tokens to the slot it keeps in the runner's batch. Then, between two steps, every
# running request is preempted (RESETS): the next plan resumes them while they still hold their slots.
_FAILED_LOAD = {"kv_connector": "FailedLoadConnector", "kv_role": "kv_consumer",
                "kv_connector_module_path": "minillm.course.exercises.ch10.failed_load",
                "kv_connector_extra_config": {"fail_load": ["b"]}}

# name -> (engine arguments, {turn: [(id, prompt, params)]}, {turn: [ids aborted before it]}, async scheduling); a
# turn is one step of a synchronous core.
# "a" and "c" repeat a pattern (n-gram drafts; "c" also hits "a"'s blocks in the prefix cache); the victim of the abort
# comes back at once with a shorter prompt under the same id. The third run has async scheduling (no drafts then): a
# request preempted while a step is in flight for it loses that step's token, which the runner had already appended,
# so when it resumes the scheduler resends its tokens without it.
SCENARIOS: dict[str, tuple[dict[str, Any], dict[int, list], dict[int, list[str]], bool]] = {
    "19 blocks, d aborted at step 10": (
        dict(block_size=4, num_gpu_blocks=20, max_num_batched_tokens=10, long_prefill_token_threshold=5,
             enable_prefix_caching=True, max_num_seqs=5, max_model_len=48, speculative_config=_NGRAM),
        {0: _FIRST, 10: [("d", _PROMPTS["d"][:7], _greedy(5))]}, {10: ["d"]}, False),
    "21 blocks, d aborted at step 12": (
        dict(block_size=4, num_gpu_blocks=22, max_num_batched_tokens=10, long_prefill_token_threshold=5,
             enable_prefix_caching=True, max_num_seqs=5, max_model_len=48, speculative_config=_NGRAM),
        {0: _FIRST, 12: [("d", _PROMPTS["d"][:7], _greedy(5))]}, {12: ["d"]}, False),
    "async scheduling, 11 blocks": (
        dict(block_size=4, num_gpu_blocks=12, max_num_batched_tokens=64, max_model_len=40),
        {0: [("a", list(range(15)), _greedy(16)), ("b", list(range(100, 115)), _seeded(3, 16))]}, {}, True),
    "a failed KV load, then every request preempted": (
        dict(block_size=4, num_gpu_blocks=12, max_num_batched_tokens=64, max_model_len=40,
             kv_transfer_config=_FAILED_LOAD),
        {0: [("a", list(range(10, 25)), _greedy(12))], 2: [("b", list(range(40, 53)), _seeded(4, 12))]}, {}, False),
}
# name -> the turns before which EngineCore.reset_prefix_cache(reset_running_requests=True) preempts every running
# request (vLLM's reset after new weights): the only way a request resumes in the plan right after one it ran in.
RESETS: dict[str, tuple[int, ...]] = {"a failed KV load, then every request preempted": (6,)}


def record_plans(model: LlamaForCausalLM, name: str, engine_args: dict[str, Any], arrivals: dict[int, list],
                 aborts: dict[int, list[str]], async_scheduling: bool = False,
                 resets: tuple[int, ...] = ()) -> Recording:
    """Run an :class:`EngineCore` on ``model`` and record every step's plan and sampled tokens, in the order the
    runner executes them.

    Args:
        engine_args: :class:`EngineArgs` keywords.
        arrivals: turn -> ``[(request id, prompt token ids, SamplingParams)]`` added before that turn.
        aborts: turn -> request ids aborted before that turn (before its arrivals: an id may come back at once).
        async_scheduling: step with the batch queue (a turn then plans a step or takes an output, or both).
        resets: turns before which every running request is preempted (``reset_prefix_cache(reset_running_requests
            =True)``), after that turn's aborts and before its arrivals.
    """
    args = EngineArgs(**engine_args)
    core = EngineCore(model, args, async_scheduling=async_scheduling)
    runner = core.model_runner
    assert runner is not None  # one process: the core holds the runner (tensor parallelism does not)
    steps: list[RecordedStep] = []
    execute, sample = runner.execute_model, runner.sample_tokens
    plans: list[bytes] = []

    def record(out: ModelRunnerOutput) -> ModelRunnerOutput:
        steps.append(RecordedStep(plans.pop(0), list(out.req_ids), [list(t) for t in out.sampled_token_ids]))
        return out

    def recording(scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        plans.append(pickle.dumps(scheduler_output))  # before the step: what the scheduler sends
        out = execute(scheduler_output)
        return None if out is None else record(out)  # None: the step's output comes from sample_tokens

    def recording_sample(grammar_output: object | None = None) -> ModelRunnerOutput:
        return record(sample(grammar_output))

    # Instance attributes that wrap the methods, on this runner only (mypy's method-assign is about classes).
    runner.execute_model = recording  # type: ignore[method-assign]
    runner.sample_tokens = recording_sample  # type: ignore[method-assign]
    pending, aborts = {k: list(v) for k, v in arrivals.items()}, {k: list(v) for k, v in aborts.items()}
    turn = 0
    try:
        while pending or core.has_requests():
            core.abort_requests(aborts.pop(turn, []))
            if turn in resets:
                core.reset_prefix_cache(reset_running_requests=True)
            for rid, prompt, params in pending.pop(turn, []):
                core.add_request(Request(rid, prompt, params))
            core.step_fn()
            turn += 1
            if turn > 1000:
                raise RuntimeError(f"recording {name!r}: the engine made no progress in 1000 steps")
    finally:
        core.shutdown()
    return Recording(name, steps, core.scheduler_config.max_num_seqs, core.max_model_len, args.block_size)


# -- the reference and the runner's own writes after sampling ------------------------------------------------------
def reference_update_states(batch: InputBatch, requests: dict[str, CachedRequestState],
                            scheduler_output: SchedulerOutput) -> None:
    """The course's :func:`~minillm.course.persistent_batch.update_states` (V1's ``_update_states``)."""
    update_states(batch, requests, scheduler_output, torch.device("cpu"))


def apply_sampled(batch: InputBatch, requests: dict[str, CachedRequestState], scheduler_output: SchedulerOutput,
                  step: RecordedStep) -> None:
    """What V1's runner writes after sampling: each row's kept tokens appended to its state and
    its slot, and its context length advanced by the tokens it computed (the scheduler corrects it next step when
    drafts were rejected)."""
    if scheduler_output.total_num_scheduled_tokens == 0:
        return
    for rid, tokens in zip(step.req_ids, step.sampled_token_ids, strict=True):
        slot = batch.req_id_to_index[rid]
        requests[rid].token_ids.extend(tokens)
        batch.append_token_ids(slot, tokens)
        seq_len = int(batch.num_computed_tokens_cpu[slot]) + scheduler_output.num_scheduled_tokens[rid]
        requests[rid].num_computed_tokens = seq_len
        batch.num_computed_tokens_cpu[slot] = seq_len


# -- comparing ------------------------------------------------------------------------------------------------------
def describe_plan(so: SchedulerOutput) -> str:
    """One line: what the plan schedules, and the ids it names new, resumed, preempted and finished."""
    cached = so.scheduled_cached_reqs
    parts = [f"scheduled {dict(so.num_scheduled_tokens)}"]
    for label, ids in (("new", [n.req_id for n in so.scheduled_new_reqs]), ("resumed", sorted(cached.resumed_req_ids)),
                       ("preempted", sorted(so.preempted_req_ids)), ("finished", sorted(so.finished_req_ids))):
        if ids:
            parts.append(f"{label} {ids}")
    if so.scheduled_spec_decode_tokens:
        parts.append(f"drafts {dict(so.scheduled_spec_decode_tokens)}")
    return "; ".join(parts)


def _tokens_differ(got: list[int], want: list[int]) -> str:
    """``got`` against ``want`` in a few words, long lists shortened to where they part."""
    if len(got) > len(want) and got[:len(want)] == want:
        return f"holds the expected {len(want)} tokens and {len(got) - len(want)} more, {got[len(want):]}"
    if len(got) < len(want) and want[:len(got)] == got:
        return f"holds {len(got)} tokens, the expected {len(want)} without the last {want[len(got):]}"
    i = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return (f"holds {len(got)} tokens, expected {len(want)}; from position {i} on it holds {got[i:i + 8]}, "
            f"expected {want[i:i + 8]}")


def _cached_index(so: SchedulerOutput, rid: str) -> int | None:
    ids = so.scheduled_cached_reqs.req_ids
    return ids.index(rid) if rid in ids else None


def _states_problem(mine: dict[str, CachedRequestState], ref: dict[str, CachedRequestState],
                    so: SchedulerOutput, before: dict[str, list[int]]) -> str | None:
    """What differs between the learner's request states and the reference's (``before``: each reference state's
    block ids before this step)."""
    if not isinstance(mine, dict):
        return f"requests must stay the dict it was given, now it is a {type(mine).__name__}"
    new_ids = {n.req_id for n in so.scheduled_new_reqs}
    for rid in sorted(set(mine) - set(ref)):
        if rid in so.finished_req_ids:
            return (f"request {rid!r} is in scheduler_output.finished_req_ids but still in requests: a finished "
                    f"request leaves both requests and the batch, first thing in the step")
        return f"requests holds {rid!r}, which the reference does not (it was never scheduled as new)"
    for rid in sorted(set(ref) - set(mine)):
        if rid in new_ids:
            return (f"request {rid!r} is in scheduled_new_reqs but not in requests: give every new request a "
                    f"CachedRequestState in requests")
        return (f"request {rid!r} is missing from requests. Only finished requests leave it: a request that is not "
                f"scheduled in a step (preempted, or left out by the token budget) leaves the batch but keeps its "
                f"state, because it comes back later and the scheduler then sends only what changed")
    for rid, want in ref.items():
        got = mine[rid]
        if not isinstance(got, CachedRequestState):
            return f"requests[{rid!r}] must be a CachedRequestState, got {type(got).__name__}"
        i = _cached_index(so, rid)
        resumed = rid in so.scheduled_cached_reqs.resumed_req_ids
        if got.num_prompt_tokens != want.num_prompt_tokens:
            return f"requests[{rid!r}].num_prompt_tokens is {got.num_prompt_tokens}, expected {want.num_prompt_tokens}"
        if list(got.block_ids) != want.block_ids:
            new_blocks = so.scheduled_cached_reqs.new_block_ids[i] if i is not None else []
            why = ""
            if resumed and list(got.block_ids) == before.get(rid, []) + new_blocks:
                why = (f": {rid!r} resumes after a preemption (it is in scheduled_cached_reqs.resumed_req_ids). Its "
                       f"old blocks were freed when it was preempted, and new_block_ids is its whole new block list: "
                       f"replace its block_ids with it, do not append")
            elif i is not None and not resumed and list(got.block_ids) == new_blocks:
                why = (f": {rid!r} is still running, so new_block_ids holds only the blocks it needs now: append "
                       f"them to the ones it has")
            elif i is not None and not resumed and list(got.block_ids) == before.get(rid):
                why = f": append scheduled_cached_reqs.new_block_ids[{i}] ({new_blocks}) to its block_ids"
            return f"requests[{rid!r}].block_ids is {list(got.block_ids)}, expected {want.block_ids}{why}"
        if got.num_computed_tokens != want.num_computed_tokens:
            why = (f": scheduled_cached_reqs.num_computed_tokens[{i}] is where its tokens start in this step"
                   if i is not None else "")
            return (f"requests[{rid!r}].num_computed_tokens is {got.num_computed_tokens}, expected "
                    f"{want.num_computed_tokens}{why}")
        if list(got.token_ids) != want.token_ids:
            why = (f": the scheduler resent its tokens (scheduled_cached_reqs.all_token_ids[{rid!r}]): replace its "
                   f"token_ids with them" if rid in so.scheduled_cached_reqs.all_token_ids else "")
            return f"requests[{rid!r}].token_ids {_tokens_differ(list(got.token_ids), want.token_ids)}{why}"
        if (got.generator is None) != (want.generator is None):
            return (f"requests[{rid!r}].generator is {'None' if got.generator is None else 'a generator'}, expected "
                    + ("make_generator(seed): its sampling params have a seed (SamplingType.RANDOM_SEED), and it "
                       "draws from its own generator" if want.generator is not None else
                       "None: only a seeded request (SamplingType.RANDOM_SEED) gets a generator"))
    return None


def _resumed_in_slot(so: SchedulerOutput, slots_before: dict[str, int]) -> str | None:
    """The explanation for requests this plan resumes while they still hold a slot, or ``None`` if it has none."""
    ids = sorted(so.scheduled_cached_reqs.resumed_req_ids & slots_before.keys())
    if not ids:
        return None
    return (f"{ids} resume in this plan while they still hold their slots (every running request was preempted "
            f"between this step and the one before): a resumed request leaves the batch with the unscheduled ones "
            f"and comes back whole from its state (batch.add_request), as its old blocks and tokens are gone")


def _slot_summary(batch: InputBatch) -> list[str | None]:
    return list(batch.req_ids)


def _batch_problem(mine: InputBatch, ref: InputBatch, so: SchedulerOutput,
                   slots_before: dict[str, int]) -> str | None:
    """What differs between the learner's batch and the reference's after the update."""
    scheduled = set(so.num_scheduled_tokens)
    for rid in sorted(set(mine.req_id_to_index) - set(ref.req_id_to_index)):
        if rid in so.finished_req_ids:
            return f"the batch still holds {rid!r}, which finished (scheduler_output.finished_req_ids): remove it"
        if rid not in scheduled:
            return (f"the batch still holds {rid!r}, which is not scheduled in this step: a request the step does not "
                    f"run leaves the batch (batch.remove_request) and keeps its state in requests")
        return f"the batch holds {rid!r}, which the reference's does not"
    for rid in sorted(set(ref.req_id_to_index) - set(mine.req_id_to_index)):
        if rid in {n.req_id for n in so.scheduled_new_reqs}:
            return f"{rid!r} is a new request of this step but not in the batch: batch.add_request(its state)"
        return (f"{rid!r} is scheduled in this step but not in the batch. A cached request that is not in the batch "
                f"(left out of an earlier step, or resumed after a preemption) comes back whole from its state: "
                f"batch.add_request(requests[{rid!r}])")
    holes = [i for i, r in enumerate(mine.req_ids) if r is None]
    if holes:
        return (f"the batch has holes at slots {holes} (slots: {_slot_summary(mine)}): once the removals and "
                f"additions are done, call batch.condense(), so the requests sit in slots 0 .. num_reqs - 1 "
                f"(the step's flat batch is gathered from slots 0 .. num_reqs - 1)")
    if _slot_summary(mine) != _slot_summary(ref):
        resumed = _resumed_in_slot(so, slots_before)
        if resumed and any(mine.req_id_to_index.get(r) == i for r, i in slots_before.items()
                           if r in so.scheduled_cached_reqs.resumed_req_ids):
            return f"the slots hold {_slot_summary(mine)}, the reference's {_slot_summary(ref)}: {resumed}"
        return (f"the slots hold {_slot_summary(mine)}, the reference's {_slot_summary(ref)} (before the step: "
                f"{slots_before}). The order is vLLM's: remove the finished requests, then the ones not scheduled "
                f"now (resumed ones too); add the new requests in scheduled_new_reqs order, then the cached ones "
                f"that are not in the batch in scheduled_cached_reqs order (add_request fills the lowest hole); then "
                f"condense() once (it moves the last request into the lowest hole)")
    for slot, held in enumerate(ref.req_ids):
        n = int(ref.num_tokens_no_spec[slot])
        got_n = int(mine.num_tokens_no_spec[slot])
        if got_n != n or mine.token_ids_cpu[slot, :n].tolist() != ref.token_ids_cpu[slot, :n].tolist():
            why = (": the scheduler resent its tokens: write them into its slot (batch.set_token_ids)"
                   if held in so.scheduled_cached_reqs.all_token_ids else "")
            got_tokens, want_tokens = mine.token_ids_cpu[slot, :got_n].tolist(), ref.token_ids_cpu[slot, :n].tolist()
            return f"slot {slot} ({held!r}) {_tokens_differ(got_tokens, want_tokens)}{why}"
        if int(mine.num_prompt_tokens[slot]) != int(ref.num_prompt_tokens[slot]):
            return (f"slot {slot} ({held!r}): num_prompt_tokens is {int(mine.num_prompt_tokens[slot])}, expected "
                    f"{int(ref.num_prompt_tokens[slot])}")
        if int(mine.num_computed_tokens_cpu[slot]) != int(ref.num_computed_tokens_cpu[slot]):
            return (f"slot {slot} ({held!r}): num_computed_tokens_cpu is {int(mine.num_computed_tokens_cpu[slot])}, "
                    f"expected {int(ref.num_computed_tokens_cpu[slot])}: a request that stays in its slot needs its "
                    f"context length written there too (batch.num_computed_tokens_cpu[slot])")
        k = int(ref.block_table.num_blocks_per_row[slot])
        got_k = int(mine.block_table.num_blocks_per_row[slot])
        got_row = mine.block_table.block_table[slot, :got_k].tolist()
        if got_row != ref.block_table.block_table[slot, :k].tolist():
            if held in so.scheduled_cached_reqs.resumed_req_ids and held in slots_before:
                return (f"slot {slot} ({held!r}): its block-table row holds {got_row}, expected "
                        f"{ref.block_table.block_table[slot, :k].tolist()}: {_resumed_in_slot(so, slots_before)}")
            return (f"slot {slot} ({held!r}): its block-table row holds {got_row}, expected "
                    f"{ref.block_table.block_table[slot, :k].tolist()}: a request that stays in its slot gets its new "
                    f"blocks appended to its row (batch.block_table.append_row(new_block_ids, slot))")
    for rid, drafts in so.scheduled_spec_decode_tokens.items():
        slot = ref.req_id_to_index[rid]
        n = int(ref.num_tokens_no_spec[slot])
        got = mine.token_ids_cpu[slot, n:n + len(drafts)].tolist()
        if got != list(drafts):
            return (f"{rid!r} verifies the draft tokens {list(drafts)} in this step, but its slot holds {got} right "
                    f"after its {n} tokens: the step's input ids are gathered from there, so write them with "
                    f"batch.update_req_spec_token_ids({rid!r}, drafts)")
    return None


def _count(counts: dict[str, int], so: SchedulerOutput, previous: set[str], slots_before: dict[str, int],
           ref: InputBatch) -> None:
    cached = so.scheduled_cached_reqs
    left_out = previous - set(so.num_scheduled_tokens) - so.finished_req_ids - so.preempted_req_ids
    # Tokens resent to a request that kept its slot (a failed KV load rolled it back): written over the slot's.
    resent_in_slot = [r for r in cached.all_token_ids if r in slots_before and r not in cached.resumed_req_ids]
    # Resumed in the plan right after one they ran in (every running request was preempted between the two).
    resumed_in_slot = [r for r in cached.resumed_req_ids if r in slots_before]
    for key, n in (("new", len(so.scheduled_new_reqs)), ("finished", len(so.finished_req_ids)),
                   ("preempted", len(so.preempted_req_ids)), ("resumed", len(cached.resumed_req_ids)),
                   ("left out by the budget", len(left_out)), ("with drafts", len(so.scheduled_spec_decode_tokens)),
                   ("moved by condense", sum(slots_before.get(r, i) != i for r, i in ref.req_id_to_index.items())),
                   ("resent to their slot", len(resent_in_slot)), ("resumed from their slot", len(resumed_in_slot))):
        counts[key] = counts.get(key, 0) + n


def replay(update_states: UpdateStates, recording: Recording) -> dict[str, int]:
    """Replay ``recording`` with ``update_states`` (already guarded) and the reference; raise ``AssertionError`` at
    the first step where they differ. Returns how many requests were new, finished, preempted, ... over the run."""
    sizes = (recording.max_num_reqs, recording.max_model_len, recording.block_size)
    mine_batch, ref_batch = InputBatch(*sizes), InputBatch(*sizes)
    mine_reqs: dict[str, CachedRequestState] = {}
    ref_reqs: dict[str, CachedRequestState] = {}
    counts: dict[str, int] = {"steps": len(recording.steps)}
    previous: set[str] = set()
    total = len(recording.steps)
    for k, step in enumerate(recording.steps):
        ref_so, mine_so = pickle.loads(step.plan), pickle.loads(step.plan)  # nothing shared between the two
        where = f"In run {recording.name!r}, step {k} of {total} ({describe_plan(ref_so)})"
        slots_before = dict(ref_batch.req_id_to_index)
        blocks_before = {rid: list(s.block_ids) for rid, s in ref_reqs.items()}
        # The learner's update first: the reference's result of this step does not exist while it runs.
        try:
            update_states(mine_batch, mine_reqs, mine_so)
        except (NotImplementedError, AssertionError):  # a stub, or a call of the package's own update
            raise
        except Exception as e:  # a crash is a wrong answer: say where, and what the plan held
            reference_update_states(ref_batch, ref_reqs, ref_so)
            kept = [r for r in ref_so.scheduled_cached_reqs.resumed_req_ids
                    if r in slots_before and mine_batch.req_id_to_index.get(r) == slots_before[r]]
            hint = (_resumed_in_slot(ref_so, slots_before) if kept else None) or _states_problem(
                mine_reqs, ref_reqs, ref_so, blocks_before)
            both = {n.req_id for n in ref_so.scheduled_new_reqs} & ref_so.finished_req_ids
            if both and "already in the batch" in str(e):
                hint = (f"{sorted(both)} finished and is new in this same plan (aborted, then sent again under the "
                        f"same id): remove the finished requests (from requests and from the batch) first, then add "
                        f"the new ones")
            raise AssertionError(f"{where}: your update_states raised {type(e).__name__}: {e}"
                                 + (f". {hint[0].upper()}{hint[1:]}" if hint else "")) from e
        reference_update_states(ref_batch, ref_reqs, ref_so)
        problem = (_states_problem(mine_reqs, ref_reqs, ref_so, blocks_before)
                   or _batch_problem(mine_batch, ref_batch, ref_so, slots_before))
        if problem:
            raise AssertionError(f"{where}: {problem}.")
        _count(counts, ref_so, previous, slots_before, ref_batch)
        previous = set(ref_so.num_scheduled_tokens)
        apply_sampled(ref_batch, ref_reqs, ref_so, step)
        apply_sampled(mine_batch, mine_reqs, mine_so, step)
    return counts


def check_update_states(update_states: UpdateStates, model: LlamaForCausalLM | None = None,
                        verbose: bool = True) -> dict[str, int]:
    """Exercise 10.1's check: ``update_states`` against ``minillm.course.persistent_batch.update_states`` on every
    run of :data:`SCENARIOS`, under the tripwire (calling the package's ``update_states`` raises).

    Returns:
        what the runs held, summed (steps, new, finished, preempted, resumed, left out by the budget, with drafts,
        moved by condense, resent to their slot, resumed from their slot); printed when ``verbose``.
    """
    from minillm.course.exercises.tripwire import guard

    learner = guard("10.1", update_states)
    model = model if model is not None else tiny_llama()
    total: Counter[str] = Counter()
    for name, (engine_args, arrivals, aborts, async_scheduling) in SCENARIOS.items():
        recording = record_plans(model, name, engine_args, arrivals, aborts, async_scheduling, RESETS.get(name, ()))
        total.update(replay(learner, recording))
    if verbose:
        print(f"Your update_states agrees with the package's update_states after each of the {total['steps']} steps "
              f"of {len(SCENARIOS)} engine runs. Their plans held {total['new']} new requests, {total['finished']} "
              f"finished, {total['preempted']} preempted, {total['resumed']} resumed, "
              f"{total['left out by the budget']} left out by the budget, {total['with drafts']} with draft tokens "
              f"and {total['resent to their slot']} whose tokens were resent to the slot they kept; "
              f"{total['resumed from their slot']} resumed while still in a slot; condense moved "
              f"{total['moved by condense']} requests.")
    return total
