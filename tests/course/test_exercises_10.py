"""The checks of solutions/10_engine_core.ipynb pass the reference answers, catch the typical wrong ones and say why,
and refuse answers that delegate to the package.

Each test runs the solution notebook up to one check cell (tests/exercise_helpers.run_check) with a deliberately wrong
function or class in place of the learner's, and asserts that the check fails with an AssertionError that names the
mistake. The wrong answers of 10.1 (Model Runner V2's slots) and of 10.4 (the positions kernel, run in Triton's
interpreter) are the solution's cell with one edit (tests/exercise_helpers.mutated), so they stay in step with it.
The notebook runs on the tiny model: a run up to a check takes about a second. The engine core's acceptance of a
learner's scheduler under async scheduling is tested in tests/engine/test_engine_core.py. The wrong answers of 10.3
(the per-rank KV cache) are the solution's cell with one edit; its references are tested against the package's
QKVParallelLinear, shard_summary, num_kv_heads_per_rank and the tensor-parallel model's layers.

Challenge 10 (reorder the persistent batch, minillm/course/exercises/challenges/ch10.py): its check runs after the set-up cell
alone; its wrong answers are the solution's cell with one edit or short functions written here (ids moved without
their data, a rebuilt or permuted batch, a selection sort that swaps too often). Its reference is tested on random
batches with hypothesis: vLLM's four rules, region order, data moved with each request, and as many swaps as vLLM's
loop makes (k - 1 per cycle of k misplaced requests, counted here independently).
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import nbformat
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.core.sched.async_scheduler import AsyncScheduler
from minillm.core.sched.scheduler import Scheduler
from minillm.course.exercises.build import BEGIN
from minillm.course.persistent_batch import InputBatch
from minillm.worker.model_runner import CachedRequestState
from tests.course.exercise_helpers import (CHALLENGE_HEADING, EXERCISE_HEADING, HINT_FORMAT, ROOT, exercise_source,
                                           mutated, run_challenge, run_check, run_check_after_setup,
                                           run_check_with_answer)

SOLUTION = "10_engine_core.ipynb"
HEADER = """import torch
from minillm.core.sched.output import SchedulerOutput
from minillm.sample.metadata import make_generator
from minillm.sampling_params import SamplingType
from minillm.worker.block_table import BlockTables
from minillm.worker.model_runner import RequestInfo, sort_batch_req_ids
from minillm.worker.states import RequestState
"""
TRITON_HEADER = "import torch\nimport triton\nimport triton.language as tl\n"


def _assert_caught(e: BaseException | None, *phrases: str) -> None:
    assert isinstance(e, AssertionError), f"the check should fail with an AssertionError, got {e!r}"
    for phrase in phrases:
        assert phrase in str(e), f"{phrase!r} is not in the check's message: {e}"


# ---------------------------------------------------------------------------------------------------------------------
# Exercise 10.1: Model Runner V2's slots

def test_10_1_solution_passes():
    assert run_check(SOLUTION, "10.1") is None


def _wrong_10_1(*edits: tuple[str, str]):
    return mutated(SOLUTION, "10.1", "update_states", *edits, header=HEADER)


_FREE = "sorted(so.finished_req_ids | so.preempted_req_ids)"
_RETURN = "    return [req_states.req_id_to_index[rid] for rid in order]"
_RESUME_REMOVE = "            req_states.remove_request(rid)   # preempted between two plans"
WRONG_10_1 = {
    "keeps a preempted request's slot": (((_FREE, "sorted(so.finished_req_ids)"),),
                                         ("was preempted (scheduler_output.preempted_req_ids) but still holds slot",
                                          "gives its slot back")),
    "returns the rows in slot order": (((_RETURN, "    return sorted(req_states.req_id_to_index[rid] for rid in "
                                                  "order)"),),
                                       ("the rows are in slot order", "sort_batch_req_ids")),
    "returns the rows in the plan's order": (((_RETURN, "    return [req_states.req_id_to_index[rid] for rid in "
                                                        "so.num_scheduled_tokens]"),),
                                             ("the rows are in the plan's order, unsorted",)),
    "frees in reverse order": (((_FREE, "sorted(so.finished_req_ids | so.preempted_req_ids, reverse=True)"),),
                               ("in sorted order of their ids",)),
    "appends a resumed request's blocks": ((("block_tables.append_block_ids(slot, cached.new_block_ids[i], "
                                             "overwrite=True)", "block_tables.append_block_ids(slot, "
                                             "cached.new_block_ids[i], overwrite=False)"),),
                                           ("resumes after a preemption", "its whole new list",
                                            "overwrite=True")),
    "overwrites a running request's blocks": ((("cached.new_block_ids[i], overwrite=False)",
                                                "cached.new_block_ids[i], overwrite=True)"),),
                                              ("kept its slot", "append them to its row (overwrite=False)")),
    "ignores the drafts": ((("        req_states.draft_tokens[slot, :len(drafts)] = torch.tensor(drafts, "
                             "dtype=torch.int64)\n", "        pass\n"),),
                           ("verifies the drafts", "req_states.draft_tokens[slot, :")),
    "ignores the resent tokens": ((("            req_states.replace_tokens(slot, cached.all_token_ids[rid])",
                                    "            pass"),),
                                  ("'a failed KV load, then every request preempted'", "and 1 more",
                                   "req_states.replace_tokens")),
    "no generator for a seeded request": (((
        "make_generator(params.seed) if params.sampling_type == SamplingType.RANDOM_SEED else None", "None"),),
        ("generator is None, expected make_generator(seed)",)),
    "remembers a finished request": ((("        requests_info.pop(rid, None)   #", "        pass   #"),),
                                     ("requests_info still holds", "the runner forgets a finished request")),
    "forgets a preempted request": ((("    for rid in so.finished_req_ids:\n        requests_info.pop",
                                      "    for rid in so.finished_req_ids | so.preempted_req_ids:\n"
                                      "        requests_info.pop"),),
                                    ("requests_info lost", "a preempted one keeps its RequestInfo")),
    "resumes a request in the slot it still holds": (((_RESUME_REMOVE, "            pass   # preempted between two "
                                                                       "plans"),),
                                                     ("already holds slot", "resume in this plan while they still "
                                                      "hold their slots", "remove_request, then add_request")),
    "does not set the context length": ((("        req_states.set_num_computed_tokens(slot, "
                                          "cached.num_computed_tokens[i])\n", ""),),
                                        ("num_computed_tokens is", "req_states.set_num_computed_tokens")),
}


def _adds_before_frees():
    """The solution with its first two blocks swapped: new requests take slots before the finished give theirs."""
    source = exercise_source(SOLUTION, "10.1")
    one = source[source.index("    # 1. Slots back"):source.index("    # 2. New requests")]
    two = source[source.index("    # 2. New requests"):source.index("    # 3. Resumed")]
    return mutated(SOLUTION, "10.1", "update_states", (one + two, two + one), header=HEADER)


@pytest.mark.parametrize("mistake", sorted(WRONG_10_1))
def test_10_1_mistakes_are_named(mistake):
    edits, phrases = WRONG_10_1[mistake]
    _assert_caught(run_check(SOLUTION, "10.1", update_states=_wrong_10_1(*edits)), *phrases)


def test_10_1_adding_before_freeing_is_named():
    _assert_caught(run_check(SOLUTION, "10.1", update_states=_adds_before_frees()),
                   "finished (scheduler_output.finished_req_ids) but still holds slot",
                   "free the slots of finished requests first thing")


def test_10_1_a_slot_given_twice_is_named():
    """An answer that writes the slot maps itself, giving a new request a slot another one still holds."""
    solution = _wrong_10_1()

    def shares_a_slot(req_states, block_tables, requests_info, so):
        order = solution(req_states, block_tables, requests_info, so)
        if len(req_states.req_id_to_index) >= 2:
            a, b = sorted(req_states.req_id_to_index)[:2]
            req_states.req_id_to_index[b] = req_states.req_id_to_index[a]
        return order

    _assert_caught(run_check(SOLUTION, "10.1", update_states=shares_a_slot), "is held by both",
                   "only after the one before it left")


def test_10_1_a_crash_names_the_step():
    def crashes(req_states, block_tables, requests_info, scheduler_output):
        raise KeyError("oops")

    _assert_caught(run_check(SOLUTION, "10.1", update_states=crashes), "step 0 of", "your update_states raised "
                   "KeyError")


@pytest.mark.parametrize("method", ["finish_requests", "add_requests", "update_requests"])
def test_10_1_delegating_to_the_runner_fails(method):
    """The runner's own methods, called on a stand-in that holds the learner's slots, are refused."""
    solution = _wrong_10_1()

    def delegating(req_states, block_tables, requests_info, scheduler_output):
        from types import SimpleNamespace

        from minillm.worker.model_runner import ModelRunner

        stand_in = SimpleNamespace(req_states=req_states, block_tables=block_tables, requests_info=requests_info,
                                   device=torch.device("cpu"))
        stand_in._add = lambda *a: ModelRunner._add(stand_in, *a)
        getattr(ModelRunner, method)(stand_in, scheduler_output)
        return solution(req_states, block_tables, requests_info, scheduler_output)

    _assert_caught(run_check(SOLUTION, "10.1", update_states=delegating),
                   "Exercise 10.1 asks you to write this yourself", f"ModelRunner.{method}")


def test_10_1_the_runners_update_on_another_thread_fails():
    """The guard watches threads the answer starts too (the lint refuses the package's thread pools)."""
    import threading

    solution = _wrong_10_1()

    def on_a_thread(req_states, block_tables, requests_info, scheduler_output):
        from types import SimpleNamespace

        from minillm.worker.model_runner import ModelRunner

        stand_in = SimpleNamespace(req_states=req_states, block_tables=block_tables, requests_info=requests_info)
        worker = threading.Thread(target=ModelRunner.finish_requests, args=(stand_in, scheduler_output))
        worker.start()
        worker.join(timeout=30)
        return solution(req_states, block_tables, requests_info, scheduler_output)

    _assert_caught(run_check(SOLUTION, "10.1", update_states=on_a_thread),
                   "Exercise 10.1 asks you to write this yourself", "ModelRunner.finish_requests")


def test_10_1_a_seeded_request_needs_its_own_seed():
    _assert_caught(run_check(SOLUTION, "10.1", update_states=_wrong_10_1(
        ("make_generator(params.seed) if", "make_generator(0) if"))), "is not make_generator(5)")


def test_10_1_a_greedy_request_with_a_seed_gets_no_generator():
    _assert_caught(run_check(SOLUTION, "10.1", update_states=_wrong_10_1(
        ("if params.sampling_type == SamplingType.RANDOM_SEED else None", "if params.seed is not None else None"))),
        "generator is a generator, expected None")


def test_10_1_the_runs_go_through_every_case():
    """The counts the check prints: each case a mistake above needs is there."""
    from minillm.course.exercises.ch10 import check_update_states

    counts = check_update_states(_wrong_10_1(), verbose=False)
    assert counts["steps"] >= 50
    for key in ("new", "finished", "preempted", "resumed", "left out by the budget", "with drafts",
                "resent to their slot", "resumed from their slot", "slots reused", "rows out of slot order"):
        assert counts[key] > 0, key


def test_10_1_every_rule_is_reached_by_a_replayed_step():
    """Every statement of the solution's update_states runs on some replayed step, so no rule is one the runs never
    need (an answer that leaves it out would pass)."""
    import ast
    import sys

    from minillm.course.exercises.ch10 import check_update_states

    source = HEADER + exercise_source(SOLUTION, "10.1")
    ns: dict = {}
    exec(compile(source, "<10.1>", "exec"), ns)  # noqa: S102
    ran: set[int] = set()

    def trace(frame, event, arg):
        if frame.f_code.co_filename != "<10.1>":
            return None
        ran.add(frame.f_lineno)
        return trace

    def traced(*args):
        sys.settrace(trace)
        try:
            return ns["update_states"](*args)
        finally:
            sys.settrace(None)

    check_update_states(traced, verbose=False)
    function = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)
                    and n.name == "update_states")
    statements = {n.lineno for n in ast.walk(function) if isinstance(n, ast.stmt) and n is not function
                  and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))}  # not the docstring
    lines = source.splitlines()
    missed = [lines[i - 1].strip() for i in sorted(statements - ran)]
    assert not missed, missed


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
    from minillm.course.exercises.ch10 import check_placeholder_scheduler

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
# Exercise 10.3: each rank's share of the KV cache

