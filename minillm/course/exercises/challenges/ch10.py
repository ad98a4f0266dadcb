"""Challenge 10: reorder the persistent batch for the attention backend, decodes first and first chunks last.

vLLM's flat batch follows the slot order of its persistent batch (``vllm/v1/worker/gpu_model_runner.py:
GPUModelRunner.execute_model`` takes ``num_scheduled_tokens[i] for i in input_batch.req_ids``), and several of its
attention backends (FlashInfer, MLA, the linear-attention and Mamba ones) run decodes with one kernel and prefills
with another. So after each step's update, ``GPUModelRunner._may_reorder_batch`` calls
``vllm/v1/attention/backends/utils.py:reorder_batch_to_split_decodes_and_prefills(input_batch, scheduler_output,
decode_threshold)``, which puts every request into one of four regions, in this slot order:

==============  =====================================================================
decode          at most ``decode_threshold`` tokens scheduled, prompt done (``num_computed_tokens >=
                num_prompt_tokens``)
short extend    at most ``decode_threshold`` tokens scheduled, still prefilling
long extend     more than ``decode_threshold`` tokens scheduled, some context already computed
prefill         nothing computed yet (``num_computed_tokens == 0``): a first chunk, whatever its size
==============  =====================================================================

(``num_computed_tokens`` is where this step starts.) The backend then finds the boundaries from the query lengths
alone (``utils.py:split_decodes_and_prefills``). The threshold is 1 by default; a backend that verifies draft tokens
with its decode kernel raises it to ``1 + num_speculative_tokens`` (``vllm/v1/attention/backend.py:
AttentionMetadataBuilder._init_reorder_batch_threshold``), so a decode with its drafts stays a decode.

Only the requests out of their region's slots move, and only by ``InputBatch.swap_states``, which exchanges two
slots whole (in vLLM also their sampling parameters and generators, and it tells the logits processors,
``BatchUpdateBuilder.moved``). The out-of-place slots, in slot order, take the out-of-place requests in region order
(stably); each cycle of that permutation is then followed from its first slot, ``k - 1`` swaps for ``k`` requests::

    regions  [P, D, S, D]  ->  wanted [D, D, S, P]
    out of place: slots 0 and 3; in region order: the D of slot 3, then the P of slot 0
    slot 3 -> slot 0 and slot 0 -> slot 3: one cycle of 2, so one swap: swap_states(0, 3)

V1's ``_prepare_inputs`` as the course keeps it (``minillm/course/persistent_batch.py:gather_inputs``) gathers the
flat batch in the plan's order, whatever the slots, so no reorder is needed there; the challenge's check
(:func:`check_reorder_batch`) confirms that the step's inputs are the same after a reorder.
:func:`reorder_batch_to_split_decodes_and_prefills` is the reference it compares with.
``InputBatch.swap_states`` moves a slot's draft tokens with its tokens, as vLLM's moves ``spec_token_ids``
(``vllm/v1/worker/gpu_input_batch.py:InputBatch.swap_states``).
"""
from __future__ import annotations

import contextlib
import copy
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from minillm.core.sched.output import SchedulerOutput
from minillm.course.exercises.ch10.persistent_batch import (
    RESETS,
    SCENARIOS,
    Recording,
    apply_sampled,
    describe_plan,
    record_plans,
    reference_update_states,
)
from minillm.course.exercises.ch10.tiny import tiny_llama
from minillm.course.persistent_batch import InputBatch, gather_inputs
from minillm.model.llama import LlamaForCausalLM
from minillm.sampling_params import SamplingParams
from minillm.worker.model_runner import BatchInputs, CachedRequestState

# What a delegating answer could call (the tripwire reads it for "C10"): the reference first, then its two halves.
TARGETS = ("minillm.course.exercises.challenges.ch10:reorder_batch_to_split_decodes_and_prefills",
           "minillm.course.exercises.challenges.ch10:request_regions",
           "minillm.course.exercises.challenges.ch10:swap_plan")

