"""The checks of solutions/06_engine.ipynb catch the typical wrong answers, and say why.

Each test runs the solution notebook up to one check cell with a deliberately wrong function in place of the
learner's (tests/exercise_helpers.run_check) and asserts that the check fails with an AssertionError that names the
mistake. The notebook's ``minillm.load_model()`` is served from the session's model (conftest's ``smollm``), and the
lesson's cells before an exercise run once for the file, so a test costs its check's own run.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

import minillm
from minillm.attention.metadata import AttentionMetadata
from minillm.request import RequestStatus
from minillm.worker.model_runner import BatchInputs
from tests.course.exercise_helpers import run_challenge as _run_challenge
from tests.course.exercise_helpers import run_check, run_check_with_answer, shared_prefixes

SOLUTION = "06_engine.ipynb"


@pytest.fixture(autouse=True, scope="module")
def one_run_of_the_lesson():
    """The notebook's cells before 6.1 (an engine run recorded step by step: 2 s of each 6.1 and 6.2 test) run once
    for this file; each test gets a copy of what they left (tests/course/exercise_helpers.shared_prefixes)."""
    with shared_prefixes():
        yield


@pytest.fixture
def shared_model(monkeypatch, smollm):
    """The notebook's set-up cell gets the already loaded SmolLM2 instead of loading it again."""
    monkeypatch.setattr(minillm, "load_model", lambda *args, **kwargs: smollm)


def _assert_caught(e: BaseException | None, *phrases: str) -> None:
    assert isinstance(e, AssertionError), f"the check should fail with an AssertionError, got {e!r}"
    for phrase in phrases:
        assert phrase in str(e), f"{phrase!r} is not in the check's message: {e}"


# ---------------------------------------------------------------------------------------------------------------------
# Exercise 6.1: the flat batch