HEADER_10_3 = "import torch\nfrom minillm.config import LlamaConfig\n"
_HEADS_SPLIT = "    if tp_size <= num_kv_heads:   # enough heads to split: an equal run of consecutive ones per rank\n"
_REPLICA = "    return [rank // replicas]\n"
_RANGE = "        return list(range(rank * per_rank, (rank + 1) * per_rank))\n"
_HEADS = "    heads = len(kv_heads_of_rank(config.num_key_value_heads, tp_size, 0))   # every rank holds as many\n"
_BLOCK = "    block_bytes = block_size * 2 * config.num_hidden_layers * heads * config.head_dim * dtype_bytes\n"
_RETURN = "    return budget_bytes // block_bytes   #"


def _wrong_10_3(*edits: tuple[str, str]) -> dict:
    """The solution's two functions with ``edits`` applied to the cell; the blocks' function calls the edited heads'."""
    kv = mutated(SOLUTION, "10.3", "kv_heads_of_rank", *edits, header=HEADER_10_3)
    return {"kv_heads_of_rank": kv, "num_blocks_per_rank": kv.__globals__["num_blocks_per_rank"]}


WRONG_10_3 = {
    # The heads
    "splits the heads although ranks outnumber them": (
        ((_HEADS_SPLIT, "    if True:\n"),),
        ("kv_heads_of_rank(num_kv_heads=1, tp_size=2, rank=0) returns [], expected [0]", "gets no KV head",
         "ranks outnumber KV heads", "replicated")),
    "gives rank r head r when ranks outnumber the heads": (
        ((_REPLICA, "    return [rank]\n"),),
        ("returns [1], expected [0]", "the model has only KV heads 0..0", "replicated")),
    "rank % num_kv_heads": (
        ((_REPLICA, "    return [rank % num_kv_heads]\n"),),
        ("kv_heads_of_rank(num_kv_heads=2, tp_size=4, rank=1) returns [1], expected [0]",
         "that is rank % num_kv_heads", "Neighbouring ranks must share a head", "tp_rank // num_kv_head_replicas")),
    "every KV head on every rank": (
        ((_RANGE, "        return list(range(num_kv_heads))\n"),),
        ("kv_heads_of_rank(num_kv_heads=2, tp_size=2, rank=0) returns [0, 1], expected [0]",
         "the tp_size=1 answer")),
    "a strided split": (
        ((_RANGE, "        return list(range(rank, num_kv_heads, tp_size))\n"),),
        ("returns [0, 2], expected [0, 1]", "strided split", "consecutive")),
    "the heads as a tensor": (
        ((_RANGE, "        return torch.arange(rank * per_rank, (rank + 1) * per_rank)\n"),),
        ("returns a Tensor", "return a list of Python ints")),
    # The blocks
    "divides the budget by tp_size": (
        ((_RETURN, "    return budget_bytes // tp_size // block_bytes   #"),),
        ("tp_size=32, budget_bytes=100,012,345) returns 5, expected 190", "it divides the budget by tp_size",
         "one rank's own", "per GPU")),
    "K only": (
        ((_BLOCK, _BLOCK.replace("block_size * 2 *", "block_size *")),),
        ("returns 381, expected 190", "it counts only K (or only V)", "hence the factor 2")),
    "all KV heads in a rank's block": (
        ((_HEADS, "    heads = config.num_key_value_heads\n"),),
        ("returns 23, expected 190", "it counts all KV heads in a rank's block", "the tp_size=1 answer",
         "1 of a Llama-3-8B-shaped config's 8 at tp_size=32")),
    "rounds up": (
        ((_RETURN, "    return -(-budget_bytes // block_bytes)   #"),),
        ("returns 191, expected 190", "it rounds up", "rounded down")),
    "no head when ranks outnumber them": (
        ((_HEADS, "    heads = config.num_key_value_heads // tp_size\n"),),
        ("tp_size=32", "raised ZeroDivisionError", "ranks outnumber KV heads here (32 > 8)",
         "one whole (replicated) head")),
    "a fraction of a replicated head": (
        ((_HEADS, "    heads = config.num_key_value_heads / tp_size\n"),
         (_RETURN, "    return int(budget_bytes // block_bytes)   #")),
        ("returns 763, expected 190", "it counts a fraction of a KV head per rank", "8/32 here")),
    "the blocks as a float": (
        ((_RETURN, "    return budget_bytes / block_bytes   #"),),
        ("returns a float", "use `//`")),
    "two mistakes at once": (
        ((_RETURN, "    return -(-budget_bytes // tp_size // block_bytes)   #"),),
        ("returns 6, expected 190", "a rank holds 1 KV head(s) here", "524,288 bytes")),
}


