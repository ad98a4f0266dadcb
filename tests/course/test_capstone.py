"""Chapter 8's capstone machinery: the learner's parts load from their notebooks, run as the engine on SmolLM2
through EngineParts, and every disagreement with the reference is caught and named (part, step, field)."""
from __future__ import annotations

import dataclasses
import re
import functools
from pathlib import Path

import nbformat
import pytest
import torch

from minillm.core.sched.scheduler import Scheduler
from minillm.engine.parts import PART_NAMES, EngineParts
from minillm.course.exercises.capstone import PartMismatch, check_capstone, run_requests
from minillm.course.exercises.parts import PART_SOURCES, load_learner_parts
from tests.course.delegating_answers import NOTEBOOK, answer_cell

ROOT = Path(__file__).resolve().parents[2]


run_engine = run_requests  # exercise 8.1's answer, from the package


@functools.cache
def solved_parts() -> EngineParts:
    """The parts of solutions/ (the reference answers), loaded as a learner's: wrong parts below are built on them,
    not on the package's own, which the capstone's tripwire would stop."""
    return load_learner_parts(ROOT / "solutions").engine_parts()


def waiting_first_scheduler() -> type:
    """A typical wrong scheduler: it admits waiting requests before it serves the running ones."""

    class WaitingFirstScheduler(solved_parts().scheduler_cls):
        def schedule(self):
            self._schedule_running, self._schedule_waiting = self._schedule_waiting, self._schedule_running
            try:
                return super().schedule()
            finally:
                del self._schedule_running, self._schedule_waiting

    return WaitingFirstScheduler


def free_head_first(pool, req_blocks):
    """A typical wrong free: first block first, so a request's prefix is evicted before its tail."""
    for block in req_blocks:
        block.decr_ref()
    freed = [b for b in req_blocks if b.ref_cnt == 0]
    pool.free_block_queue.prepend_n([b for b in freed if b.block_hash is None])
    pool.free_block_queue.append_n([b for b in freed if b.block_hash is not None])


def positions_from_zero(so, requests, block_size, device="cpu"):
    """A typical wrong _prepare_inputs: positions restart at 0 for every request (they must start at
    num_computed_tokens)."""
    out = solved_parts().prepare_inputs(so, requests, block_size, device)
    qsl = out.query_start_loc.tolist()
    out.positions = torch.cat([torch.arange(b - a) for a, b in zip(qsl, qsl[1:])])
    return out


def test_solutions_load_as_every_part():
    learner = load_learner_parts(ROOT / "solutions")
    assert [s.source.part for s in learner.status] == list(PART_NAMES)
    assert not learner.missing, learner.table()
    parts = learner.engine_parts()
    assert parts.replaced() == list(PART_NAMES)  # every part is the learner's, none the package's
    assert parts.scheduler_cls.__name__ == "LearnerScheduler" and issubclass(parts.scheduler_cls, Scheduler)


def test_unsolved_exercises_name_the_first_missing_part():
    learner = load_learner_parts(ROOT / "exercises")
    assert len(learner.missing) == len(PART_NAMES)
    with pytest.raises(AssertionError, match=r"part 'attention' .* Exercise 1\.1 is not solved yet"):
        learner.engine_parts()
    # Skipping chapters with the package's own parts moves the blame to the next missing one.
    with pytest.raises(AssertionError, match=r"part 'allocate_slots' .* Exercise 2\.2 is not solved yet"):
        learner.engine_parts(use_reference_for={"attention"})
    with pytest.raises(ValueError, match="unknown part"):
        learner.engine_parts(use_reference_for={"sampler"})


# The capstone with the solutions' parts (check_capstone: every part agrees with the package's on every call, the
# tokens equal transformers', the workload preempted, hit the prefix cache and chunked 2 prompts or more) is
# solutions/08_capstone.ipynb's check cell, which make test runs under nbval: not run a second time here.