def loop_prepare_inputs(scheduler_output, requests, block_size, device="cpu", mistake=None):
    """A learner's plain loop over the requests, right unless ``mistake`` names one slip to make."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    input_ids, positions, slot_mapping = [], [], []
    query_start_loc, seq_lens, logits_indices, discard, drafts = [0], [], [], [], []
    for rid in req_ids:
        s = requests[rid]
        n = scheduler_output.num_scheduled_tokens[rid]
        c = s.num_computed_tokens
        d = list(scheduler_output.scheduled_spec_decode_tokens.get(rid, []))
        known = s.token_ids if mistake == "drafts_ignored" else s.token_ids + d
        for p in range(c, c + n):
            if p < len(known):
                input_ids.append(known[p])
            positions.append(p - c if mistake == "positions_from_zero" else p)
            if mistake == "slot_is_position":
                slot_mapping.append(p)
            elif mistake == "slot_block_mod":
                slot_mapping.append(s.block_ids[p % block_size] * block_size + p % block_size)
            else:
                slot_mapping.append(s.block_ids[p // block_size] * block_size + p % block_size)
        first_row = query_start_loc[-1]
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(n if mistake == "seq_lens_scheduled" else c + n)
        if mistake == "logits_first_row":
            logits_indices.append(first_row)
        elif mistake == "logits_off_by_one":
            logits_indices.append(query_start_loc[-1])
        else:
            logits_indices.append(query_start_loc[-1] - 1)
        if mistake == "discard_inverted":
            discard.append(c + n >= len(s.token_ids) + len(d))
        elif mistake == "discard_vs_prompt":
            discard.append(c + n < s.num_prompt_tokens)
        else:
            discard.append(c + n < len(s.token_ids) + len(d))
        drafts.append(d)
    if mistake == "qsl_without_zero":
        query_start_loc = query_start_loc[1:]
    width = max(len(requests[rid].block_ids) for rid in req_ids)
    block_table = [requests[rid].block_ids + [0] * (width - len(requests[rid].block_ids)) for rid in req_ids]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    md = AttentionMetadata(tensor(query_start_loc, torch.int32), tensor(seq_lens, torch.int32),
                           tensor(block_table, torch.int32), tensor(slot_mapping, torch.int64),
                           max(scheduler_output.num_scheduled_tokens.values()), max(seq_lens))
    return BatchInputs(req_ids, tensor(input_ids, torch.int64), tensor(positions, torch.int64), md,
                       tensor(logits_indices, torch.int64), np.array(discard, dtype=bool), drafts)




@pytest.mark.slow
def test_a_correct_loop_passes_check_61(shared_model):
    """The mistake switches of loop_prepare_inputs are the only thing wrong in the tests below."""
    assert run_check(SOLUTION, "6.1", my_prepare_inputs=loop_prepare_inputs) is None


@pytest.mark.slow
@pytest.mark.parametrize("mistake, field, phrases", [
    ("positions_from_zero", "positions", ["positions must start at num_computed_tokens, not 0"]),
    ("logits_first_row", "logits_indices", ["points at each request's first row", "query_start_loc[i+1] - 1"]),
    ("logits_off_by_one", "logits_indices", ["off by one: query_start_loc[i+1] is the first row of the next"]),
    ("slot_is_position", "slot_mapping", ["slot_mapping is not the position", "block_ids[p // block_size]"]),
    ("slot_block_mod", "slot_mapping", ["you index it with p % block_size"]),
    ("qsl_without_zero", "query_start_loc", ["query_start_loc starts with 0", "num_reqs + 1 entries"]),
    ("seq_lens_scheduled", "seq_lens", ["yours counts only this step's tokens"]),
    ("discard_inverted", "discard_request_mask", ["inverted: True means 'throw this request's sampled token away'"]),
    ("discard_vs_prompt", "discard_request_mask", ["not with num_prompt_tokens", "resumed after preemption"]),
    ("drafts_ignored", "input_ids", ["a request verifying drafts", "scheduled_spec_decode_tokens[rid]"]),
])
def test_check_61_names_the_mistake(shared_model, mistake, field, phrases):
    e = run_check(SOLUTION, "6.1", my_prepare_inputs=partial(loop_prepare_inputs, mistake=mistake))
    _assert_caught(e, f"`{field}` differs from the reference on probe", *phrases)


@pytest.mark.slow
def test_check_61_explains_a_crash_without_hiding_it(shared_model):
    def crashes(scheduler_output, requests, block_size, device="cpu"):
        return requests["no such request"]

    e = run_check(SOLUTION, "6.1", my_prepare_inputs=crashes)
    _assert_caught(e, "my_prepare_inputs raised KeyError", "on probe 1")
    assert isinstance(e.__cause__, KeyError)


# ---------------------------------------------------------------------------------------------------------------------
# Exercise 6.2: the engine step


def step_without_update(engine):
    """Schedules and runs the model, but never hands the sampled tokens back to the scheduler."""
    scheduler_output = engine.scheduler.schedule()
    engine.model_runner.execute_model(scheduler_output) or engine.model_runner.sample_tokens(None)
    return []


def step_without_remove(engine):
    """Everything but dropping finished requests from the model runner."""
    scheduler_output = engine.scheduler.schedule()
    runner_output = engine.model_runner.execute_model(scheduler_output) or engine.model_runner.sample_tokens(None)
    core_outputs = engine.scheduler.update_from_output(scheduler_output, runner_output)
    outputs, reqs_to_abort = engine.output_processor.process_outputs(core_outputs, runner_output.logprobs)
    engine.scheduler.finish_requests(reqs_to_abort, RequestStatus.FINISHED_STOPPED)
    return outputs


def step_without_finishing_stop_strings(engine):
    """Everything but ending, in the scheduler, the requests a stop string finished."""
    scheduler_output = engine.scheduler.schedule()
    runner_output = engine.model_runner.execute_model(scheduler_output) or engine.model_runner.sample_tokens(None)
    core_outputs = engine.scheduler.update_from_output(scheduler_output, runner_output)
    outputs, _ = engine.output_processor.process_outputs(core_outputs, runner_output.logprobs)
    engine.model_runner.remove_requests([o.request_id for o in outputs if o.finished])
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("wrong, phrases", [
    (step_without_update, ["the sampled tokens never reached it", "engine.scheduler.update_from_output"]),
    (step_without_remove, ["model runner still keeps their state", "engine.model_runner.remove_requests"]),
    (step_without_finishing_stop_strings, ["ended on a stop string", "engine.scheduler.finish_requests"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_check_62_names_the_mistake(shared_model, wrong, phrases):
    _assert_caught(run_check(SOLUTION, "6.2", my_step=wrong), *phrases)


def step_skipping_update(engine):
    """Hands the model runner's output straight to the output processor, which wants the scheduler's."""
    scheduler_output = engine.scheduler.schedule()
    runner_output = engine.model_runner.execute_model(scheduler_output) or engine.model_runner.sample_tokens(None)
    outputs, _ = engine.output_processor.process_outputs(runner_output, runner_output.logprobs)
    return outputs


@pytest.mark.slow
def test_check_62_explains_a_crash_with_the_order_of_the_calls(shared_model):
    e = run_check(SOLUTION, "6.2", my_step=step_skipping_update)
    _assert_caught(e, "step 0: my_step raised TypeError", "in this order, each on what the one before returned")
    assert isinstance(e.__cause__, TypeError)


def step_without_sampling(engine):
    """Hands execute_model's None to the scheduler: the step's tokens come from sample_tokens."""
    scheduler_output = engine.scheduler.schedule()
    runner_output = engine.model_runner.execute_model(scheduler_output)
    core_outputs = engine.scheduler.update_from_output(scheduler_output, runner_output)
    outputs, _ = engine.output_processor.process_outputs(core_outputs, runner_output.logprobs)
    return outputs


@pytest.mark.slow
def test_check_62_explains_a_step_that_never_samples(shared_model):
    e = run_check(SOLUTION, "6.2", my_step=step_without_sampling)
    _assert_caught(e, "step 0: my_step raised", "sample_tokens(None) when execute_model returned None")


# ---------------------------------------------------------------------------------------------------------------------
# Issue 24: answers that delegate to the package trip the wire; dtype and status mistakes named as such


@pytest.mark.slow
def test_check_61_fails_an_answer_that_calls_the_package(shared_model):
    import minillm.worker.model_runner as runner_module

    def delegating(scheduler_output, requests, block_size, device="cpu"):
        return runner_module.prepare_inputs(scheduler_output, requests, block_size, device)

    _assert_caught(run_check(SOLUTION, "6.1", my_prepare_inputs=delegating), "asks you to write this yourself",
                   "prepare_inputs")


@pytest.mark.slow
def test_check_61_fails_an_answer_that_returns_the_checks_own_want(shared_model):
    """The cheating student whose 6.1 answer no reading can refuse (tests/course/test_answer_lint.py): it returns
    the ``want`` the check computes, read from the check's frame. Graded by nbgrader only in make test-classroom, so
    run here in-process: the check computes its reference after the answer returns, and the answer fails."""
    from tests.course.delegating_answers import CHEATS, cheat_cell

    answer = cheat_cell("6.1", CHEATS["06_engine"]["cheat_captures"]["6.1"])
    e = run_check_with_answer(SOLUTION, "6.1", answer)
    assert isinstance(e, AssertionError), repr(e)


@pytest.mark.slow
def test_check_61_fails_an_answer_that_calls_the_runners_method(shared_model):
    from minillm.worker.model_runner import ModelRunner

    def delegating(scheduler_output, requests, block_size, device="cpu"):
        from types import SimpleNamespace

        from minillm.worker.model_runner import prepare_inputs
        runner = SimpleNamespace(prepare_inputs_fn=prepare_inputs, requests=requests, block_size=block_size,
                                 device=device)
        return ModelRunner.prepare_inputs(runner, scheduler_output)   # the runner's own method, on a stand-in

    _assert_caught(run_check(SOLUTION, "6.1", my_prepare_inputs=delegating), "asks you to write this yourself")


def loop_prepare_inputs_int64_block_table(scheduler_output, requests, block_size, device="cpu"):
    """Right but for the block table, made with torch.tensor(rows) and so int64."""
    b = loop_prepare_inputs(scheduler_output, requests, block_size, device)
    md = b.attn_metadata
    rows = md.block_table.tolist()
    md = AttentionMetadata(md.query_start_loc, md.seq_lens, torch.tensor(rows), md.slot_mapping, md.max_query_len,
                           md.max_seq_len)
    return BatchInputs(b.req_ids, b.input_ids, b.positions, md, b.logits_indices, b.discard_request_mask,
                       b.draft_token_ids)


def loop_prepare_inputs_float_positions(scheduler_output, requests, block_size, device="cpu"):
    b = loop_prepare_inputs(scheduler_output, requests, block_size, device)
    return BatchInputs(b.req_ids, b.input_ids, b.positions.float(), b.attn_metadata, b.logits_indices,
                       b.discard_request_mask, b.draft_token_ids)


def loop_prepare_inputs_int_mask(scheduler_output, requests, block_size, device="cpu"):
    b = loop_prepare_inputs(scheduler_output, requests, block_size, device)
    return BatchInputs(b.req_ids, b.input_ids, b.positions, b.attn_metadata, b.logits_indices,
                       b.discard_request_mask.astype(np.int64), b.draft_token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("wrong, phrases", [
    (loop_prepare_inputs_int64_block_table,
     ["`block_table` differs", "has dtype torch.int64, expected torch.int32",
      "a dtype mistake: block_table must be a torch.int32 tensor", "its values are right", "dtype=torch.int32"]),
    (loop_prepare_inputs_float_positions,
     ["`positions` differs", "a dtype mistake: positions must be a torch.int64 tensor", "yours is torch.float32"]),
    (loop_prepare_inputs_int_mask,
     ["`discard_request_mask` differs", "NumPy array of dtype int64, expected dtype bool",
      "a dtype mistake: discard_request_mask is a NumPy array of bool"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_check_61_names_a_dtype_mistake_as_such(shared_model, wrong, phrases):
    e = run_check(SOLUTION, "6.1", my_prepare_inputs=wrong)
    _assert_caught(e, *phrases)
    assert "pad short rows" not in str(e)


@pytest.mark.slow
def test_check_62_fails_an_answer_that_calls_the_engines_step(shared_model):
    def delegating(engine):
        return engine.step()

    def delegating_inner(engine):
        return engine.engine_core.engine_core.step()[0]

    for wrong, name in ((delegating, "LLMEngine.step"), (delegating_inner, "EngineCore.step")):
        _assert_caught(run_check(SOLUTION, "6.2", my_step=wrong), "asks you to write this yourself", name)


def step_finishing_stop_strings_as(status):
    def my_step(engine):
        scheduler_output = engine.scheduler.schedule()
        runner_output = engine.model_runner.execute_model(scheduler_output) or engine.model_runner.sample_tokens(None)
        core_outputs = engine.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, reqs_to_abort = engine.output_processor.process_outputs(core_outputs, runner_output.logprobs)
        if status is None:
            engine.scheduler.finish_requests(reqs_to_abort)   # the default status: FINISHED_ABORTED
        else:
            engine.scheduler.finish_requests(reqs_to_abort, status)
        engine.model_runner.remove_requests([o.request_id for o in outputs if o.finished])
        return outputs
    return my_step


@pytest.mark.slow
@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, None], ids=["aborted", "default"])
def test_check_62_fails_a_stop_string_finished_as_aborted(shared_model, status):
    _assert_caught(run_check(SOLUTION, "6.2", my_step=step_finishing_stop_strings_as(status)),
                   "request 'paris' ended on a stop string", "with status FINISHED_ABORTED",
                   "LLMEngine.step gives FINISHED_STOPPED", "not a cancellation")


# ---------------------------------------------------------------------------------------------------------------------
# Challenge 6: parallel sampling


def run_challenge(**replace):
    """Challenge 6's check after the set-up cell alone (the exercises' cells are tested above)."""
    return _run_challenge(SOLUTION, 6, setup_only=True, **replace)


def sample_children(engine, request_id, prompt_ids, params, n, *, seed_of=lambda seed, i: seed + i,
                    copy_params=True, one_at_a_time=False, index=True, always_seed=False):
    """A learner's parallel sampling, right unless a keyword says otherwise."""
    import copy
    import dataclasses
    answers = [None] * n

    def run_until_done(ids):
        while any(answers[i] is None for i in ids.values()):
            for out in engine.step():
                if out.request_id in ids and out.finished:
                    i = ids[out.request_id]
                    answers[i] = dataclasses.replace(out.outputs[0], index=i) if index else out.outputs[0]

    children = {}
    for i in range(n):
        p = params
        if params.seed is not None or always_seed:
            p = copy.copy(params) if copy_params else params
            p.seed = seed_of(params.seed if copy_params else p.seed, i)
        engine.add_request(f"{i}_{request_id}", list(prompt_ids), p)
        children[f"{i}_{request_id}"] = i
        if one_at_a_time:
            run_until_done({f"{i}_{request_id}": i})
    run_until_done(children)
    return answers


