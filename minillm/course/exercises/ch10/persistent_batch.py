"""Chapter 10's recorded engine runs, and V1's persistent batch replaying them (for challenge 10).

A plan (``SchedulerOutput``) is all that reaches the model runner, so the checks record the plans of an
:class:`~minillm.engine.core.EngineCore` on the tiny model (:func:`record_plans`: pickled before each step, as they
would cross a process boundary, in the order the runner executes them) and the tokens each step sampled. Exercise
10.1's check (:mod:`minillm.course.exercises.ch10.slots`) replays them on Model Runner V2's slots; challenge 10's
replays them on V1's persistent batch, updated by the course's :func:`minillm.course.persistent_batch.update_states`
(:func:`reference_update_states`), with the sampled tokens written back as V1's runner writes them
(:func:`apply_sampled`).

The runs (:data:`SCENARIOS`) make the scheduler go through every case: new requests, chunked prefill (a budget of 10
tokens, chunks of 5), n-gram drafts, requests finishing mid-batch (slots freed and taken again), preemption and
resumption (KV caches of 19 and 21 usable blocks of 4 tokens), a running request left out by the budget, a request
aborted and sent again under the same id (finished and new in one plan), with async scheduling, a request preempted
while a step was in flight for it, whose tokens the scheduler resends without that step's token, a failed KV load,
after which the scheduler resends the tokens of a request that still holds its slot, and every running request
preempted between two steps (:data:`RESETS`), so that the next plan resumes requests that still hold their slots.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from minillm.course.persistent_batch import InputBatch, update_states
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.core import EngineCore
from minillm.model.llama import LlamaForCausalLM
from minillm.request import Request
from minillm.sampling_params import SamplingParams
from minillm.worker.model_runner import CachedRequestState


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
    num_speculative_steps: int = 0


def _greedy(max_tokens: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=seed)


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
        # "a" is greedy with a seed: greedy sampling draws nothing, so it gets no generator of its own.
        {0: [("a", list(range(15)), _greedy(16, seed=11)), ("b", list(range(100, 115)), _seeded(3, 16))]}, {}, True),
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
    return Recording(name, steps, core.scheduler_config.max_num_seqs, core.max_model_len, args.block_size,
                     runner.req_states.num_speculative_steps)


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