@pytest.mark.slow
@pytest.mark.parametrize("part, wrong, field", [
    ("scheduler_cls", "waiting_first", "num_scheduled_tokens"),
    ("free", free_head_first, "the free queue"),
    ("prepare_inputs", positions_from_zero, "positions"),
])
def test_one_wrong_part_is_caught_and_named(model, tokenizer, part, wrong, field):
    wrong = waiting_first_scheduler() if wrong == "waiting_first" else wrong
    parts = dataclasses.replace(EngineParts(), **{part: wrong})
    with pytest.raises(PartMismatch) as info:
        check_capstone(parts, model, tokenizer, run_engine)
    assert info.value.part == part and field in info.value.field, str(info.value)
    assert f"your {part}" in str(info.value) and "step " in str(info.value)
    if part != "scheduler_cls":  # head-first freeing and positions from 0 are slips the checker explains
        assert "Likely cause:" in str(info.value), str(info.value)


@pytest.mark.slow
def test_a_wrong_run_engine_is_named(model, tokenizer):
    def reversed_order(engine, prompts, params):
        return run_engine(engine, prompts, params)[::-1]

    with pytest.raises(AssertionError, match=r"Exercise 8\.1"):
        check_capstone(EngineParts(), model, tokenizer, reversed_order)


def test_engine_parts_reject_what_is_not_a_part():
    with pytest.raises(ValueError, match="scheduler_cls must be a subclass"):
        EngineParts(scheduler_cls=object)
    with pytest.raises(ValueError, match="EngineParts.free must be a function"):
        EngineParts(free=3)
    assert EngineParts().replaced() == []
    assert EngineParts(free=free_head_first).replaced() == ["free"]


def test_missing_parts_are_listed_together_with_the_line_to_use():
    with pytest.raises(AssertionError) as info:
        load_learner_parts(ROOT / "exercises").engine_parts(use_reference_for={"attention", "free"})
    msg = str(info.value)
    assert "Also missing:" in msg and "part 'prepare_inputs'" in msg and "part 'free'" not in msg
    names = [n for n in PART_NAMES if n not in ("attention", "free")]
    assert "USE_REFERENCE_FOR = {" + ", ".join(repr(n) for n in names) + "}" in msg


# -- answers that call the package's own part --------------------------------------------------------------------------
def _learner_folder(tmp_path: Path, exercise: str) -> Path:
    """solutions/ copied to tmp_path with the answer of ``exercise`` replaced by one that delegates to the package
    (tests/course/delegating_answers.py), as a learner would hand it in."""
    import shutil

    for nb_path in (ROOT / "solutions").glob("*.ipynb"):
        shutil.copy(nb_path, tmp_path / nb_path.name)
    path = tmp_path / NOTEBOOK[exercise.split(".")[0]]
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith(f"# Exercise {exercise}:"))
    cell.source = answer_cell(exercise)
    nbformat.write(nb, path)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("exercise", sorted({n for s in PART_SOURCES for n in s.exercises} - {"1.1", "1.3"}))
def test_a_part_that_calls_the_package_fails_the_capstone(model, tokenizer, tmp_path, exercise):
    """Every exercise the capstone runs as a part: an answer that delegates to the package fails, naming the
    exercise (1.1 and 1.3 are parts of 1.2's attention through the learner's own functions: their delegation is
    caught by their own checks)."""
    learner = load_learner_parts(_learner_folder(tmp_path, exercise))
    with pytest.raises(AssertionError, match=rf"Exercise {re.escape(exercise)} asks you to write this yourself"):
        check_capstone(learner, model, tokenizer, run_engine)


@pytest.mark.slow
def test_a_run_engine_that_calls_the_package_fails_the_capstone(model, tokenizer):
    ns: dict = {}
    exec(answer_cell("8.1"), ns)  # noqa: S102
    with pytest.raises(AssertionError, match=r"Exercise 8\.1 asks you to write this yourself"):
        check_capstone(solved_parts(), model, tokenizer, ns["run_engine"])


