"""Exercise 10.1's check: the learner's ``update_states`` keeps Model Runner V2's slots beside the package's runner.

The check replays the plans of real engine runs (:func:`~minillm.course.exercises.ch10.persistent_batch.record_plans`,
the runs of :data:`~minillm.course.exercises.ch10.persistent_batch.SCENARIOS`) on two sets of slots: one updated by
the learner's ``update_states(req_states, block_tables, requests_info, scheduler_output)``, one by the package's
``ModelRunner.finish_requests``, ``add_requests`` and ``update_requests`` (run on a stand-in that holds only the
slots). After every update the two must agree on which request holds which slot, the free list, each slot's tokens,
lengths, context length, drafts and block-table row, what the runner remembers of each request, and the step's
``idx_mapping`` (batch row -> slot, rows in :func:`~minillm.worker.model_runner.sort_batch_req_ids` order). Then both
get the step's sampled tokens as the runner writes them (:func:`kernels.input_batch.post_update`).

vLLM counterpart: none (a check); the part is ``vllm/v1/worker/gpu/model_runner.py:GPUModelRunner.finish_requests``,
``add_requests`` and ``update_requests``, over ``vllm/v1/worker/gpu/states.py:RequestState``.
"""
from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch

from kernels.input_batch import post_update
from minillm.core.sched.output import SchedulerOutput
from minillm.course.exercises.ch10.persistent_batch import (
    RESETS,
    SCENARIOS,
    RecordedStep,
    Recording,
    describe_plan,
    record_plans,
)
from minillm.course.exercises.ch10.tiny import tiny_llama
from minillm.model.llama import LlamaForCausalLM
from minillm.worker.block_table import BlockTables
from minillm.worker.model_runner import ModelRunner, RequestInfo, sort_batch_req_ids
from minillm.worker.states import RequestState

UpdateStates = Callable[[RequestState, BlockTables, dict[str, RequestInfo], SchedulerOutput], Any]


