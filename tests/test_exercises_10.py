"""The checks of solutions/10_engine_core.ipynb pass the reference answers, catch the typical wrong ones and say why,
and refuse answers that delegate to the package.

Each test runs the solution notebook up to one check cell (tests/exercise_helpers.run_check) with a deliberately wrong
function or class in place of the learner's, and asserts that the check fails with an AssertionError that names the
mistake. The wrong answers of 10.1 are the solution's cell with one edit (tests/exercise_helpers.mutated), so they stay
in step with it. The notebook runs on the tiny model: a run up to a check takes about a second. The engine core's
acceptance of a learner's scheduler under async scheduling is tested in tests/test_engine_core.py.
"""
from __future__ import annotations

import re

import nbformat
import pytest

from minillm.core.sched.async_scheduler import AsyncScheduler
from minillm.core.sched.scheduler import Scheduler
from minillm.exercises.build import BEGIN
from tests.exercise_helpers import (EXERCISE_HEADING, HINT_FORMAT, ROOT, exercise_source, mutated, run_check,
                                    run_check_with_answer)

SOLUTION = "10_engine_core.ipynb"
HEADER = """from minillm.core.sched.output import SchedulerOutput
from minillm.sample.metadata import make_generator
from minillm.sampling_params import SamplingType
from minillm.worker.input_batch import InputBatch
from minillm.worker.model_runner import CachedRequestState
"""


def _assert_caught(e: BaseException | None, *phrases: str) -> None:
    assert isinstance(e, AssertionError), f"the check should fail with an AssertionError, got {e!r}"
    for phrase in phrases:
        assert phrase in str(e), f"{phrase!r} is not in the check's message: {e}"


# ---------------------------------------------------------------------------------------------------------------------
# Exercise 10.1: the persistent batch

def test_10_1_solution_passes():
    assert run_check(SOLUTION, "10.1") is None


def _wrong_10_1(*edits: tuple[str, str]):
    return mutated(SOLUTION, "10.1", "update_states", *edits, header=HEADER)


WRONG_10_1 = {
    "forgets condense": ((("    batch.condense()\n", ""),),
                         ("the batch has holes at slots", "call batch.condense()")),
    "keeps a finished request's state": ((("        requests.pop(rid, None)\n", ""),),
                                         ("is in scheduler_output.finished_req_ids but still in requests",
                                          "leaves both requests and the batch")),
    "never removes a finished request": (((
        "    for rid in so.finished_req_ids:\n        requests.pop(rid, None)\n        batch.remove_request(rid)\n",
        ""),), ("finished_req_ids but still in requests",)),
    "removes a finished request from requests only": ((("        batch.remove_request(rid)\n    cached",
                                                        "    cached"),),
                                                      ("already in the batch", "finished and is new in this same plan",
                                                       "remove the finished requests (from requests and from the "
                                                       "batch) first")),
    "appends a resumed request's blocks": (((
        "        if rid in cached.resumed_req_ids:\n            state.block_ids = list(new_blocks)   # its old blocks "
        "were freed at the preemption\n        else:\n            state.block_ids.extend(new_blocks)\n",
        "        state.block_ids.extend(new_blocks)\n"),),
        ("resumes after a preemption", "Its old blocks were freed", "replace its block_ids with it, do not append")),
    "ignores the drafts": ((("    for rid, drafts in so.scheduled_spec_decode_tokens.items():\n"
                             "        batch.update_req_spec_token_ids(rid, drafts)\n", ""),),
                           ("verifies the draft tokens", "batch.update_req_spec_token_ids(")),
    "writes the drafts before condensing": (
        (("    batch.condense()\n", ""),
         ("        batch.update_req_spec_token_ids(rid, drafts)\n",
          "        batch.update_req_spec_token_ids(rid, drafts)\n    batch.condense()\n")),
        ("It moved from slot", "write the drafts after condense()")),
    "ignores the resent tokens": ((("            state.token_ids = list(cached.all_token_ids[rid])\n",
                                    "            pass\n"),),
                                  ("the scheduler resent its tokens", "replace its token_ids with them",
                                   "and 1 more")),
    "drops an unscheduled request's state": ((("        batch.remove_request(rid)   # its state stays",
                                               "        requests.pop(rid); batch.remove_request(rid)   #"),),
                                             ("is missing from requests", "keeps its state")),
    "leaves an unscheduled request in the batch": ((("    for rid in [r for r in batch.req_id_to_index if r not in "
                                                     "keep]:\n        batch.remove_request(rid)", "    if False:\n"
                                                     "        pass"),),
                                                   ("which is not scheduled in this step", "leaves the batch")),
    "no generator for a seeded request": (((
        "make_generator(params.seed) if params.sampling_type == SamplingType.RANDOM_SEED else None", "None"),),
        ("generator is None, expected make_generator(seed)",)),
    "does not append a running request's new blocks to its row": ((("        batch.block_table.append_row(new_blocks, "
                                                                    "slot)\n", ""),),
                                                                  ("its block-table row holds", "append_row")),
    "does not put a left-out request back": (((
        "            to_add.append(state)   # left out earlier, or resumed: copied in whole below\n"
        "            continue",
        "            continue"),), ("is scheduled in this step but not in the batch", "batch.add_request(")),
    "condenses before adding": (((
        "    for state in to_add:\n        batch.add_request(state)\n    batch.condense()\n",
        "    batch.condense()\n    for state in to_add:\n        batch.add_request(state)\n"),),
        ("the slots hold", "then condense() once")),
}