DECODE, SHORT_EXTEND, LONG_EXTEND, PREFILL = 0, 1, 2, 3
REGION_NAMES = ("decode", "short extend", "long extend", "prefill")

Reorder = Callable[[InputBatch, SchedulerOutput, int], Any]


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _check_threshold(decode_threshold: object) -> int:
    if not isinstance(decode_threshold, int) or isinstance(decode_threshold, bool) or decode_threshold < 1:
        raise ValueError(f"decode_threshold must be an integer >= 1 (the most tokens a decode schedules), got "
                         f"{decode_threshold!r}")
    return decode_threshold


def request_regions(input_batch: InputBatch, scheduler_output: SchedulerOutput,
                    decode_threshold: int = 1) -> np.ndarray:
    """The region of each slot's request: ``[num_reqs]`` int, :data:`DECODE` ... :data:`PREFILL`.

    Raises:
        ValueError: the batch has holes (call ``condense()`` first), a request in it is not scheduled in
            ``scheduler_output``, or ``decode_threshold`` is not an integer >= 1.
    """
    _check_threshold(decode_threshold)
    n = input_batch.num_reqs
    slots = input_batch.req_ids
    if len(slots) != n or None in slots:
        raise ValueError(f"the batch has holes (slots {slots}): reorder a condensed batch, after condense()")
    ids = [rid for rid in slots if rid is not None]  # all of them: no holes
    missing = [rid for rid in ids if rid not in scheduler_output.num_scheduled_tokens]
    if missing:
        raise ValueError(f"requests {missing} are in the batch but not scheduled in this step: reorder after the "
                         f"step's update, when the batch holds exactly the scheduled requests")
    num_scheduled = np.fromiter((scheduler_output.num_scheduled_tokens[rid] for rid in ids), dtype=np.int64, count=n)
    computed = input_batch.num_computed_tokens_cpu[:n]
    few = num_scheduled <= decode_threshold
    regions = np.full(n, DECODE, dtype=np.int64)
    regions[few & (computed < input_batch.num_prompt_tokens[:n])] = SHORT_EXTEND
    regions[~few] = LONG_EXTEND
    regions[computed == 0] = PREFILL  # last: a first chunk is a prefill whatever its size
    return regions


def swap_plan(regions: np.ndarray) -> list[tuple[int, int]]:
    """The swaps that sort ``regions`` (``[num_reqs]``, one per slot) into region order, as vLLM's loop makes them.

    E.g. ``[3, 0, 1, 0]`` -> wanted ``[0, 0, 1, 3]``: slots 0 and 3 are out of place; the D of slot 3 goes to slot 0
    and the P of slot 0 to slot 3 -> ``[(0, 3)]``.
    """
    regions = np.asarray(regions)
    wanted = np.sort(regions, kind="stable")
    out_of_place = np.flatnonzero(regions != wanted)
    # The out-of-place requests in region order (ties in slot order) fill the out-of-place slots in slot order.
    movers = out_of_place[np.argsort(regions[out_of_place], kind="stable")]
    goes_to = dict(zip(movers.tolist(), out_of_place.tolist(), strict=True))  # slot -> the slot its request goes to
    swaps: list[tuple[int, int]] = []
    placed: set[int] = set()
    for first in goes_to:
        if first in placed:
            continue
        # Follow the cycle through `first`: slot `first` always holds the request still to place, which goes to
        # `dest`; after the swap, `dest` is done and the request it held is the next one to place.
        dest = goes_to[first]
        while dest != first:
            swaps.append((first, dest))
            placed.add(dest)
            dest = goes_to[dest]
        placed.add(first)
    return swaps


