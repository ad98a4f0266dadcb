"""The checks run the learner's answer of a case before the reference of that case, and leave no reference result
within the answer's reach.

Each test wraps the package function a check calls as its reference so that it records its calls, and the answer so
that, when it is called, it records a violation if the reference already ran for that case or if a reference result
is a local of a calling frame (a notebook global included), an argument, or an attribute of one
(:class:`tests.course.exercise_helpers.ReferenceOrder`). Covered: ``check_cases`` (on its own and through exercise 2.1's
check), exercise 6.1's check cell, the helpers of 10.1, 10.2 and 10.3, and the capstone's ``PartChecker``, whose
nine parts each run the reference after the learner's part. ``test_the_watch_catches_a_reference_first_check``
shows the watch failing on the order the checks had before (the reference first, its result kept in a local).
"""
from __future__ import annotations

import pytest
import torch

import minillm.worker.model_runner as model_runner
from minillm.course.exercises.check import check_cases
from tests.course.exercise_helpers import ReferenceOrder, case_key, exercise_source, run_check_armed


def _by_case(args, kwargs):
    return case_key((args, kwargs))


def _cases():
    g = torch.Generator().manual_seed(5)
    return [{"x": torch.randn(3, 4, generator=g), "scale": s} for s in (1.0, 2.0, 3.0, 4.0)]


# -- check_cases ------------------------------------------------------------------------------------------------------
def test_check_cases_runs_the_reference_after_the_answer_and_keeps_its_result_out_of_reach():
    order = ReferenceOrder(key=_by_case, track_results="any")
    order.arm()
    scaled = lambda x, scale: x * scale  # noqa: E731
    assert check_cases(order.answer(scaled), order.reference(scaled), _cases(), name="scaled") == 4
    order.assert_in_order(min_cases=4)
    assert len(order.references) == 4 and len(order.results) == 4


def test_check_cases_gives_the_answer_and_the_reference_their_own_copies():
    def vandal(x, scale):
        out = x * scale
        x.zero_()  # writes into its input: the reference must not see it
        return out

    cases = _cases()
    before = [c["x"].clone() for c in cases]
    check_cases(vandal, lambda x, scale: x * scale, cases, name="vandal")
    assert all(torch.equal(c["x"], b) for c, b in zip(cases, before))


def _reference_first(learner, reference, cases):
    """check_cases as it was: the reference of a case first, its result kept in a local while the answer runs."""
    for case in cases:
        want = reference(**case)
        got = learner(**case)
        assert torch.equal(got, want)


def test_the_watch_catches_a_reference_first_check():
    order = ReferenceOrder(key=_by_case, track_results="any")
    order.arm()
    scaled = lambda x, scale: x * scale  # noqa: E731
    _reference_first(order.answer(scaled), order.reference(scaled), _cases())
    with pytest.raises(AssertionError, match="the reference already ran for its case"):
        order.assert_in_order()
    assert any("'want' in _reference_first" in v for v in order.violations)


def test_a_check_cases_user_2_1(monkeypatch):
    """Exercise 2.1's check: its probes and its 200 random cases (check_cases) call compute_slot_mapping after the
    answer, and its slips (the reference on other positions) only once the probe's answer returned."""
    import minillm.attention.paged as paged

    ns: dict = {}
    source = "import torch\n" + exercise_source("02_paged_kv_cache.ipynb", "2.1")
    exec(compile(source, "<2.1>", "exec"), ns)  # noqa: S102
    order = ReferenceOrder(key=lambda args, kwargs: case_key(tuple(args) + tuple(kwargs.values())),
                           track_results="same case")

    def arm():
        monkeypatch.setattr(paged, "compute_slot_mapping", order.reference(paged.compute_slot_mapping))
        order.arm()

    assert run_check_armed("02_paged_kv_cache.ipynb", "2.1", arm,
                           my_slot_mapping=order.answer(ns["my_slot_mapping"])) is None
    order.assert_in_order(min_cases=200)