@pytest.mark.parametrize("mistake", sorted(WRONG_10_1))
def test_10_1_mistakes_are_named(mistake):
    edits, phrases = WRONG_10_1[mistake]
    _assert_caught(run_check(SOLUTION, "10.1", update_states=_wrong_10_1(*edits)), *phrases)


def test_10_1_a_crash_names_the_step():
    def crashes(batch, requests, scheduler_output):
        raise KeyError("oops")

    _assert_caught(run_check(SOLUTION, "10.1", update_states=crashes), "step 0 of", "your update_states raised "
                   "KeyError")


def test_10_1_delegating_to_the_runner_fails():
    def delegating(batch, requests, scheduler_output):
        from types import SimpleNamespace

        from minillm.worker.model_runner import ModelRunner

        runner = SimpleNamespace(input_batch=batch, requests=requests, device="cpu")
        ModelRunner._update_states(runner, scheduler_output)

    _assert_caught(run_check(SOLUTION, "10.1", update_states=delegating),
                   "Exercise 10.1 asks you to write this yourself", "ModelRunner._update_states")


def test_10_1_the_runs_go_through_every_case():
    """The counts the check prints: each case a mistake above needs is there."""
    from minillm.exercises.ch10 import check_update_states

    source = exercise_source(SOLUTION, "10.1")
    ns: dict = {}
    exec(compile(HEADER + source, "<10.1>", "exec"), ns)  # noqa: S102
    counts = check_update_states(ns["update_states"], verbose=False)
    assert counts["steps"] >= 50
    for key in ("new", "finished", "preempted", "resumed", "left out by the budget", "with drafts",
                "moved by condense"):
        assert counts[key] > 0, key


# ---------------------------------------------------------------------------------------------------------------------
# Exercise 10.2: the placeholder accounting

class Reference(Scheduler):
    """The solution's accounting, written here so that the wrong answers below change one thing each."""

    def _update_after_schedule(self, scheduler_output):
        super()._update_after_schedule(scheduler_output)
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests[rid]
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1

    def _update_request_with_output(self, request, new_token_ids):
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids)
        request.num_output_placeholders -= len(new_token_ids)
        return new_token_ids, stopped


class DecodesOnly(Reference):
    """The last chunk of a prefill gets no placeholder: only requests that already have outputs count."""

    def _update_after_schedule(self, scheduler_output):
        Scheduler._update_after_schedule(self, scheduler_output)
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests[rid]
            if request.num_output_tokens > 0:
                request.num_output_placeholders += 1


class EveryChunk(Reference):
    """Every scheduled request gets a placeholder, prefill chunks that sample nothing too."""

    def _update_after_schedule(self, scheduler_output):
        Scheduler._update_after_schedule(self, scheduler_output)
        for rid in scheduler_output.num_scheduled_tokens:
            self.requests[rid].num_output_placeholders += 1