class Slots:
    """One runner's request state without its model: the slots, the block tables and what it remembers of each
    request. The reference runs the package's runner methods on it (they read only these attributes)."""

    # The helper the runner's add_requests calls on its ``self``.
    _add = ModelRunner._add

    def __init__(self, recording: Recording) -> None:
        self.device = torch.device("cpu")
        self.req_states = RequestState(recording.max_num_reqs, recording.max_model_len,
                                       recording.num_speculative_steps)
        self.block_tables = BlockTables(recording.block_size, recording.max_num_reqs,
                                        -(-recording.max_model_len // recording.block_size))
        self.requests_info: dict[str, RequestInfo] = {}

    def update(self, so: SchedulerOutput) -> list[int]:
        """The package's update of the slots for plan ``so``; returns the step's ``idx_mapping``."""
        runner = cast(ModelRunner, self)  # the methods read only the attributes a Slots has
        ModelRunner.finish_requests(runner, so)
        ModelRunner.add_requests(runner, so)
        ModelRunner.update_requests(runner, so)
        order = sort_batch_req_ids(so.num_scheduled_tokens, so.scheduled_spec_decode_tokens)
        return [self.req_states.req_id_to_index[rid] for rid in order]


def apply_sampled(slots: Slots, idx_mapping: Sequence[int], so: SchedulerOutput, step: RecordedStep) -> None:
    """What the runner writes after sampling (``ModelRunner._post_update``): each row's kept tokens appended to its
    slot, the last one as its next input, its context length advanced past the step's tokens less the rejected
    drafts."""
    if so.total_num_scheduled_tokens == 0:
        return
    states = slots.req_states
    idx = torch.tensor(list(idx_mapping), dtype=torch.int64)
    num_sched = [so.num_scheduled_tokens[states.index_to_req_id[int(s)]] for s in idx_mapping]
    qsl = torch.zeros(len(num_sched) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(np.cumsum(num_sched), dtype=torch.int32)
    kept = {rid: tokens for rid, tokens in zip(step.req_ids, step.sampled_token_ids, strict=True)}
    rows = [kept.get(states.index_to_req_id[int(s)], []) for s in idx_mapping]
    width = max([len(r) for r in rows] + [1])
    sampled = torch.zeros(len(rows), width, dtype=torch.int64)
    for b, tokens in enumerate(rows):
        sampled[b, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    num_sampled = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    drafts = so.scheduled_spec_decode_tokens
    num_logits = torch.tensor([len(drafts.get(states.index_to_req_id[int(s)], [])) + 1 for s in idx_mapping],
                              dtype=torch.int32)
    num_rejected = torch.where(num_sampled > 0, num_logits - num_sampled, 0).to(torch.int32)
    post_update(idx, states.num_computed_tokens, states.last_sampled_tokens, None, sampled, num_sampled, num_rejected,
                qsl, states.all_token_ids, states.total_len, use_triton=False)
    at = np.asarray(list(idx_mapping), dtype=np.int64)
    computed = states.num_computed_tokens[idx].numpy()
    states.num_computed_tokens_np[at] = computed
    states.num_computed_prefill_tokens[at] = np.minimum(computed, states.prefill_len.np[at])


# -- comparing --------------------------------------------------------------------------------------------------------
def _holders(states: RequestState) -> str:
    return "{" + ", ".join(f"{r!r}: {s}" for r, s in sorted(states.req_id_to_index.items(), key=lambda x: x[1])) + "}"


def _bookkeeping_problem(states: RequestState) -> str | None:
    """A slot given twice, a free slot that is also held, or the two maps that disagree."""
    held: dict[int, str] = {}
    for rid, slot in states.req_id_to_index.items():
        if slot in held:
            return (f"slot {slot} is held by both {held[slot]!r} and {rid!r}: a slot is given to a request only after "
                    f"the one before it left (remove_request), and add_request takes it from the free list")
        held[slot] = rid
    if {s: r for s, r in states.index_to_req_id.items()} != held:
        return (f"req_states.index_to_req_id ({dict(sorted(states.index_to_req_id.items()))}) is not the inverse of "
                f"req_id_to_index ({_holders(states)}): change the slots only through add_request and remove_request")
    free = list(states.free_indices)
    if len(set(free)) != len(free) or set(free) & set(held) or set(free) | set(held) != set(range(states.max_num_reqs)):
        return (f"the free list {free} and the held slots {sorted(held)} must split the {states.max_num_reqs} slots "
                f"between them: change the slots only through add_request and remove_request")
    return None


def _slots_problem(mine: Slots, ref: Slots, so: SchedulerOutput, before: dict[str, int]) -> str | None:
    """Which request holds which slot, against the reference's (``before``: the reference's slots before the step)."""
    m, r = mine.req_states.req_id_to_index, ref.req_states.req_id_to_index
    cached = so.scheduled_cached_reqs
    for rid in sorted(set(m) - set(r)):
        if rid in so.finished_req_ids:
            return (f"request {rid!r} finished (scheduler_output.finished_req_ids) but still holds slot {m[rid]}: "
                    f"free the slots of finished requests first thing (req_states.remove_request)")
        if rid in so.preempted_req_ids:
            return (f"request {rid!r} was preempted (scheduler_output.preempted_req_ids) but still holds slot "
                    f"{m[rid]}: a preempted request gives its slot back, as a finished one does; it resumes later in "
                    f"whatever slot is free then, with all its tokens fed again as a prefill")
        return f"request {rid!r} holds slot {m[rid]}, but in the package's runner it holds none"
    for rid in sorted(set(r) - set(m)):
        if rid in {n.req_id for n in so.scheduled_new_reqs}:
            return (f"request {rid!r} is new in this plan (scheduled_new_reqs) but holds no slot: "
                    f"req_states.add_request(...) gives it one")
        if rid in cached.resumed_req_ids:
            return (f"request {rid!r} resumes in this plan (scheduled_cached_reqs.resumed_req_ids) but holds no slot: "
                    f"it gets one again with req_states.add_request, its tokens being "
                    f"scheduled_cached_reqs.all_token_ids[{rid!r}]")
        return f"request {rid!r} holds no slot, but in the package's runner it holds slot {r[rid]}"
    if m != r:
        rid = next(x for x in sorted(r) if m[x] != r[x])
        hint = (" A request resumed while it still held its slot (every running request was preempted between two "
                "plans) gives that slot back and takes one again (remove_request, then add_request)"
                if rid in cached.resumed_req_ids and rid in before else "")
        return (f"request {rid!r} is in slot {m[rid]}, in the package's runner in slot {r[rid]} (slots before the "
                f"step: {dict(sorted(before.items(), key=lambda x: x[1]))}). Slots come from the free list in a fixed "
                f"order: first the finished and the preempted requests give theirs back, in sorted order of their "
                f"ids (every tensor-parallel rank must free alike); then the new requests take one each, in "
                f"scheduled_new_reqs order, then the resumed ones, in scheduled_cached_reqs order; add_request "
                f"takes the last free slot.{hint}")
    if mine.req_states.free_indices != ref.req_states.free_indices:
        return (f"the free list is {mine.req_states.free_indices}, in the package's runner "
                f"{ref.req_states.free_indices}: free the finished and preempted requests' slots in sorted order of "
                f"their ids, before any request takes one")
    return None


def _tokens_problem(got: list[int], want: list[int]) -> str:
    if len(got) > len(want) and got[:len(want)] == want:
        return f"holds the expected {len(want)} tokens and {len(got) - len(want)} more, {got[len(want):]}"
    if len(got) < len(want) and want[:len(got)] == got:
        return f"holds {len(got)} tokens, the expected {len(want)} without the last {want[len(got):]}"
    i = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return (f"holds {len(got)} tokens, expected {len(want)}; from position {i} on {got[i:i + 8]}, expected "
            f"{want[i:i + 8]}")


def _slot_data_problem(mine: Slots, ref: Slots, so: SchedulerOutput, blocks_before: dict[str, list[int]]) -> str | None:
    """Each held slot's contents against the reference's."""
    ms, rs = mine.req_states, ref.req_states
    cached = so.scheduled_cached_reqs
    for rid, s in sorted(rs.req_id_to_index.items()):
        where = f"slot {s} ({rid!r})"
        got, want = ms.token_ids(rid), rs.token_ids(rid)
        if got != want:
            why = (f": the scheduler resent its tokens (scheduled_cached_reqs.all_token_ids[{rid!r}]); write them "
                   f"over the slot's (req_states.replace_tokens)" if rid in cached.all_token_ids
                   and rid not in cached.resumed_req_ids else "")
            return f"{where} {_tokens_problem(got, want)}{why}"
        for name in ("prompt_len", "prefill_len"):
            g, w = int(getattr(ms, name).np[s]), int(getattr(rs, name).np[s])
            if g != w:
                return f"{where}: req_states.{name} is {g}, expected {w}"
        g, w = int(ms.num_computed_tokens_np[s]), int(rs.num_computed_tokens_np[s])
        if g != w or int(ms.num_computed_tokens[s]) != w:
            i = cached.req_ids.index(rid) if rid in cached.req_ids else None
            why = (f": scheduled_cached_reqs.num_computed_tokens[{i}] is where its step starts "
                   f"(req_states.set_num_computed_tokens)" if i is not None else "")
            return f"{where}: num_computed_tokens is {g}, expected {w}{why}"
        if int(ms.num_computed_prefill_tokens[s]) != int(rs.num_computed_prefill_tokens[s]):
            return (f"{where}: num_computed_prefill_tokens is {int(ms.num_computed_prefill_tokens[s])}, expected "
                    f"{int(rs.num_computed_prefill_tokens[s])}: set the context length with "
                    f"req_states.set_num_computed_tokens, which keeps it")
        if int(ms.last_sampled_tokens[s, 0]) != int(rs.last_sampled_tokens[s, 0]):
            return (f"{where}: last_sampled_tokens holds {int(ms.last_sampled_tokens[s, 0])}, expected "
                    f"{int(rs.last_sampled_tokens[s, 0])}")
        mt, rt = mine.block_tables, ref.block_tables
        got_row = mt.block_table.np[s, :int(mt.num_blocks.np[s])].tolist()
        want_row = rt.block_table.np[s, :int(rt.num_blocks.np[s])].tolist()
        if got_row != want_row:
            i = cached.req_ids.index(rid) if rid in cached.req_ids else None
            new_blocks = list(cached.new_block_ids[i]) if i is not None else []
            why = ""
            if rid in cached.resumed_req_ids and len(got_row) > len(want_row) and got_row[-len(want_row):] == want_row:
                why = (f": {rid!r} resumes after a preemption; its old blocks were freed then, and new_block_ids is "
                       f"its whole new list: append_block_ids(..., overwrite=True)")
            elif i is not None and rid not in cached.resumed_req_ids and got_row == new_blocks:
                why = (f": {rid!r} kept its slot, so new_block_ids holds only the blocks it needs now: append them to "
                       f"its row (overwrite=False)")
            elif i is not None and got_row == blocks_before.get(rid):
                why = f": append scheduled_cached_reqs.new_block_ids[{i}] ({new_blocks}) to its row"
            return f"{where}: its block-table row holds {got_row}, expected {want_row}{why}"
    for rid, drafts in so.scheduled_spec_decode_tokens.items():
        s = rs.req_id_to_index[rid]
        got_d = ms.draft_tokens[s, :len(drafts)].tolist()
        if got_d != list(drafts):
            return (f"{rid!r} verifies the drafts {list(drafts)} in this step, but its slot's draft_tokens hold "
                    f"{got_d}: write them into req_states.draft_tokens[slot, :{len(drafts)}]")
    return None


def _info_problem(mine: dict[str, RequestInfo], ref: dict[str, RequestInfo], so: SchedulerOutput) -> str | None:
    if not isinstance(mine, dict):
        return f"requests_info must stay the dict it was given, now it is a {type(mine).__name__}"
    for rid in sorted(set(mine) - set(ref)):
        if rid in so.finished_req_ids:
            return (f"requests_info still holds {rid!r}, which finished (finished_req_ids): the runner forgets a "
                    f"finished request")
        return f"requests_info holds {rid!r}, which the package's runner does not"
    for rid in sorted(set(ref) - set(mine)):
        if rid in so.preempted_req_ids or rid not in so.num_scheduled_tokens:
            return (f"requests_info lost {rid!r}: only finished requests are forgotten; a preempted one keeps its "
                    f"RequestInfo (its prompt length, its sampling parameters and its generator) for when it resumes")
        return f"request {rid!r} is new in this plan but not in requests_info: give it a RequestInfo"
    for rid, want in ref.items():
        got = mine[rid]
        if not isinstance(got, RequestInfo):
            return f"requests_info[{rid!r}] must be a RequestInfo, got {type(got).__name__}"
        if got.prompt_len != want.prompt_len:
            return f"requests_info[{rid!r}].prompt_len is {got.prompt_len}, expected {want.prompt_len}"
        if got.sampling_params != want.sampling_params:
            return f"requests_info[{rid!r}].sampling_params is not the plan's sampling_params"
        if (got.generator is None) != (want.generator is None):
            return (f"requests_info[{rid!r}].generator is {'None' if got.generator is None else 'a generator'}, "
                    + ("expected make_generator(seed): its sampling params have a seed (SamplingType.RANDOM_SEED)"
                       if want.generator is not None else
                       "expected None: only a seeded request (SamplingType.RANDOM_SEED) gets a generator"))
        if got.generator is not None and want.generator is not None and (
                not isinstance(got.generator, torch.Generator)
                or got.generator.initial_seed() != want.generator.initial_seed()
                or not torch.equal(got.generator.get_state(), want.generator.get_state())):
            return (f"requests_info[{rid!r}].generator is not make_generator({want.sampling_params.seed}): a seeded "
                    f"request draws from a generator seeded with its own seed, so its tokens are the same whatever "
                    f"else runs beside it")
    return None


def _mapping_problem(got: object, want: list[int], mine: Slots, so: SchedulerOutput) -> str | None:
    """The learner's ``idx_mapping`` against the reference's."""
    try:
        items = got.tolist() if isinstance(got, (np.ndarray, torch.Tensor)) else got
        got_list = [int(x) for x in cast(Sequence[Any], items)]
    except (TypeError, ValueError):
        return f"update_states must return the step's idx_mapping, a list of slots (ints); yours returned {got!r}"
    if got_list == want:
        return None
    states = mine.req_states
    in_plan = [states.req_id_to_index.get(r, -1) for r in so.num_scheduled_tokens]
    if sorted(got_list) == sorted(want) and got_list == sorted(want):
        why = (": the rows are in slot order. A step's rows are in the scheduler's order, sorted as "
               "sort_batch_req_ids sorts them (rows with drafts, then decodes, then the rest by size); a slot says "
               "where a request's state lives, not where its row goes")
    elif got_list == in_plan:
        why = (": the rows are in the plan's order, unsorted: sort the request ids with sort_batch_req_ids("
               "scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens)")
    else:
        why = ""
    return (f"your idx_mapping is {got_list}, expected {want} (rows "
            f"{sort_batch_req_ids(so.num_scheduled_tokens, so.scheduled_spec_decode_tokens)} -> their slots){why}")


def _count(counts: Counter[str], so: SchedulerOutput, previous: set[str], before: dict[str, int], ref: Slots,
           mapping: list[int], freed: set[int]) -> None:
    cached = so.scheduled_cached_reqs
    left_out = previous - set(so.num_scheduled_tokens) - so.finished_req_ids - so.preempted_req_ids
    taken = {s for r, s in ref.req_states.req_id_to_index.items() if before.get(r) != s}
    for key, n in (("new", len(so.scheduled_new_reqs)), ("finished", len(so.finished_req_ids)),
                   ("preempted", len(so.preempted_req_ids)), ("resumed", len(cached.resumed_req_ids)),
                   ("left out by the budget", len(left_out)), ("with drafts", len(so.scheduled_spec_decode_tokens)),
                   ("resent to their slot", sum(r in before and r not in cached.resumed_req_ids
                                                for r in cached.all_token_ids)),
                   ("resumed from their slot", sum(r in before for r in cached.resumed_req_ids)),
                   ("slots reused", len(taken & freed)),
                   ("rows out of slot order", int(mapping != sorted(mapping)))):
        counts[key] += n


def replay(update_states: UpdateStates, recording: Recording) -> Counter[str]:
    """Replay ``recording`` with ``update_states`` (already guarded) and the package's update; raise
    ``AssertionError`` at the first step where they differ. Returns what the run's plans held."""
    mine, ref = Slots(recording), Slots(recording)
    counts: Counter[str] = Counter(steps=len(recording.steps))
    previous: set[str] = set()
    freed: set[int] = set()  # slots that some request has given back
    total = len(recording.steps)
    for k, step in enumerate(recording.steps):
        ref_so, mine_so = pickle.loads(step.plan), pickle.loads(step.plan)  # nothing shared between the two
        where = f"In run {recording.name!r}, step {k} of {total} ({describe_plan(ref_so)})"
        before = dict(ref.req_states.req_id_to_index)
        blocks_before = {r: ref.block_tables.block_table.np[s, :int(ref.block_tables.num_blocks.np[s])].tolist()
                         for r, s in before.items()}
        # The learner's update first: the reference's result of this step does not exist while it runs.
        try:
            got = update_states(mine.req_states, mine.block_tables, mine.requests_info, mine_so)
        except (NotImplementedError, AssertionError):  # a stub, or a call of the package's own update
            raise
        except Exception as e:  # a crash is a wrong answer: say where, and what may explain it
            ref.update(ref_so)
            hint = (_bookkeeping_problem(mine.req_states) or _slots_problem(mine, ref, ref_so, before)
                    or _info_problem(mine.requests_info, ref.requests_info, ref_so))
            held = sorted(r for r in ref_so.scheduled_cached_reqs.resumed_req_ids if r in before)
            if held and "already holds slot" in str(e):
                hint = (f"{held} resume in this plan while they still hold their slots (every running request was "
                        f"preempted between this step and the one before): such a request gives its slot back and "
                        f"takes one again (remove_request, then add_request), as its tokens and blocks are all new")
            raise AssertionError(f"{where}: your update_states raised {type(e).__name__}: {e}"
                                 + (f". {hint[0].upper()}{hint[1:]}" if hint else "")) from e
        want = ref.update(ref_so)
        problem = (_bookkeeping_problem(mine.req_states) or _slots_problem(mine, ref, ref_so, before)
                   or _info_problem(mine.requests_info, ref.requests_info, ref_so)
                   or _slot_data_problem(mine, ref, ref_so, blocks_before)
                   or _mapping_problem(got, want, mine, ref_so))
        if problem:
            raise AssertionError(f"{where}: {problem.rstrip('.')}.")
        _count(counts, ref_so, previous, before, ref, want, freed)
        freed |= {s for r, s in before.items() if ref.req_states.req_id_to_index.get(r) != s}
        previous = set(ref_so.num_scheduled_tokens)
        apply_sampled(ref, want, ref_so, step)
        apply_sampled(mine, want, mine_so, step)
    return counts


def check_update_states(update_states: UpdateStates, model: LlamaForCausalLM | None = None,
                        verbose: bool = True) -> dict[str, int]:
    """Exercise 10.1's check: ``update_states`` against the package's runner update on every run of
    :data:`~minillm.course.exercises.ch10.persistent_batch.SCENARIOS`, under the tripwire (calling
    ``ModelRunner.finish_requests``, ``add_requests`` or ``update_requests`` raises).

    Returns:
        what the runs held, summed (steps, new, finished, preempted, resumed, left out by the budget, with drafts,
        resent to their slot, resumed from their slot, slots reused, rows out of slot order); printed when
        ``verbose``.
    """
    from minillm.course.exercises.tripwire import guard

    learner = guard("10.1", update_states)
    model = model if model is not None else tiny_llama()
    total: Counter[str] = Counter()
    for name, (engine_args, arrivals, aborts, async_scheduling) in SCENARIOS.items():
        recording = record_plans(model, name, engine_args, arrivals, aborts, async_scheduling, RESETS.get(name, ()))
        total.update(replay(learner, recording))
    if verbose:
        print(f"Your update_states agrees with Model Runner V2's after each of the {total['steps']} steps of "
              f"{len(SCENARIOS)} engine runs. Their plans held {total['new']} new requests, {total['finished']} "
              f"finished, {total['preempted']} preempted, {total['resumed']} resumed "
              f"({total['resumed from their slot']} while still in a slot), {total['left out by the budget']} left "
              f"out by the budget, {total['with drafts']} with drafts, {total['resent to their slot']} whose tokens "
              f"were resent; {total['slots reused']} slots were taken again after their request left, and "
              f"{total['rows out of slot order']} steps ran their rows in an order other than their slots'.")
    return dict(total)