def reorder_batch_to_split_decodes_and_prefills(input_batch: InputBatch, scheduler_output: SchedulerOutput,
                                                decode_threshold: int = 1) -> bool:
    """Put the batch's requests in slot order decode, short extend, long extend, prefill, by swapping slots
    (``input_batch.swap_states``), moving only the requests out of their region's slots. Returns whether anything
    moved.

    Raises:
        ValueError: as :func:`request_regions`.
    """
    swaps = swap_plan(request_regions(input_batch, scheduler_output, decode_threshold))
    for i, j in swaps:
        input_batch.swap_states(i, j)
    return bool(swaps)


# -- the check ------------------------------------------------------------------------------------------------------
def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


_SHARED = list(range(40, 48))  # two blocks of 4: a request that starts with them after another computed them hits


def _prompt(first: int, n: int, shared: bool = False) -> list[int]:
    return (_SHARED if shared else []) + list(range(first, first + n))


# Budgets of 6 to 10 tokens shared by up to five requests at a time, of up to eight that arrive at different turns:
# decodes of 1 token beside prompt chunks of 1 to 6 tokens, first chunks (a 1-token prompt among them: a prefill, not
# a decode), new requests that start from a prefix-cache hit (they have context: extends, not prefills), and requests
# finishing at different steps, so that new ones land in the holes between running ones. Together they need swaps in
# cycles of 3, and batches that hold all four regions at once.
REORDER_SCENARIOS: dict[str, tuple[dict[str, Any], dict[int, list], dict[int, list[str]], bool]] = {
    "budget 6, a 1-token prompt and a prefix hit": (
        dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=6, enable_prefix_caching=True, max_num_seqs=5,
             max_model_len=48),
        {0: [("p", _SHARED + [9, 8], _greedy(6)), ("q", _prompt(60, 13), _greedy(5))],
         3: [("s", [7], _greedy(4))],
         5: [("r", _SHARED + [1, 2, 3], _greedy(3)), ("t", _prompt(100, 11), _greedy(3))],
         9: [("u", _prompt(120, 9), _greedy(4)), ("v", [11, 12], _greedy(2))]},
        {}, False),
    "budget 10, chunks of 4, seven arrivals": (
        dict(block_size=4, num_gpu_blocks=80, max_num_batched_tokens=10, long_prefill_token_threshold=4,
             enable_prefix_caching=True, max_num_seqs=5, max_model_len=48),
        {0: [("f", _prompt(110, 5, shared=True), _greedy(5)), ("g", _prompt(130, 3), _greedy(6))],
         1: [("d", _prompt(70, 1, shared=True), _greedy(4))],
         2: [("a", _prompt(10, 3), _greedy(3)), ("c", _prompt(50, 20, shared=True), _greedy(1)),
             ("e", _prompt(90, 12), _greedy(3))],
         5: [("b", _prompt(30, 20), _greedy(2))]},
        {}, False),
    "budget 10, six seats, eight arrivals": (
        dict(block_size=4, num_gpu_blocks=80, max_num_batched_tokens=10, long_prefill_token_threshold=4,
             enable_prefix_caching=True, max_num_seqs=6, max_model_len=48),
        {0: [("c", _prompt(50, 15), _greedy(2)), ("g", _prompt(130, 2, shared=True), _greedy(2))],
         1: [("b", _prompt(30, 12, shared=True), _greedy(4))],
         2: [("e", _prompt(90, 3), _greedy(5))],
         3: [("h", _prompt(150, 15), _greedy(1))],
         4: [("f", _prompt(110, 15), _greedy(3))],
         6: [("d", _prompt(70, 20), _greedy(2))],
         10: [("a", _prompt(10, 9), _greedy(4))]},
        {}, False),
}
THRESHOLDS = (1, 3)  # vLLM's default, and 1 + 2 draft tokens (the n-gram runs' num_speculative_tokens)

_REBUILDERS = ("add_request", "remove_request", "condense", "_move", "set_token_ids", "append_token_ids")