class PrefillsOnly(Reference):
    """Only the last chunk of a prompt gets a placeholder, decodes none."""

    def _update_after_schedule(self, scheduler_output):
        Scheduler._update_after_schedule(self, scheduler_output)
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests[rid]
            if request.num_output_tokens == 0 and request.num_computed_tokens >= request.num_tokens:
                request.num_output_placeholders += 1


class NeverDecremented(Reference):
    def _update_request_with_output(self, request, new_token_ids):
        return Scheduler._update_request_with_output(self, request, new_token_ids)


class ClearedOnStop(Reference):
    """A stopped request's count goes to 0, as if the output of the step still in flight had come back."""

    def _update_request_with_output(self, request, new_token_ids):
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids)
        if stopped:
            request.num_output_placeholders = 0
        return new_token_ids, stopped


class WithoutSuper(Reference):
    """The count is right, but num_computed_tokens never advances."""

    def _update_after_schedule(self, scheduler_output):
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[rid]
            if request.num_computed_tokens + n >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1


@pytest.mark.parametrize("wrong, phrases", [
    (DecodesOnly, ("request 'one' has 0 output placeholder(s), the reference 1", "the end of its 4-token prompt",
                   "the last chunk of a prefill counts one placeholder")),
    (EveryChunk, ("request 'long' has 1 output placeholder(s), the reference 0",
                  "positions 0..4 of its 23-token prompt", "samples nothing")),
    (PrefillsOnly, ("request 'stops' has 1 output placeholder(s), the reference 2", "step 3 decodes it",
                    "1 in flight): it samples a token, so count one placeholder")),
    (NeverDecremented, ("after the update_from_output() of step 0's output", "take back as many placeholders")),
    (ClearedOnStop, ("request 'stops' has 0 output placeholder(s), the reference 1", "it finished (stop)",
                     "their placeholders are never taken back")),
    (WithoutSuper, ("has num_computed_tokens 0, the reference 5", "call super()._update_after_schedule")),
], ids=lambda x: x.__name__ if isinstance(x, type) else "")
def test_10_2_mistakes_are_named(wrong, phrases):
    _assert_caught(run_check(SOLUTION, "10.2", PlaceholderScheduler=wrong), *phrases)


def test_10_2_solution_passes():
    assert run_check(SOLUTION, "10.2") is None


def test_10_2_the_reference_written_here_passes_and_the_scenarios_cover_every_case():
    from minillm.exercises.ch10 import check_placeholder_scheduler

    counts = check_placeholder_scheduler(Reference, verbose=False)
    for key in ("placeholders", "chunks that sample nothing", "last step in flight", "stops with a step in flight",
                "preemptions with a step in flight"):
        assert counts[key] > 0, key


def test_10_2_a_missing_method_is_named():
    class OnlyAfterSchedule(Scheduler):
        _update_after_schedule = Reference._update_after_schedule

    class Chapter4Style(Scheduler):
        def _schedule_running(self, step):
            return super()._schedule_running(step)

    _assert_caught(run_check(SOLUTION, "10.2", PlaceholderScheduler=OnlyAfterSchedule),
                   "must define _update_request_with_output")
    _assert_caught(run_check(SOLUTION, "10.2", PlaceholderScheduler=Chapter4Style),
                   "must define _update_after_schedule")


def test_10_2_delegating_through_super_fails():
    class Delegating(AsyncScheduler):
        def _update_after_schedule(self, scheduler_output):
            super()._update_after_schedule(scheduler_output)

        def _update_request_with_output(self, request, new_token_ids):
            return super()._update_request_with_output(request, new_token_ids)

    _assert_caught(run_check(SOLUTION, "10.2", PlaceholderScheduler=Delegating),
                   "Exercise 10.2 asks you to write this yourself", "AsyncScheduler._update_after_schedule")