def test_10_3_solution_passes():
    assert run_check_after_setup(SOLUTION, "10.3") is None


@pytest.mark.parametrize("mistake", sorted(WRONG_10_3))
def test_10_3_mistakes_are_named(mistake):
    edits, phrases = WRONG_10_3[mistake]
    _assert_caught(run_check_after_setup(SOLUTION, "10.3", **_wrong_10_3(*edits)), *phrases)


def test_10_3_the_blocks_are_checked_with_the_learners_own_heads_too():
    """A right num_blocks_per_rank beside a wrong kv_heads_of_rank still fails, at the heads (checked first)."""
    answers = _wrong_10_3((_REPLICA, "    return [rank % num_kv_heads]\n"))
    from minillm.course.exercises.ch10 import check_kv_per_rank

    with pytest.raises(AssertionError, match=r"that is rank % num_kv_heads"):
        check_kv_per_rank(answers["kv_heads_of_rank"], answers["num_blocks_per_rank"], verbose=False)


def test_10_3_a_crash_names_the_split():
    def crashes(num_kv_heads, tp_size, rank):
        return [list(range(num_kv_heads))[rank]]

    _assert_caught(run_check_after_setup(SOLUTION, "10.3", kv_heads_of_rank=crashes),
                   "kv_heads_of_rank(num_kv_heads=1, tp_size=2, rank=1) raised IndexError",
                   "each head is replicated on 2 ranks")