@contextmanager
def _calls_on(batch: InputBatch) -> Iterator[list[tuple[str, tuple]]]:
    """Record the calls of ``InputBatch``'s slot-moving methods on ``batch`` (the class's methods are wrapped, so
    ``InputBatch.swap_states(batch, i, j)`` counts too); everything is put back on exit."""
    from minillm.course.exercises import grading

    calls: list[tuple[str, tuple]] = []
    originals = {name: InputBatch.__dict__[name] for name in ("swap_states", *_REBUILDERS)}
    # graded: the answer runs in a process of its own, where its calls are watched too
    remote_calls = (grading.recording(InputBatch, originals, only=batch, log=calls) if grading.ACTIVE
                    else contextlib.nullcontext())

    def wrap(name: str, fn: Callable) -> Callable:
        def recorded(self: InputBatch, *args: Any, **kwargs: Any) -> Any:
            if self is batch:
                calls.append((name, args))
            return fn(self, *args, **kwargs)
        return recorded

    try:
        for name, fn in originals.items():
            setattr(InputBatch, name, wrap(name, fn))
        with remote_calls:
            yield calls
    finally:
        for name, fn in originals.items():
            setattr(InputBatch, name, fn)


def _step_inputs(batch: InputBatch, so: SchedulerOutput) -> BatchInputs:
    """The step's flat batch as V1's ``_prepare_inputs`` gathers it from ``batch``."""
    return gather_inputs(batch, so, batch.block_size, torch.device("cpu"))


def _slot_data(batch: InputBatch, slot: int) -> tuple:
    """What a slot holds: tokens, prompt length, context length, block-table row (its null padding included)."""
    n = int(batch.num_tokens_no_spec[slot])
    return (batch.token_ids_cpu[slot, :n].tolist(), int(batch.num_prompt_tokens[slot]),
            int(batch.num_computed_tokens_cpu[slot]), int(batch.block_table.num_blocks_per_row[slot]),
            batch.block_table.block_table[slot].tolist())


def _describe(batch: InputBatch, slot: int, so: SchedulerOutput, threshold: int) -> str:
    """``'c', a short extend (1 token scheduled, 20 of its 21 prompt tokens computed)``."""
    rid = batch.req_ids[slot]
    assert rid is not None, f"slot {slot} is a hole"
    n, computed, prompt = so.num_scheduled_tokens[rid], int(batch.num_computed_tokens_cpu[slot]), \
        int(batch.num_prompt_tokens[slot])
    region = int(request_regions(batch, so, threshold)[slot])
    tokens = f"{n} token{'s' if n != 1 else ''} scheduled"
    why = {DECODE: f"{tokens} (at most {threshold}), its prompt done ({computed} computed, {prompt}-token prompt)",
           SHORT_EXTEND: f"{tokens} (at most {threshold}) but still prefilling: {computed} of its {prompt} prompt "
                         f"tokens computed",
           LONG_EXTEND: f"{tokens} (more than {threshold}), {computed} already computed",
           PREFILL: f"{tokens}, nothing computed yet"}[region]
    return f"{rid!r}, a {REGION_NAMES[region]} ({why})"


def _index_of(batch: InputBatch, rid: str | None) -> int | None:
    """``batch.req_id_to_index.get(rid)``, for a slot that may be a hole."""
    return None if rid is None else batch.req_id_to_index.get(rid)


def _structure_problem(mine: object, before: InputBatch) -> str | None:
    if not isinstance(mine, InputBatch):
        return f"input_batch must stay the InputBatch it was given, now it is a {type(mine).__name__}"
    ids = list(mine.req_ids)
    held = sorted(r for r in ids if r is not None)
    if held != sorted(r for r in before.req_ids if r is not None) or None in ids:
        return (f"the batch held {list(before.req_ids)} and holds {ids} after your function: reordering keeps "
                f"every request, and no holes")
    wrong = [(rid, i) for i, rid in enumerate(ids) if _index_of(mine, rid) != i]
    if wrong or len(mine.req_id_to_index) != len(ids):
        rid, i = wrong[0] if wrong else (None, None)
        return (f"req_ids and req_id_to_index disagree: slot {i} holds {rid!r}, but req_id_to_index says "
                f"{_index_of(mine, rid)}; batch.swap_states(i, j) keeps both in step"
                if wrong else f"req_id_to_index has {len(mine.req_id_to_index)} entries for {len(ids)} requests")
    return None