# -- chapter 6 --------------------------------------------------------------------------------------------------------
def test_6_1_prepare_inputs(monkeypatch):
    """Exercise 6.1's check: every case (2 probes, 150 random steps, the engine's recorded steps) runs the package's
    prepare_inputs after yours, and no batch the package built (the check's or the lesson's) is left where yours could
    read it."""
    order = ReferenceOrder(track_results="any")

    def arm():
        monkeypatch.setattr(model_runner, "prepare_inputs", order.reference(model_runner.prepare_inputs))
        order.arm()

    ns: dict = {}
    exec(compile("import torch, numpy as np\nfrom minillm.attention.metadata import AttentionMetadata\n"  # noqa: S102
                 "from minillm.core.sched.output import SchedulerOutput\n"
                 "from minillm.worker.model_runner import BatchInputs, CachedRequestState\n"
                 + exercise_source("06_engine.ipynb", "6.1"), "<6.1>", "exec"), ns)
    assert run_check_armed("06_engine.ipynb", "6.1", arm, my_prepare_inputs=order.answer(ns["my_prepare_inputs"])) \
        is None
    order.assert_in_order(min_cases=150)


# -- chapter 10 -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from minillm.course.exercises.ch10 import tiny_llama

    return tiny_llama()


def test_10_1_update_states(monkeypatch, tiny):
    """Every replayed step: your update_states, then the runner's own update on the reference's slots."""
    from minillm.course.exercises.ch10 import slots
    from tests.course.test_exercises_10 import HEADER, SOLUTION

    ns: dict = {}
    exec(compile(HEADER + exercise_source(SOLUTION, "10.1"), "<10.1>", "exec"), ns)  # noqa: S102
    order = ReferenceOrder()
    monkeypatch.setattr(slots.Slots, "update", order.reference(slots.Slots.update))
    order.arm()
    counts = slots.check_update_states(order.answer(ns["update_states"]), tiny, verbose=False)
    order.assert_in_order(min_cases=counts["steps"])
    assert len(order.answers) == len(order.references) == counts["steps"]


def test_10_4_pos_seq_lens_kernel(monkeypatch, tmp_path):
    """Every batch: your kernel first, then prepare_pos_seq_lens_ref."""
    from minillm.course.exercises.ch10 import input_kernel
    from tests.course.exercise_helpers import mutated
    from tests.course.test_exercises_10 import SOLUTION, TRITON_HEADER

    kernel = mutated(SOLUTION, "10.4", "my_pos_seq_lens_kernel", header=TRITON_HEADER, tmp_path=tmp_path)
    order = ReferenceOrder()
    monkeypatch.setattr(input_kernel, "_want", order.reference(input_kernel._want))
    monkeypatch.setattr(input_kernel, "_launch", order.answer(input_kernel._launch))
    order.arm()
    counts = input_kernel.check_pos_seq_lens_kernel(kernel, verbose=False)
    order.assert_in_order(min_cases=counts["cases"])


def test_10_2_placeholders(monkeypatch, tiny):
    """Each turn: your scheduler's schedule and update first, then AsyncScheduler's."""
    from minillm.core.sched.async_scheduler import AsyncScheduler
    from minillm.course.exercises.ch10 import check_placeholder_scheduler
    from tests.course.test_exercises_10 import Reference

    after_schedule, after_output = ReferenceOrder(), ReferenceOrder()

    class Watched(Reference):
        _update_after_schedule = after_schedule.answer(Reference._update_after_schedule)
        _update_request_with_output = after_output.answer(Reference._update_request_with_output)

    monkeypatch.setattr(AsyncScheduler, "_update_after_schedule",
                        after_schedule.reference(AsyncScheduler._update_after_schedule))
    monkeypatch.setattr(AsyncScheduler, "_update_request_with_output",
                        after_output.reference(AsyncScheduler._update_request_with_output))
    after_schedule.arm()
    after_output.arm()
    check_placeholder_scheduler(Watched, tiny, verbose=False)
    after_schedule.assert_in_order(min_cases=20)
    after_output.assert_in_order(min_cases=20)