def test_10_3_delegating_through_the_layer_or_the_summary_fails():
    def through_the_layer(num_kv_heads, tp_size, rank):
        import torch

        from minillm.model.parallel_layers import QKVParallelLinear

        w = torch.zeros(num_kv_heads * tp_size, 1)
        kv = torch.zeros(num_kv_heads, 1)
        return QKVParallelLinear(w, kv, kv, num_kv_heads * tp_size, num_kv_heads, 1, rank, tp_size).kv_heads

    def through_the_summary(num_kv_heads, tp_size, rank):
        from minillm.config import LlamaConfig
        from minillm.model.llama_tp import shard_summary

        config = LlamaConfig(num_attention_heads=num_kv_heads * tp_size, num_key_value_heads=num_kv_heads,
                             hidden_size=num_kv_heads * tp_size * 64, intermediate_size=64 * tp_size, vocab_size=64)
        return shard_summary(config, tp_size)[rank].kv_heads

    for answer, target in ((through_the_layer, "QKVParallelLinear.__init__"), (through_the_summary, "shard_summary")):
        _assert_caught(run_check_after_setup(SOLUTION, "10.3", kv_heads_of_rank=answer),
                       "Exercise 10.3 asks you to write this yourself", target)


def test_10_3_the_references_are_the_packages_and_cover_every_case():
    """reference_kv_heads is QKVParallelLinear's choice on the models' own head shapes, and agrees with
    num_kv_heads_per_rank for SmolLM2's 3 KV heads at tp 1, 3, 9 and the tiny model's 2 at 1, 2, 4; with shard_summary
    and the tensor-parallel model's layers where the whole model splits (SmolLM2's 1,536 MLP features do not split
    over 9 ranks); reference_num_blocks is the formula of the statement; the cases hold every kind the mistakes
    need."""
    import torch

    from minillm.course.exercises.ch10.kv_per_rank import (CONFIGS, SMOLLM2_CONFIG, block_cases, head_cases,
                                                          reference_kv_heads, reference_num_blocks, tp_sizes_of)
    from minillm.course.exercises.ch10.tiny import TINY_CONFIG, tiny_llama
    from minillm.model.llama_tp import TensorParallelLlamaForCausalLM, shard_summary
    from minillm.model.parallel_layers import QKVParallelLinear, num_kv_heads_per_rank

    assert tp_sizes_of(SMOLLM2_CONFIG) == [1, 3] and tp_sizes_of(TINY_CONFIG) == [1, 2, 4]
    for config, sizes in ((SMOLLM2_CONFIG, (1, 3, 9)), (TINY_CONFIG, (1, 2, 4))):
        nkv, d = config.num_key_value_heads, config.head_dim
        q, kv = torch.zeros(config.num_attention_heads * d, 1), torch.zeros(nkv * d, 1)
        for tp in sizes:
            shards = shard_summary(config, tp) if tp in tp_sizes_of(config) else None
            for rank in range(tp):
                heads = reference_kv_heads(nkv, tp, rank)
                layer = QKVParallelLinear(q, kv, kv, config.num_attention_heads, nkv, d, rank, tp)
                assert heads == layer.kv_heads and len(heads) == num_kv_heads_per_rank(nkv, tp)
                assert shards is None or heads == shards[rank].kv_heads
    model = tiny_llama()
    for tp in (2, 4):
        for rank in range(tp):
            shard = TensorParallelLlamaForCausalLM(model, tp_rank=rank, tp_size=tp)
            assert shard.model.layers[0].self_attn.qkv_proj.kv_heads == reference_kv_heads(2, tp, rank)
    for name, block_size, dtype_bytes, tp, budget in block_cases():
        c = CONFIGS[name]
        heads = len(reference_kv_heads(c.num_key_value_heads, tp, 0))
        block = block_size * 2 * c.num_hidden_layers * heads * c.head_dim * dtype_bytes
        assert reference_num_blocks(c, block_size, dtype_bytes, tp, budget) == budget // block
    cases = head_cases()
    assert any(tp > nkv >= 2 for nkv, tp, _ in cases) and any(nkv // tp >= 2 and tp > 1 for nkv, tp, _ in cases)
    blocks = block_cases()
    assert any(tp > CONFIGS[n].num_key_value_heads for n, _, _, tp, _ in blocks) and len(blocks) == 176


def test_10_3_the_stub_fails_with_not_implemented():
    answer = exercise_source(SOLUTION, "10.3")
    stubbed = re.sub(r"### BEGIN SOLUTION.*?### END SOLUTION", "raise NotImplementedError('10.3')", answer, flags=re.S)
    error = run_check_with_answer(SOLUTION, "10.3", stubbed, setup_only=True)
    assert isinstance(error, NotImplementedError), repr(error)


# ---------------------------------------------------------------------------------------------------------------------
# Exercise 10.4: an input kernel in Triton

def _wrong_10_4(tmp_path, *edits: tuple[str, str]):
    return mutated(SOLUTION, "10.4", "my_pos_seq_lens_kernel", *edits, header=TRITON_HEADER, tmp_path=tmp_path)


def test_10_4_solution_passes():
    assert run_check_after_setup(SOLUTION, "10.4") is None


_LOOP = "    for i in range(0, query_len, BLOCK):\n        j = i + tl.arange(0, BLOCK)"
WRONG_10_4 = {
    "reads the row's number as its slot": ((("num_computed = tl.load(num_computed_tokens_ptr + slot)",
                                             "num_computed = tl.load(num_computed_tokens_ptr + b)"),),
                                           ("it read num_computed_tokens[0], the row's number",
                                            "idx_mapping[0] = 5")),
    "no loop over a long query": (((_LOOP, "    for i in range(0, 1):\n        j = tl.arange(0, BLOCK)"),),
                                  ("only its first 4 positions are right", "loop over it in steps of BLOCK")),
    "positions from 0": ((("(num_computed + j).to(tl.int64)", "j.to(tl.int64)"),), ("they start from 0",)),
    "a sequence length without the cache": ((("tl.store(seq_lens_ptr + b, num_computed + query_len)",
                                              "tl.store(seq_lens_ptr + b, query_len)"),),
                                            ("the sequence length counts the cached tokens too",)),
    "a sequence length without the query": ((("tl.store(seq_lens_ptr + b, num_computed + query_len)",
                                              "tl.store(seq_lens_ptr + b, num_computed)"),),
                                            ("counts this step's query too",)),
    "no mask": (((", mask=j < query_len)", ")"),), ("program 0 stored into positions[1, 2, 3]", "mask the stores")),
}


@pytest.mark.parametrize("mistake", sorted(WRONG_10_4))
def test_10_4_mistakes_are_named(mistake, tmp_path):
    edits, phrases = WRONG_10_4[mistake]
    kernel = _wrong_10_4(tmp_path, *edits)
    _assert_caught(run_check_after_setup(SOLUTION, "10.4", my_pos_seq_lens_kernel=kernel), *phrases)


def test_10_4_a_kernel_only_the_interpreter_runs_is_refused(tmp_path):
    kernel = _wrong_10_4(tmp_path, (_LOOP + "\n        tl.store(positions_ptr + start + j, (num_computed + j).to(tl.int64), "
                                    "mask=j < query_len)",
                                    "    for i in range(int(query_len)):\n        tl.store(positions_ptr + start + i, "
                                    "(num_computed + i).to(tl.int64))"))
    _assert_caught(run_check_after_setup(SOLUTION, "10.4", my_pos_seq_lens_kernel=kernel),
                   "Triton's compiler for a GPU refuses it")


def test_10_4_an_arange_over_the_query_length_is_named(tmp_path):
    kernel = _wrong_10_4(tmp_path, ("j = i + tl.arange(0, BLOCK)", "j = i + tl.arange(0, query_len)"))
    _assert_caught(run_check_after_setup(SOLUTION, "10.4", my_pos_seq_lens_kernel=kernel), "your kernel raised",
                   "use tl.arange(0, BLOCK)")


def test_10_4_a_fixed_width_instead_of_block_is_refused(tmp_path):
    kernel = _wrong_10_4(tmp_path, ("j = i + tl.arange(0, BLOCK)", "j = i + tl.arange(0, 256)"),
                         ("for i in range(0, query_len, BLOCK):", "for i in range(0, query_len, 256):"))
    _assert_caught(run_check_after_setup(SOLUTION, "10.4", my_pos_seq_lens_kernel=kernel), "more than BLOCK = 4")


def test_10_4_the_packages_kernel_called_from_the_answer_is_found_by_reading_its_calls(tmp_path):
    """Where no tripwire watches (the grading process launches a rebuilt kernel), the check reads the kernel's own
    calls: the package's kernel, under a name that came from another module, is refused before any launch."""
    from kernels.input_batch import _prepare_pos_seq_lens_kernel
    from minillm.course.exercises.ch10.input_kernel import _package_kernel_reached

    kernel = _wrong_10_4(tmp_path, ("    ### BEGIN SOLUTION\n", "    ### BEGIN SOLUTION\n    _jobs_kernel(positions_ptr, "
                                    "seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr, num_computed_tokens_ptr, "
                                    "BLOCK)\n    return\n"))
    _package_kernel_reached(kernel)   # the name is unbound: nothing of the package's is reached
    kernel.fn.__globals__["_jobs_kernel"] = _prepare_pos_seq_lens_kernel
    with pytest.raises(AssertionError, match="Exercise 10.4 asks you to write this yourself"):
        _package_kernel_reached(kernel)


def test_10_4_a_kernel_that_calls_the_packages_fails(tmp_path):
    kernel = _wrong_10_4(tmp_path, ("    ### BEGIN SOLUTION\n", "    ### BEGIN SOLUTION\n    _prepare_pos_seq_lens_kernel("
                                    "positions_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr, "
                                    "num_computed_tokens_ptr, BLOCK)\n    return\n"))
    kernel.fn.__globals__["_prepare_pos_seq_lens_kernel"] = __import__(
        "kernels.input_batch", fromlist=["x"])._prepare_pos_seq_lens_kernel
    _assert_caught(run_check_after_setup(SOLUTION, "10.4", my_pos_seq_lens_kernel=kernel),
                   "Exercise 10.4 asks you to write this yourself", "_prepare_pos_seq_lens_kernel")


def test_10_4_the_packages_kernel_under_another_name_fails():
    from kernels.input_batch import _prepare_pos_seq_lens_kernel

    _assert_caught(run_check_after_setup(SOLUTION, "10.4", my_pos_seq_lens_kernel=_prepare_pos_seq_lens_kernel),
                   "Exercise 10.4 asks you to write this yourself")


def test_10_4_a_python_function_is_refused():
    def not_a_kernel(*args, **kwargs):
        raise AssertionError("never launched")

    _assert_caught(run_check_after_setup(SOLUTION, "10.4", my_pos_seq_lens_kernel=not_a_kernel),
                   "must be a @triton.jit kernel")


def test_10_4_the_cases_have_empty_rows_long_queries_and_rows_out_of_slot_order():
    from minillm.course.exercises.ch10.input_kernel import PICTURE_SLOTS, _random_cases

    cases = _random_cases()
    lens = [np.diff(c["query_start_loc"].numpy()) for c, _ in cases]
    assert sum(int((x == 0).sum()) for x in lens) >= 5
    assert sum(int((x > block).sum()) for x, (_, block) in zip(lens, cases, strict=True)) >= 10
    assert sum(c["idx_mapping"].tolist() != sorted(c["idx_mapping"].tolist()) for c, _ in cases) >= 10
    assert PICTURE_SLOTS != sorted(PICTURE_SLOTS)


# ---------------------------------------------------------------------------------------------------------------------
# Challenge 10: reorder the persistent batch for the attention backend

def _challenge_10(**replace) -> BaseException | None:
    """Challenge 10's check after the set-up cell alone (the exercises' cells are tested above)."""
    return run_challenge(SOLUTION, 10, setup_only=True, **replace)


def _wrong_c10(*edits: tuple[str, str]):
    return mutated(SOLUTION, "C10", "reorder_batch_to_split_decodes_and_prefills", *edits, header=HEADER)


_REGIONS_LINE = ("np.where(computed == 0, 3, np.where(scheduled > decode_threshold, 2, np.where(computed < prompt, 1, "
                 "0)))")


def _regions(batch, so, threshold):
    """A learner's classification for the hand-written wrong answers below (0 decode ... 3 prefill)."""
    import numpy as np

    n = batch.num_reqs
    scheduled = np.array([so.num_scheduled_tokens[rid] for rid in batch.req_ids])
    computed, prompt = batch.num_computed_tokens_cpu[:n], batch.num_prompt_tokens[:n]
    return np.where(computed == 0, 3, np.where(scheduled > threshold, 2, np.where(computed < prompt, 1, 0)))


def ids_only(input_batch, scheduler_output, decode_threshold=1):
    """Sorts the ids (req_ids and req_id_to_index) and leaves the buffers where they were."""
    import numpy as np

    order = np.argsort(_regions(input_batch, scheduler_output, decode_threshold), kind="stable")
    ids = list(input_batch.req_ids)
    if order.tolist() == list(range(len(ids))):
        return False
    for slot, i in enumerate(order.tolist()):
        input_batch.req_ids[slot] = ids[i]
        input_batch.req_id_to_index[ids[i]] = slot
    return True


def rebuilt(input_batch, scheduler_output, decode_threshold=1):
    """Takes every request out and adds them back in region order (a state made from each slot)."""
    import numpy as np

    b = input_batch
    order = np.argsort(_regions(b, scheduler_output, decode_threshold), kind="stable")
    if order.tolist() == list(range(b.num_reqs)):
        return False
    states = []
    for i in order.tolist():
        n, k = int(b.num_tokens_no_spec[i]), int(b.block_table.num_blocks_per_row[i])
        states.append(CachedRequestState(b.req_ids[i], int(b.num_prompt_tokens[i]), None,
                                         b.token_ids_cpu[i, :n].tolist(), b.block_table.block_table[i, :k].tolist(),
                                         int(b.num_computed_tokens_cpu[i])))
    for state in states:
        b.remove_request(state.req_id)
    b.condense()
    for state in states:
        b.add_request(state)
    return True


def permuted(input_batch, scheduler_output, decode_threshold=1):
    """Permutes every buffer with one fancy index instead of swapping slots."""
    import numpy as np

    b = input_batch
    order = np.argsort(_regions(b, scheduler_output, decode_threshold), kind="stable")
    if order.tolist() == list(range(b.num_reqs)):
        return False
    n = b.num_reqs
    for buf in (b.token_ids_cpu, b.num_tokens_no_spec, b.num_prompt_tokens, b.num_computed_tokens_cpu,
                b.block_table.block_table, b.block_table.num_blocks_per_row):
        buf[:n] = buf[order]
    ids = [b.req_ids[i] for i in order.tolist()]
    b.req_ids[:] = ids
    b.req_id_to_index.update({rid: slot for slot, rid in enumerate(ids)})
    return True


def selection_sort(input_batch, scheduler_output, decode_threshold=1):
    """For each slot in turn, swaps in the first later request of the region wanted there: right order, too many
    swaps (regions [L, D, D] take two where one does)."""
    regions = _regions(input_batch, scheduler_output, decode_threshold).tolist()
    wanted, moved = sorted(regions), False
    for i in range(len(regions)):
        if regions[i] != wanted[i]:
            j = next(j for j in range(i + 1, len(regions)) if regions[j] == wanted[i])
            input_batch.swap_states(i, j)
            regions[i], regions[j] = regions[j], regions[i]
            moved = True
    return moved


WRONG_C10 = {
    "regions in the wrong order": (_wrong_c10((_REGIONS_LINE, "3 - " + _REGIONS_LINE)),
                                   ("a long extend", "after slot", "The regions go decode, short extend, long extend, "
                                    "prefill in slot order")),
    "a short extend counted as a decode": (_wrong_c10(("np.where(computed < prompt, 1, 0)", "0")),
                                           ("a decode (1 token scheduled", "a short extend",
                                            "A short extend is not a decode", "still prefilling")),
    "a long first chunk counted as a long extend": (
        _wrong_c10((_REGIONS_LINE, "np.where(scheduled > decode_threshold, 2, np.where(computed == 0, 3, "
                                   "np.where(computed < prompt, 1, 0)))")),
        ("a prefill", "A prefill is a request with nothing computed yet", "whatever its size")),
    "returns True when nothing moved": (_wrong_c10(("    if wrong.size == 0:\n        return False\n", "")),
                                        ("returned True, expected False", "already in region order",
                                         "so return False")),
    "swaps only the ids": (ids_only, ("you moved the request id but not its data", "batch.swap_states(i, j) "
                                      "exchanges two slots whole")),
    "rebuilds the batch": (rebuilt, ("called batch.add_request, batch.condense, batch.remove_request",
                                     "not by rebuilding the batch", "BatchUpdateBuilder.moved")),
    "permutes the buffers": (permuted, ("0 swap_states call(s) would leave the slots", "you moved requests some "
                                        "other way")),
    "more swaps than vLLM's loop": (selection_sort, ("called swap_states 2 times, vLLM's loop once",
                                                     "a cycle of k misplaced requests takes k - 1 swaps")),
}


def test_challenge_10_solution_passes():
    assert _challenge_10() is None


@pytest.mark.parametrize("mistake", sorted(WRONG_C10))
def test_challenge_10_mistakes_are_named(mistake):
    wrong, phrases = WRONG_C10[mistake]
    _assert_caught(_challenge_10(reorder_batch_to_split_decodes_and_prefills=wrong), "decode_threshold=",
                   "step ", *phrases)


def test_challenge_10_a_swap_through_the_class_counts_and_passes():
    wrong = _wrong_c10(("input_batch.swap_states(start, d)", "InputBatch.swap_states(input_batch, start, d)"))
    wrong.__globals__["InputBatch"] = InputBatch
    assert _challenge_10(reorder_batch_to_split_decodes_and_prefills=wrong) is None


def test_challenge_10_a_crash_names_the_step_and_the_methods_are_put_back():
    swap = InputBatch.__dict__["swap_states"]

    def crashes(input_batch, scheduler_output, decode_threshold=1):
        input_batch.swap_states(0, 0)
        raise KeyError("oops")

    _assert_caught(_challenge_10(reorder_batch_to_split_decodes_and_prefills=crashes), "step 0 of",
                   "your function raised KeyError")
    assert InputBatch.__dict__["swap_states"] is swap


@pytest.mark.parametrize("how", ["the halves", "the reference"])
def test_challenge_10_delegating_fails(how):
    from tests.course.delegating_answers import answer_cell

    answer = answer_cell("C10")
    if how == "the reference":
        answer = answer.replace("import request_regions, swap_plan",
                                "import reorder_batch_to_split_decodes_and_prefills as _ref")
        answer = answer.replace("    swaps = swap_plan(", "    return _ref(input_batch, scheduler_output, "
                                "decode_threshold)\n    swaps = swap_plan(")
    error = run_check_with_answer(SOLUTION, "10", answer, setup_only=True)
    _assert_caught(error, "Challenge 10 asks you to write this yourself",
                   "request_regions" if how == "the halves" else "reorder_batch_to_split_decodes_and_prefills")


def test_challenge_10_the_stub_fails_with_not_implemented():
    answer = exercise_source(SOLUTION, "C10")
    stubbed = re.sub(r"### BEGIN SOLUTION.*?### END SOLUTION", "raise NotImplementedError('C10')", answer, flags=re.S)
    assert isinstance(run_check_with_answer(SOLUTION, "10", stubbed, setup_only=True), NotImplementedError)


def test_challenge_10_the_runs_go_through_every_case():
    """The counts the check returns: each case a mistake above needs is there."""
    from minillm.course.exercises.challenges.ch10 import check_reorder_batch

    ns: dict = {}
    exec(compile(HEADER + exercise_source(SOLUTION, "C10"), "<C10>", "exec"), ns)  # noqa: S102
    counts = check_reorder_batch(ns["reorder_batch_to_split_decodes_and_prefills"], verbose=False)
    assert counts["steps"] >= 100 and counts["reorders"] == 2 * counts["steps"]
    for key in ("decode", "short extend", "long extend", "prefill", "reorders that moved requests",
                "batches with all four regions"):
        assert counts[key] > 0, key
    assert counts["longest cycle"] >= 3  # a 3-cycle: two swaps from one slot
    assert counts["reorders that moved requests"] < counts["reorders"]  # and batches already in order


# -- the reference on random batches (hypothesis): vLLM's rules, its loop's number of swaps ---------------------------

@st.composite
def random_batches(draw):
    """A condensed InputBatch of 1 to 7 requests with random lengths, context and blocks, and its step's plan (only
    ``num_scheduled_tokens``, all the reorder reads)."""
    n = draw(st.integers(1, 7))
    batch = InputBatch(8, 32, 4)
    scheduled = {}
    for i in range(n):
        prompt = draw(st.integers(1, 12))
        tokens = draw(st.integers(prompt, 20))
        computed = draw(st.sampled_from([0, draw(st.integers(1, tokens))]))  # a first chunk half of the time
        blocks = draw(st.lists(st.integers(1, 99), min_size=0, max_size=8))
        batch.add_request(CachedRequestState(f"r{i}", prompt, None, list(range(100 * i, 100 * i + tokens)), blocks,
                                             computed))
        scheduled[f"r{i}"] = draw(st.integers(1, 5))
    return batch, SimpleNamespace(num_scheduled_tokens=scheduled)


def _cycles_of_the_stable_assignment(regions):
    """How many cycles vLLM's loop follows: the misplaced requests, in region order, go to the misplaced slots in
    slot order (computed here with sorted(), as an independent account)."""
    wanted = sorted(regions)
    wrong = [i for i in range(len(regions)) if regions[i] != wanted[i]]
    movers = sorted(wrong, key=lambda i: (regions[i], i))
    goes_to = dict(zip(movers, wrong))
    seen, cycles = set(), 0
    for s in wrong:
        if s not in seen:
            cycles += 1
            while s not in seen:
                seen.add(s)
                s = goes_to[s]
    return len(wrong), cycles


@settings(max_examples=200, deadline=None)
@given(random_batches(), st.integers(1, 4))
def test_the_reference_sorts_by_vllms_rules_with_its_loops_swaps(case, threshold):
    from minillm.course.exercises.challenges.ch10 import (LONG_EXTEND, PREFILL, SHORT_EXTEND,
                                                   reorder_batch_to_split_decodes_and_prefills, request_regions)

    batch, so = case
    before = {rid: (batch.get_token_ids(rid).tolist(), int(batch.num_prompt_tokens[i]),
                    int(batch.num_computed_tokens_cpu[i]), batch.block_table.block_table[i].tolist())
              for rid, i in batch.req_id_to_index.items()}
    regions = request_regions(batch, so, threshold).tolist()
    for i, rid in enumerate(batch.req_ids):  # vLLM's four rules, one request at a time
        computed, n = int(batch.num_computed_tokens_cpu[i]), so.num_scheduled_tokens[rid]
        want = (PREFILL if computed == 0 else LONG_EXTEND if n > threshold
                else SHORT_EXTEND if computed < int(batch.num_prompt_tokens[i]) else 0)
        assert regions[i] == want, (rid, computed, n)
    misplaced, cycles = _cycles_of_the_stable_assignment(regions)
    slots_before = dict(batch.req_id_to_index)
    swaps = []
    real = InputBatch.swap_states
    batch.swap_states = lambda i, j: (swaps.append((i, j)), real(batch, i, j))  # this batch only
    moved = reorder_batch_to_split_decodes_and_prefills(batch, so, threshold)
    assert moved == (misplaced > 0) and len(swaps) == misplaced - cycles  # k - 1 swaps per cycle of k
    after = request_regions(batch, so, threshold).tolist()
    assert after == sorted(regions)
    for rid, i in batch.req_id_to_index.items():  # every request's data moved with it
        assert (batch.get_token_ids(rid).tolist(), int(batch.num_prompt_tokens[i]),
                int(batch.num_computed_tokens_cpu[i]), batch.block_table.block_table[i].tolist()) == before[rid]
        if regions[slots_before[rid]] == after[slots_before[rid]]:
            assert i == slots_before[rid], f"{rid} was in a slot of its region and moved"


def test_the_steps_inputs_ignore_the_slot_order_and_catch_a_changed_token():
    """ModelRunner._prepare_inputs gathers in the plan's order: swapping slots leaves the inputs as they were, and the
    check's comparison of them names what changed."""
    from minillm.course.exercises.challenges.ch10 import _inputs_problem, _step_inputs

    batch = InputBatch(4, 16, 4)
    batch.add_request(CachedRequestState("a", 3, None, [5, 6, 7, 8], [3, 4], 3))
    batch.add_request(CachedRequestState("b", 6, None, [9, 10, 11, 12, 13, 14], [7, 2], 2))
    so = SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 4}, scheduled_spec_decode_tokens={})
    want = _step_inputs(batch, so)
    assert want.input_ids.tolist() == [8, 11, 12, 13, 14]
    batch.swap_states(0, 1)
    assert _inputs_problem(batch, so, want) is None
    batch.token_ids_cpu[batch.req_id_to_index["b"], 3] = 99
    assert "the step's input_ids differ" in _inputs_problem(batch, so, want)