def test_a_scheduler_that_inherits_a_method_it_must_write_fails_before_the_engine_starts():
    """A learner scheduler whose exercise-4.2 class defines nothing inherits the package's admission."""
    class AdmissionScheduler(Scheduler):
        pass

    bases = tuple(AdmissionScheduler if b.__name__ == "AdmissionScheduler" else b
                  for b in solved_parts().scheduler_cls.__bases__)
    assert AdmissionScheduler in bases
    parts = dataclasses.replace(solved_parts(), scheduler_cls=type("LearnerScheduler", bases, {}))
    with pytest.raises(AssertionError, match=r"Exercise 4\.2 asks you to write this yourself"):
        check_capstone(parts, None, None, run_engine)


# -- challenge 8: bad words ---------------------------------------------------------------------------------------------
_BAD_WORDS_TITLE = ("# Challenge 8: set to -inf, in place, the logit of every token that would complete one of a "
                    "request's bad words\n")
_SINGLE_TOKEN_SLIP = _BAD_WORDS_TITLE + """
def my_apply_bad_words(logits, bad_words_token_ids, past_tokens_ids):
    for row, words in bad_words_token_ids.items():
        past = list(past_tokens_ids[row])
        for word in words:
            if past[-(len(word) - 1):] == word[:-1]:
                logits[row, word[-1]] = float("-inf")
"""
_ANYWHERE_SLIP = _BAD_WORDS_TITLE + """
def my_apply_bad_words(logits, bad_words_token_ids, past_tokens_ids):
    for row, words in bad_words_token_ids.items():
        for word in words:
            if all(t in past_tokens_ids[row] for t in word[:-1]):
                logits[row, word[-1]] = float("-inf")
"""
_NEW_TENSOR = _BAD_WORDS_TITLE + """
def my_apply_bad_words(logits, bad_words_token_ids, past_tokens_ids):
    logits = logits.clone()
    for row, words in bad_words_token_ids.items():
        for word in words:
            if len(word) == 1 or list(past_tokens_ids[row])[-(len(word) - 1):] == word[:-1]:
                logits[row, word[-1]] = float("-inf")
    return logits
"""
_DELEGATING = _BAD_WORDS_TITLE + """
from minillm.course.exercises.challenges.ch08 import apply_bad_words as my_apply_bad_words
"""


def _cell(start: str) -> str:
    nb = nbformat.read(ROOT / "solutions" / "08_capstone.ipynb", as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith(start))


@pytest.fixture(scope="module")
def chapter_8_setup(smollm) -> dict:
    """The namespace of chapter 8's set-up cell, with the session's SmolLM2 as the model it loads."""
    import minillm

    ns: dict = {"__name__": "__main__"}
    setup = "\n".join(line for line in _cell("# Environment set-up").splitlines() if not line.startswith("%"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(minillm, "load_model", lambda *a, **k: smollm)
        exec(setup, ns)  # noqa: S102
    return ns


def _challenge_8_check(setup: dict, answer: str) -> BaseException | None:
    ns = dict(setup)
    exec(answer, ns)  # noqa: S102
    try:
        exec(_cell("# Check Challenge 8"), ns)  # noqa: S102
    except AssertionError as e:
        return e
    return None


@pytest.mark.slow
@pytest.mark.parametrize("answer, why", [
    (_SINGLE_TOKEN_SLIP, "past[-0:] is the whole list"),
    (_ANYWHERE_SLIP, "compare the LAST len(word) - 1 outputs"),
    (_NEW_TENSOR, "returned a new tensor and left logits unchanged"),
    (_DELEGATING, "Challenge 8 asks you to write this yourself"),
], ids=["one_token_word", "prefix_anywhere", "not_in_place", "delegating"])
def test_challenge_8_catches_the_usual_slips_and_a_delegating_answer(chapter_8_setup, answer, why):
    error = _challenge_8_check(chapter_8_setup, answer)
    assert isinstance(error, AssertionError) and why in str(error), repr(error)


@pytest.mark.slow
def test_challenge_8_accepts_the_solution(chapter_8_setup):
    assert _challenge_8_check(chapter_8_setup, _cell("# Challenge 8:")) is None