def test_10_2_delegating_through_the_class_fails():
    class Delegating(Scheduler):
        def _update_after_schedule(self, scheduler_output):
            AsyncScheduler._update_after_schedule(self, scheduler_output)

        def _update_request_with_output(self, request, new_token_ids):
            return Reference._update_request_with_output(self, request, new_token_ids)

    _assert_caught(run_check(SOLUTION, "10.2", PlaceholderScheduler=Delegating),
                   "Exercise 10.2 asks you to write this yourself", "AsyncScheduler._update_after_schedule")


def test_10_2_an_async_scheduler_that_inherits_the_methods_fails():
    class Inherits(AsyncScheduler):
        pass

    class HalfInherits(AsyncScheduler):
        _update_after_schedule = Reference._update_after_schedule

    for cls in (Inherits, HalfInherits):
        _assert_caught(run_check(SOLUTION, "10.2", PlaceholderScheduler=cls),
                       "Exercise 10.2 asks you to write this yourself", "a method your class inherits")


def test_10_2_a_crash_names_the_turn():
    class Crashes(Reference):
        def _update_request_with_output(self, request, new_token_ids):
            raise KeyError("oops")

    _assert_caught(run_check(SOLUTION, "10.2", PlaceholderScheduler=Crashes), "turn 1",
                   "your scheduler raised KeyError")


def test_10_2_the_stub_fails_with_not_implemented():
    answer = exercise_source(SOLUTION, "10.2")
    stubbed = re.sub(r"### BEGIN SOLUTION.*?### END SOLUTION", "raise NotImplementedError('10.2')", answer, flags=re.S)
    error = run_check_with_answer(SOLUTION, "10.2", stubbed)
    assert isinstance(error, NotImplementedError), repr(error)


# ---------------------------------------------------------------------------------------------------------------------
# The notebook's format

def test_the_exercises_have_a_heading_a_two_step_hint_and_a_check():
    cells = nbformat.read(ROOT / "solutions" / SOLUTION, as_version=4).cells
    found = []
    for i, cell in enumerate(cells):
        if cell.cell_type != "code" or BEGIN not in cell.source:
            continue
        number = re.match(r"# Exercise (\d+\.\d+):", cell.source).group(1)
        heading, hint = cells[i - 2], cells[i - 1]
        m = EXERCISE_HEADING.match(heading.source)
        assert m and m.group(1) == number, f"exercise {number}: no '### Exercise {number} ★ title' two cells above"
        assert HINT_FORMAT.match(hint.source.strip()), f"exercise {number}: the hint is not two <details> steps"
        assert cells[i + 1].source.startswith(f"# Check Exercise {number}")
        # The check functions run the answer under the tripwire themselves (minillm/exercises/ch10).
        assert {"10.1": "check_update_states(update_states, ", "10.2": "check_placeholder_scheduler("
                "PlaceholderScheduler, "}[number] in cells[i + 1].source
        found.append((number, m.group(2)))
    assert found == [("10.1", "★★"), ("10.2", "★★")]
    intro = cells[0].source
    assert re.search(r"Run time: about [\d.]+ (s|min) on a 2-core CPU", intro) and "Points: 4 " in intro
    for number, stars in found:
        assert f"**Exercise {number} {stars}**" in intro


ANSWER_FRAGMENTS = {"10.1": ("state.block_ids.extend", "batch.block_table.append_row(", "to_add", "getsource"),
                    "10.2": ("num_output_placeholders += 1", "num_output_placeholders -= ", "getsource")}


@pytest.mark.parametrize("number", sorted(ANSWER_FRAGMENTS))
def test_no_answer_is_shown_unfolded_before_its_exercise(number):
    """Before an exercise's cell, no code cell, output or unfolded text holds its answer (the folded hints may)."""
    cells = nbformat.read(ROOT / "solutions" / SOLUTION, as_version=4).cells
    at = next(i for i, c in enumerate(cells) if c.cell_type == "code" and c.source.startswith(f"# Exercise {number}:"))
    for i, cell in enumerate(cells[:at]):
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith("<details>"):
            continue
        text = cell.source + "".join(o.get("text", "") for o in cell.get("outputs", []))
        for fragment in ANSWER_FRAGMENTS[number]:
            assert fragment not in text, f"cell {i} shows {fragment!r} before exercise {number}"