def test_the_reference_refuses_bad_input():
    from minillm.course.exercises.challenges.ch10 import reorder_batch_to_split_decodes_and_prefills as reorder

    batch = InputBatch(4, 16, 4)
    for i in range(3):
        batch.add_request(CachedRequestState(f"r{i}", 2, None, [1, 2], [1], 0))
    so = SimpleNamespace(num_scheduled_tokens={"r0": 2, "r1": 2, "r2": 2})
    for threshold in (0, 1.5, True, "1"):
        with pytest.raises(ValueError, match=r"decode_threshold must be an integer >= 1"):
            reorder(batch, so, threshold)
    with pytest.raises(ValueError, match=r"\['r2'\] are in the batch but not scheduled"):
        reorder(batch, SimpleNamespace(num_scheduled_tokens={"r0": 1, "r1": 1}))
    batch.remove_request("r1")
    with pytest.raises(ValueError, match=r"the batch has holes .*after condense\(\)"):
        reorder(batch, so)
    batch.condense()
    assert reorder(batch, so) is False and batch.req_ids == ["r0", "r2"]


# ---------------------------------------------------------------------------------------------------------------------
# The notebook's format

def test_the_exercises_have_a_heading_a_two_step_hint_and_a_check():
    cells = nbformat.read(ROOT / "solutions" / SOLUTION, as_version=4).cells
    found = []
    for i, cell in enumerate(cells):
        if cell.cell_type != "code" or BEGIN not in cell.source:
            continue
        m = re.match(r"# (?:Exercise (\d+\.\d+)|Challenge (\d+)):", cell.source)
        number = m.group(1) or f"C{m.group(2)}"
        heading, hint = cells[i - 2], cells[i - 1]
        if number.startswith("C"):
            h = CHALLENGE_HEADING.match(heading.source)
            assert h and h.group(1) == number[1:] and f"**挑战 {number[1:]} {h.group(2)} " in heading.source, (
                f"challenge {number}: no '### Challenge {number[1:]} ★★★ title (optional, extra credit)' two "
                f"cells above, with its Chinese statement")
            assert "vllm/v1/attention/backends/utils.py:reorder_batch_to_split_decodes_and_prefills" in heading.source
            stars = "★★★"
        else:
            h = EXERCISE_HEADING.match(heading.source)
            assert h and h.group(1) == number, f"exercise {number}: no '### Exercise {number} ★ title' above"
            stars = h.group(2)
        assert HINT_FORMAT.match(hint.source.strip()), f"exercise {number}: the hint is not two <details> steps"
        kind = "Challenge 10" if number == "C10" else f"Exercise {number}"
        assert cells[i + 1].source.startswith(f"# Check {kind}")
        # The check functions run the answer under the tripwire themselves (minillm/course/exercises/ch10, challenges/ch10).
        assert {"10.1": "check_update_states(update_states, ", "10.2": "check_placeholder_scheduler("
                "PlaceholderScheduler, ", "10.3": "check_kv_per_rank(kv_heads_of_rank, num_blocks_per_rank)",
                "10.4": "check_pos_seq_lens_kernel(my_pos_seq_lens_kernel)",
                "C10": "check_reorder_batch(reorder_batch_to_split_decodes_and_prefills, "
                }[number] in cells[i + 1].source
        found.append((number, stars))
    assert found == [("10.1", "★★"), ("10.2", "★★"), ("10.3", "★"), ("10.4", "★★"), ("C10", "★★★")]
    intro = cells[0].source
    assert re.search(r"Run time: about [\d.]+ (s|min) on a 2-core CPU", intro) and "Points: 7 " in intro
    for number, stars in found[:4]:
        assert f"**Exercise {number} {stars}**" in intro
    assert "**Challenge 10 ★★★** (extra credit)" in intro and "**挑战 10 ★★★**" in intro