@pytest.mark.slow
def test_challenge_6_check_passes_the_solution_and_a_learners_loop(shared_model):
    assert run_challenge() is None
    assert run_challenge(my_parallel_sample=sample_children) is None


@pytest.mark.slow
def test_challenge_6_check_fails_a_delegating_answer(shared_model):
    def delegating(engine, request_id, prompt_ids, params, n):
        from minillm.course.exercises.challenges.ch06 import parallel_sample
        return parallel_sample(engine, request_id, prompt_ids, params, n)

    _assert_caught(run_challenge(my_parallel_sample=delegating), "Challenge 6 asks you to write this yourself",
                   "parallel_sample")


@pytest.mark.slow
@pytest.mark.parametrize("mistake, phrases", [
    (dict(seed_of=lambda seed, i: seed), ["all 3 answers are the same", "Child i samples with seed + i"]),
    (dict(seed_of=lambda seed, i: seed + i + 1), ["answer 0 differs", "yours is the reference's answer 1",
                                                   "child 0's seed is off; it is seed + 0"]),
    (dict(copy_params=False), ["you changed the caller's SamplingParams", "copy.copy(params)"]),
    (dict(one_at_a_time=True), ["the children did not run side by side", "Add every child before the first step"]),
    (dict(index=False), ["index fields are [0, 0, 0]", "dataclasses.replace(completion, index=i)"]),
], ids=["same-seed", "seed-from-1", "params-mutated", "one-at-a-time", "index-0"])
def test_challenge_6_check_names_the_mistake(shared_model, mistake, phrases):
    _assert_caught(run_challenge(my_parallel_sample=partial(sample_children, **mistake)), *phrases)


@pytest.mark.slow
def test_challenge_6_check_explains_a_seed_added_to_none(shared_model):
    e = run_challenge(my_parallel_sample=partial(sample_children, always_seed=True))
    _assert_caught(e, "my_parallel_sample raised TypeError", "on probe 2", "only a seed is made per child")