def test_10_3_kv_per_rank(monkeypatch):
    """Each split: your kv_heads_of_rank, then the reference; the block counts: all of yours, then the references."""
    from minillm.course.exercises.ch10 import kv_per_rank
    from tests.course.test_exercises_10 import SOLUTION

    ns: dict = {}
    source = "from minillm.config import LlamaConfig\n" + exercise_source(SOLUTION, "10.3")
    exec(compile(source, "<10.3>", "exec"), ns)  # noqa: S102
    heads, blocks = ReferenceOrder(key=_by_case), ReferenceOrder(key=_by_case)
    monkeypatch.setattr(kv_per_rank, "reference_num_blocks", blocks.reference(kv_per_rank.reference_num_blocks))
    # reference_kv_heads also sizes the cases and names the slips: watched only as the heads' reference.
    original_heads = kv_per_rank.reference_kv_heads
    watched_heads = heads.reference(original_heads)

    def _check_heads(mine):
        monkeypatch.setattr(kv_per_rank, "reference_kv_heads", watched_heads)
        try:
            return checked_heads(mine)
        finally:
            monkeypatch.setattr(kv_per_rank, "reference_kv_heads", original_heads)

    checked_heads = kv_per_rank._check_heads
    monkeypatch.setattr(kv_per_rank, "_check_heads", _check_heads)
    heads.arm()
    blocks.arm()
    counts = kv_per_rank.check_kv_per_rank(heads.answer(ns["kv_heads_of_rank"]),
                                           blocks.answer(ns["num_blocks_per_rank"]), verbose=False)
    heads.assert_in_order(min_cases=counts["ranks"])
    blocks.assert_in_order(min_cases=counts["block cases"])


# -- the capstone -----------------------------------------------------------------------------------------------------
def test_capstone_part_checker(tiny):
    """A tiny engine whose every part is watched: each call of the learner's part comes before the reference part's
    call on the same inputs (the scheduler's schedule() included), and every part was called."""
    from minillm.attention.reference import reference_attention
    from minillm.course.exercises.capstone import PartChecker
    from minillm.engine.arg_utils import EngineArgs
    from minillm.engine.llm_engine import LLMEngine
    from minillm.engine.parts import PART_NAMES, EngineParts
    from minillm.sampling_params import SamplingParams

    package = EngineParts()
    # The reference scheduler calls the reference's KV-cache parts itself: only PartChecker's comparisons count.
    compared_in = {"_attention", "_allocate_slots", "_block_hashes", "_num_cached_tokens", "_free", "_top_k_top_p",
                   "_check_stop", "_prepare_inputs", "schedule"}
    orders = {name: ReferenceOrder(callers=compared_in) for name in PART_NAMES}
    functions = {name: getattr(package, name) for name in PART_NAMES if name != "scheduler_cls"}
    functions["attention"] = reference_attention
    learner = {name: orders[name].answer(fn) for name, fn in functions.items()}
    reference = {name: orders[name].reference(fn) for name, fn in functions.items()}

    class LearnerScheduler(package.scheduler_cls):
        schedule = orders["scheduler_cls"].answer(package.scheduler_cls.schedule)

    class ReferenceScheduler(package.scheduler_cls):
        schedule = orders["scheduler_cls"].reference(package.scheduler_cls.schedule)

    checker = PartChecker(EngineParts(**learner, scheduler_cls=LearnerScheduler),
                          EngineParts(**reference, scheduler_cls=ReferenceScheduler), guarded=False)
    engine = LLMEngine(tiny, None, EngineArgs(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=16,
                                              max_num_seqs=4, max_model_len=40, enable_prefix_caching=True),
                       parts=checker.parts())
    shared = list(range(50, 66))
    for i in range(4):
        params = (SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=i, max_tokens=12) if i % 2 else
                  SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        engine.add_request(f"r{i}", shared + [100 + i] * (3 + i), params)
    for order in orders.values():
        order.arm()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.num_preemptions >= 1 and engine.stats.num_cached_prompt_tokens > 0
    for name, order in orders.items():
        order.assert_in_order(min_cases=1)
        assert len(order.answers) == len(order.references) == checker.calls[name], name