ANSWER_FRAGMENTS = {"10.1": ("requests_info.pop(rid", "overwrite=False)", "req_states.replace_tokens(slot", "getsource"),
                    "10.4": ("tl.load(num_computed_tokens_ptr + slot)", "mask=j < query_len", "getsource"),
                    "10.2": ("num_output_placeholders += 1", "num_output_placeholders -= ", "getsource"),
                    "10.3": ("rank // replicas", "budget_bytes // block_bytes", "per_rank = ", "getsource"),
                    "C10": ("dest[start] = dest[d]", "goes_to[dest]", "np.argsort(regions", "getsource")}


@pytest.mark.parametrize("number", sorted(ANSWER_FRAGMENTS))
def test_no_answer_is_shown_unfolded_before_its_exercise(number):
    """Before an exercise's cell, no code cell, output or unfolded text holds its answer (the folded hints may)."""
    cells = nbformat.read(ROOT / "solutions" / SOLUTION, as_version=4).cells
    title = f"# Challenge {number[1:]}:" if number.startswith("C") else f"# Exercise {number}:"
    at = next(i for i, c in enumerate(cells) if c.cell_type == "code" and c.source.startswith(title))
    for i, cell in enumerate(cells[:at]):
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith("<details>"):
            continue
        text = cell.source + "".join(o.get("text", "") for o in cell.get("outputs", []))
        for fragment in ANSWER_FRAGMENTS[number]:
            assert fragment not in text, f"cell {i} shows {fragment!r} before exercise {number}"