def _data_problem(mine: InputBatch, before: InputBatch) -> str | None:
    """A request whose slot data did not move with it."""
    for rid, old in before.req_id_to_index.items():
        new = mine.req_id_to_index[rid]
        if _slot_data(mine, new) == _slot_data(before, old):
            continue
        whose = next((r for r, s in before.req_id_to_index.items() if _slot_data(before, s) == _slot_data(mine, new)),
                     None)
        labels = ("tokens", "prompt length", "context length", "block count", "block-table row")
        fields = [label for label, a, b in zip(labels, _slot_data(mine, new), _slot_data(before, old), strict=True)
                  if a != b]
        if whose is not None and whose != rid:
            return (f"{rid!r} moved from slot {old} to slot {new}, but slot {new} holds the data of {whose!r} "
                    f"(its {', '.join(fields)}): you moved the request id but not its data. batch.swap_states(i, j) "
                    f"exchanges two slots whole: id, tokens, lengths and block-table row")
        return (f"{rid!r} (slot {old} before, {new} now) has another {', '.join(fields)} than before: reordering "
                f"moves a request's data with it and changes none of it")
    return None


def _order_problem(mine: InputBatch, so: SchedulerOutput, threshold: int) -> str | None:
    regions = request_regions(mine, so, threshold)
    bad = np.flatnonzero(regions[1:] < regions[:-1])
    if not bad.size:
        return None
    i = int(bad[0])
    ahead, behind = int(regions[i]), int(regions[i + 1])
    why = ""
    if (ahead, behind) == (SHORT_EXTEND, DECODE):
        why = (". A short extend is not a decode: it schedules few tokens but is still prefilling "
               "(num_computed_tokens < num_prompt_tokens), and goes after every decode")
    elif behind == PREFILL or ahead == PREFILL:
        why = (". A prefill is a request with nothing computed yet (num_computed_tokens == 0), whatever its size; "
               "a request with context is an extend or a decode")
    return (f"slot {i + 1} holds {_describe(mine, i + 1, so, threshold)}, after slot {i}'s "
            f"{_describe(mine, i, so, threshold)}. The regions go decode, short extend, long extend, prefill in "
            f"slot order (slots now: {list(mine.req_ids)}){why}")


def _rebuild_problem(calls: list[tuple[str, tuple]]) -> str | None:
    """Slots moved by anything but ``swap_states``: removed and added again, condensed, rewritten."""
    others = sorted({name for name, _ in calls if name != "swap_states"})
    if not others:
        return None
    return (f"your function called batch.{', batch.'.join(others)}: reorder by swapping slots only "
            f"(batch.swap_states(i, j)), not by rebuilding the batch. A rebuilt batch loses what only the slots "
            f"hold; vLLM's swap_states also moves each slot's sampling parameters and generator, and tells the "
            f"logits processors which slots were swapped (BatchUpdateBuilder.moved)")


def _replay_problem(mine: InputBatch, before: InputBatch, calls: list[tuple[str, tuple]]) -> str | None:
    """The batch must be exactly what the learner's ``swap_states`` calls make of the batch it was given."""
    replayed = copy.deepcopy(before)
    for _, args in calls:
        replayed.swap_states(*args)
    if list(replayed.req_ids) != list(mine.req_ids) or any(
            _slot_data(replayed, s) != _slot_data(mine, s) for s in range(mine.num_reqs)):
        return (f"your {len(calls)} swap_states call(s) would leave the slots {list(replayed.req_ids)}, but the "
                f"batch holds {list(mine.req_ids)}: you moved requests some other way (writing req_ids, "
                f"req_id_to_index or the buffers yourself). Move them only with batch.swap_states(i, j): in vLLM it "
                f"moves every per-slot state together and tells the logits processors (BatchUpdateBuilder.moved)")
    return None


def _inputs_problem(mine: InputBatch, so: SchedulerOutput, want: BatchInputs) -> str | None:
    got = _step_inputs(mine, so)
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_table", "slot_mapping",
                 "logits_indices"):
        a, b = getattr(got, name), getattr(want, name)
        if a.shape != b.shape or not torch.equal(a, b):
            return (f"the step's {name} differ after your reorder (gather_inputs gathers them in the "
                    f"plan's order, so a reorder that moves each request's data with it leaves them as they were)")
    if not np.array_equal(got.discard_request_mask, want.discard_request_mask):
        return "the step's discard_request_mask differs after your reorder"
    return None


def _count(counts: dict[str, int], before: InputBatch, so: SchedulerOutput, threshold: int) -> None:
    """Add one reorder's requests per region, and vLLM's swaps, to ``counts``."""
    regions = request_regions(before, so, threshold)
    for r, name in enumerate(REGION_NAMES):
        counts[name] = counts.get(name, 0) + int((regions == r).sum())
    swaps = swap_plan(regions)
    counts["reorders"] = counts.get("reorders", 0) + 1
    counts["reorders that moved requests"] = counts.get("reorders that moved requests", 0) + int(bool(swaps))
    counts["swaps"] = counts.get("swaps", 0) + len(swaps)
    # A cycle of k requests is k - 1 swaps from the same first slot.
    firsts = [first for first, _ in swaps]
    longest = max((firsts.count(f) + 1 for f in set(firsts)), default=0)
    counts["longest cycle"] = max(counts.get("longest cycle", 0), longest)
    if len(set(regions.tolist())) == len(REGION_NAMES):
        counts["batches with all four regions"] = counts.get("batches with all four regions", 0) + 1


def replay(reorder: Reorder, recording: Recording, threshold: int) -> dict[str, int]:
    """Replay ``recording``'s plans with the reference's persistent batch, and after each step's update run
    ``reorder`` (already guarded) on a copy of it; raise ``AssertionError`` at the first step where the copy is
    wrong. The replay goes on from the reference's reordered batch, as a runner keeps its order from step to step.
    Returns what the batches held (requests per region, reorders, vLLM's swaps, its longest cycle)."""
    batch = InputBatch(recording.max_num_reqs, recording.max_model_len, recording.block_size)
    requests: dict[str, CachedRequestState] = {}
    counts: dict[str, int] = {}
    total = len(recording.steps)
    for k, step in enumerate(recording.steps):
        so = pickle.loads(step.plan)
        reference_update_states(batch, requests, so)
        where = (f"In run {recording.name!r} with decode_threshold={threshold}, step {k} of {total} "
                 f"({describe_plan(so)})")
        before = copy.deepcopy(batch)
        mine = copy.deepcopy(before)
        # The learner's function first: the reference's reorder of this step does not exist while it runs.
        with _calls_on(mine) as calls:
            try:
                got = reorder(mine, pickle.loads(step.plan), threshold)  # a plan of its own: nothing shared
            except (NotImplementedError, AssertionError):  # a stub, or a call of the reference
                raise
            except Exception as e:  # a crash is a wrong answer: say where
                raise AssertionError(f"{where}: your function raised {type(e).__name__}: {e} (slots before: "
                                     f"{list(before.req_ids)})") from e
        want_inputs = _step_inputs(before, so) if so.total_num_scheduled_tokens else None
        with _calls_on(batch) as ref_calls:
            want = reorder_batch_to_split_decodes_and_prefills(batch, so, threshold)
        problem = (_structure_problem(mine, before) or _rebuild_problem(calls) or _data_problem(mine, before)
                   or _order_problem(mine, so, threshold) or _replay_problem(mine, before, calls))
        swaps = sum(name == "swap_states" for name, _ in calls)
        if problem is None and swaps > len(ref_calls):
            problem = (f"your function called swap_states {swaps} times, vLLM's loop {_times(len(ref_calls))} (slots "
                       f"before: {list(before.req_ids)}, yours after: {list(mine.req_ids)}). Move only the requests "
                       f"that are out of their region's slots, each straight to a slot it belongs in: a cycle of k "
                       f"misplaced requests takes k - 1 swaps")
        if problem is None and (not isinstance(got, (bool, np.bool_)) or bool(got) != want):
            problem = (f"your function returned {got!r}, expected {want}: it returns whether it modified the batch, "
                       + (f"True when it moved requests (here it swapped {_times(swaps)})" if want else
                          "and the batch was already in region order and nothing moved, so return False"))
        if problem is None and want_inputs is not None:
            problem = _inputs_problem(mine, so, want_inputs)
        if problem:
            raise AssertionError(f"{where}: {problem}.")
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            batch.update_req_spec_token_ids(rid, drafts)
        _count(counts, before, so, threshold)
        apply_sampled(batch, requests, so, step)
    return counts


def check_reorder_batch(reorder: Reorder, model: LlamaForCausalLM | None = None,
                        verbose: bool = True) -> dict[str, int]:
    """Challenge 10's check: ``reorder(input_batch, scheduler_output, decode_threshold)`` against
    :func:`reorder_batch_to_split_decodes_and_prefills` after every step of the runs of chapter 10's
    :data:`~minillm.course.exercises.ch10.persistent_batch.SCENARIOS` and :data:`REORDER_SCENARIOS`, at each decode
    threshold of :data:`THRESHOLDS`, under the tripwire (calling the reference or its halves raises).

    After each step's update, on a copy of the batch, the learner's function must leave: the same requests, no holes;
    every request's tokens, prompt length, context length and block-table row as before, moved with it; the regions
    in slot order; no more ``swap_states`` calls than vLLM's loop and no other way of moving slots; the reference's
    return value; the step's inputs (``gather_inputs``) as before.

    Returns:
        what the runs held, summed over the thresholds: requests per region, steps (once per run), reorders,
        reorders that moved requests, vLLM's swaps, its longest cycle, batches with all four regions.
    """
    from minillm.course.exercises.tripwire import guard

    learner = guard("C10", reorder)
    model = model if model is not None else tiny_llama()
    total: dict[str, int] = {"steps": 0}
    runs = {**SCENARIOS, **REORDER_SCENARIOS}
    for name, (engine_args, arrivals, aborts, async_scheduling) in runs.items():
        recording = record_plans(model, name, engine_args, arrivals, aborts, async_scheduling, RESETS.get(name, ()))
        total["steps"] += len(recording.steps)
        for threshold in THRESHOLDS:
            for key, n in replay(learner, recording, threshold).items():
                total[key] = max(total.get(key, 0), n) if key == "longest cycle" else total.get(key, 0) + n
    if verbose:
        print(f"Your reorder follows vLLM's rules after each of the {total['steps']} steps of {len(runs)} engine runs, "
              f"at decode thresholds {' and '.join(map(str, THRESHOLDS))}: the regions in slot order, every "
              f"request's data moved with it, no more swaps than vLLM's loop, the step's inputs unchanged. The "
              f"batches held " + ", ".join(f"{total.get(name, 0)} {name}s" for name in REGION_NAMES)
              + f"; {total['reorders that moved requests']} of the {total['reorders']} reorders moved requests, "
              f"with {total['swaps']} swaps in vLLM's loop (cycles of up to {total['longest cycle']} requests), and "
              f"{total.get('batches with all four regions', 0)} batches held all four regions.")
    return total
