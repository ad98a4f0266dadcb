"""Exercises 4.1-4.3 (the scheduler): every check cell catches the usual wrong answers and says why, and accepts the
solution. Each wrong answer is the solution's own code with one thing changed (``tests/exercise_helpers.mutated``).
An answer that calls the package's own method (``super()._schedule_waiting(step)``) fails every check, and so does
one that inherits it. Challenge 4 (admission with a KV-cache watermark) names the usual slips.

That every check accepts the solution is nbval's to check: ``make test`` runs ``solutions/04_scheduler.ipynb`` top to
bottom, every check cell included, and compares the stored "Challenge 4 passed: ..." line (about 30 s of one core,
not repeated here).
"""
from __future__ import annotations

import re
import types
from pathlib import Path

import nbformat
import pytest

from tests.course.exercise_helpers import ROOT, caught, mutated, run_challenge, run_check

NB04 = "04_scheduler.ipynb"


# -- 04 ----------------------------------------------------------------------------------------------------------------
SCHED_HEADER = ("from minillm.core.kv_cache_utils import KVCacheBlock\n"
                "from minillm.core.sched.scheduler import Scheduler, StepState\n"
                "from minillm.request import Request, RequestStatus\n")


def _in_main(cls):
    """A learner's class is defined in the kernel's ``__main__``: give a class exec'd here (whose methods' module is
    None) that module too, as the notebook would."""
    for value in vars(cls).values():
        if isinstance(value, types.FunctionType) and value.__module__ is None:
            value.__module__ = "__main__"
    return cls


def _scheduler(exercise: str, name: str, *edits):
    return _in_main(mutated(NB04, exercise, name, *edits, header=SCHED_HEADER))




@pytest.mark.parametrize("edits, why", [
    ([("            num_new_tokens = min(num_new_tokens, step.token_budget)\n", "")],
     "cap n by step.token_budget"),
    ([("            if 0 < threshold < num_new_tokens:\n                num_new_tokens = threshold\n", "")],
     "cap each request's tokens by long_prefill_token_threshold"),
    ([("                continue\n", "                break\n")], "Go on with the requests after it (continue)"),
    ([("                req_index = next((self.running.index(r) for r in later if r in self.running), "
       "len(self.running))\n", "")], "rN was skipped after rR preempted itself"),
    ([("req_index = self.running.index(request) + 1", "req_index += 1")],
     "the next request is at self.running.index(request) + 1"),
    ([("while req_index < len(self.running) and step.token_budget > 0:", "while req_index < len(self.running):")],
     "you scheduled r1 with 0 tokens"),
    ([("            step.scheduled_running_reqs.append(request)\n", "")], "step.scheduled_running_reqs"),
], ids=["no_budget_cap", "no_threshold", "stops_after_self_preemption", "stale_index_after_self_preemption",
         "index_not_found_again",
        "budget_spent_not_stopping", "not_recorded"])
def test_4_1_running_loop_mistakes(edits, why):
    assert why in caught(NB04, "4.1", RunningLoopScheduler=_scheduler("4.1", "RunningLoopScheduler", *edits))


# Kept wrong answers of 4.2 from a learner's walkthrough: the step records only allocate_slots' new blocks;
# num_computed_tokens set to the hit before allocate_slots (which adds the hit on top: 10 blocks for 6); the head
# popped first and put back only when the allocation fails (lost when chunked prefill is off), or put back at the tail.
NEW_BLOCK_IDS_ONLY = [
    ("            if self.kv_cache_manager.allocate_slots(request, num_new_tokens, hit, hit_blocks) is None:\n",
     "            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, hit, hit_blocks)\n"
     "            if new_blocks is None:\n"),
    ("self.kv_cache_manager.get_block_ids(request.request_id))", "[b.block_id for b in new_blocks])")]
COMPUTED_SET_BEFORE_ALLOCATION = [
    ("            request.num_computed_tokens = hit\n", ""),
    ("            if self.kv_cache_manager.allocate_slots(",
     "            request.num_computed_tokens = hit\n            if self.kv_cache_manager.allocate_slots(")]
_POP_FIRST = [("request = self.waiting.peek_request()", "request = self.waiting.pop_request()"),
              ("            self.waiting.pop_request()\n", "")]
_BACK_ON_ALLOCATION_FAILURE = ("hit, hit_blocks) is None:\n                break\n",
                               "hit, hit_blocks) is None:\n                self.waiting.prepend_request(request)\n"
                               "                break\n")
_BACK_WHEN_UNCHUNKED = ("and num_new_tokens > step.token_budget:\n                break\n",
                        "and num_new_tokens > step.token_budget:\n                self.waiting.prepend_request(request)\n"
                        "                break\n")
POPPED_BACK_ONLY_ON_ALLOCATION_FAILURE = [*_POP_FIRST, _BACK_ON_ALLOCATION_FAILURE]
POPPED_BACK_AT_THE_TAIL = [*_POP_FIRST, *((old, new.replace("prepend_request", "add_request"))
                                          for old, new in (_BACK_ON_ALLOCATION_FAILURE, _BACK_WHEN_UNCHUNKED))]


def test_4_2_popping_first_and_putting_back_on_every_refusal_is_accepted():
    """What the diagnosis of a lost head recommends is right: pop first, prepend_request on each refusal."""
    right = _scheduler("4.2", "AdmissionScheduler", *_POP_FIRST, _BACK_ON_ALLOCATION_FAILURE, _BACK_WHEN_UNCHUNKED)
    assert run_check(NB04, "4.2", AdmissionScheduler=right) is None


@pytest.mark.parametrize("edits, why", [
    ([("            if len(self.running) == self.max_num_running_reqs:\n                break\n", "")],
     "both seats were taken"),
    ([("num_new_tokens = request.num_tokens - hit", "num_new_tokens = request.num_tokens")],
     "num_tokens - hit = 22 - 16 = 6"),
    ([("            request.num_computed_tokens = hit\n", "")], "set request.num_computed_tokens to the hit (16)"),
    ([("allocate_slots(request, num_new_tokens, hit, hit_blocks)", "allocate_slots(request, num_new_tokens)")],
     "pass the hit to the allocation"),
    ([("            if not self.scheduler_config.enable_chunked_prefill and num_new_tokens > step.token_budget:\n"
       "                break\n", "")], "with chunked prefill off a prompt is never split"),
    ([("            num_new_tokens = min(num_new_tokens, step.token_budget)\n", "")], "cap n by the budget left"),
    ([("            if 0 < threshold < num_new_tokens:\n                num_new_tokens = threshold\n", "")],
     "long_prefill_token_threshold"),
    ([("            if self.kv_cache_manager.allocate_slots(request, num_new_tokens, hit, hit_blocks) is None:\n"
       "                break\n", "            self.kv_cache_manager.allocate_slots(request, num_new_tokens, hit, "
                                 "hit_blocks)\n")], "allocate_slots returned None"),
    ([("            if request.status == RequestStatus.WAITING:\n                step.scheduled_new_reqs.append(request)"
       "\n            else:\n                step.scheduled_resumed_reqs.append(request)\n",
       "            step.scheduled_new_reqs.append(request)\n")], "step.scheduled_resumed_reqs"),
    ([("num_new_tokens = request.num_tokens - hit", "num_new_tokens = request.num_prompt_tokens - hit")],
     "a resumed request recomputes its outputs too"),
    ([("            request.status = RequestStatus.RUNNING\n", "")], "status to RequestStatus.RUNNING"),
    ([("            self.running.append(request)\n", "")], "append each admitted request to self.running"),
    # The learner's walkthrough (issue 24): three mistakes that got a wrong diagnosis, or none.
    (NEW_BLOCK_IDS_ONLY, "the step records only some of their ids: step.schedule(request, n, block_ids) takes all "
                         "the request's block ids, its 4 shared hit blocks included"),
    (COMPUTED_SET_BEFORE_ALLOCATION, "allocate_slots counts the hit you pass it (num_new_computed_tokens) on top of "
                                     "request.num_computed_tokens"),
    (POPPED_BACK_ONLY_ON_ALLOCATION_FAILURE, "r0 was refused (with chunked prefill off its 20 tokens do not fit the 10 "
                                             "left), but it is gone from the waiting queue"),
    (POPPED_BACK_AT_THE_TAIL, "it is no longer at the head of the waiting queue: add_request queues it behind"),
], ids=["seats", "hit_not_subtracted", "num_computed_not_set", "hit_not_allocated", "non_chunked_rule",
        "no_budget_cap", "no_threshold", "allocation_failure_ignored", "resumed_as_new", "prompt_length",
        "status_not_running", "not_in_running", "new_block_ids_only", "num_computed_before_allocation",
        "popped_back_only_on_allocation_failure", "popped_back_at_the_tail"])
def test_4_2_admission_mistakes(edits, why):
    assert why in caught(NB04, "4.2", AdmissionScheduler=_scheduler("4.2", "AdmissionScheduler", *edits))


@pytest.mark.parametrize("edits, why", [
    ([("self.waiting.prepend_request(request)", "self.waiting.add_request(request)")],
     "you appended the victim to the waiting queue"),
    ([("        request.num_computed_tokens = 0\n", "")], "reset num_computed_tokens to 0"),
    ([("        self.kv_cache_manager.free(request)\n", "")], "free the victim's blocks"),
    ([("        self.kv_cache_manager.free(request)\n",
       "        self.kv_cache_manager.block_pool.free_blocks(self.kv_cache_manager.req_to_blocks.pop("
       "request.request_id))\n")], "the freed blocks went back in another order"),
    ([("        request.num_preemptions += 1\n", "")], "count the preemption"),
    ([("        request.status = RequestStatus.PREEMPTED\n", "")], "status to RequestStatus.PREEMPTED"),
    ([("            victim = self.running.pop()\n",
       "            victim = request if request in self.running else self.running[-1]\n"
       "            self.running.remove(victim)\n")], "you preempted r1, the request asking for blocks, first"),
    ([("            victim = self.running.pop()\n", "            victim = self.running.pop(0)\n")],
     "you preempted r0, the first running request"),
    pytest.param([("            victim = self.running.pop()\n",
                   "            victim = self.waiting.pop_request() if self.waiting else self.running.pop()\n"
                   "            victim.status = RequestStatus.RUNNING\n")], "a waiting request holds none",
                 marks=pytest.mark.slow),  # an endless loop, stopped after 5 s
    ([("            step.preempted_reqs.append(victim)\n", "")], "append each victim to step.preempted_reqs"),
    ([("        while True:\n", "        for _ in range(2):\n")], "keep preempting the last running request"),
    ([("            if victim is request:\n                return None\n", "")], "return None, so that the running"),
], ids=["appended_not_prepended", "num_computed_not_reset", "not_freed", "freed_head_first", "not_counted",
        "status_not_preempted", "request_itself_first", "oldest_first", "waiting_request", "not_recorded",
        "one_victim_only", "no_none_on_self_preemption"])
def test_4_3_preemption_mistakes(edits, why):
    assert why in caught(NB04, "4.3", FCFSPreemptionScheduler=_scheduler("4.3", "FCFSPreemptionScheduler", *edits))




def test_4_1_a_loop_over_a_copy_of_running_is_told_that_it_scheduled_the_victim():
    """`for request in list(self.running)` still visits a victim that comes after the current request."""
    wrong = _scheduler("4.1", "RunningLoopScheduler",
                       ("        req_index = 0\n        while req_index < len(self.running) and step.token_budget > 0:\n"
                        "            request = self.running[req_index]\n",
                        "        for request in list(self.running):\n            if step.token_budget <= 0:\n"
                        "                break\n"),
                       ("            later = self.running[req_index + 1:]\n", ""),
                       ("                req_index = next((self.running.index(r) for r in later if r in self.running), "
                        "len(self.running))\n", ""),
                       ("            req_index = self.running.index(request) + 1\n", ""))
    why = caught(NB04, "4.1", RunningLoopScheduler=wrong)
    assert "you scheduled r2 after r0's allocation had preempted it" in why and "for request in list(self.running)" in why
    assert "scheduled_running_reqs" not in why.split("\n")[0]


# -- delegating answers: the package's own method raises while the learner's class runs -------------------------------
DELEGATING_04 = {
    "4.1": ("RunningLoopScheduler", """
class RunningLoopScheduler(Scheduler):
    def _schedule_running(self, step):
        return super()._schedule_running(step)
"""),
    "4.2": ("AdmissionScheduler", """
class AdmissionScheduler(Scheduler):
    def _schedule_waiting(self, step):
        return super()._schedule_waiting(step)
"""),
    "4.3": ("FCFSPreemptionScheduler", """
class FCFSPreemptionScheduler(Scheduler):
    def _preempt_request(self, request):
        return super()._preempt_request(request)

    def _allocate_or_preempt(self, request, num_new_tokens, step):
        return super()._allocate_or_preempt(request, num_new_tokens, step)
"""),
}


def _defined(source: str, name: str):
    ns: dict = {"__name__": "__main__"}
    exec(compile(SCHED_HEADER + source, "<delegating answer>", "exec"), ns)  # noqa: S102
    return ns[name]


@pytest.mark.parametrize("exercise", ["4.1", "4.2", "4.3"])
def test_4_x_an_answer_that_calls_super_fails(exercise):
    name, source = DELEGATING_04[exercise]
    assert "asks you to write this yourself" in caught(NB04, exercise, **{name: _defined(source, name)})


def test_4_x_a_class_that_inherits_the_method_fails():
    for exercise, (name, _) in DELEGATING_04.items():
        inherits = _defined(f"class {name}(Scheduler):\n    pass\n", name)
        assert "asks you to write this yourself" in caught(NB04, exercise, **{name: inherits})


@pytest.mark.parametrize("delegated", ["_preempt_request", "_allocate_or_preempt"])
def test_4_3_delegating_one_of_its_two_methods_fails(delegated):
    """The solution's own code for one method, super() for the other: each of the two is the exercise."""
    own = _scheduler("4.3", "FCFSPreemptionScheduler")
    args = {"_preempt_request": "request", "_allocate_or_preempt": "request, num_new_tokens, step"}[delegated]
    source = (f"class FCFSPreemptionScheduler(Own):\n    def {delegated}(self, {args}):\n"
              f"        return super(Own, self).{delegated}({args})\n")
    ns: dict = {"Own": own, "__name__": "__main__"}
    exec(compile(source, "<half delegating>", "exec"), ns)  # noqa: S102
    assert "asks you to write this yourself" in caught(NB04, "4.3", FCFSPreemptionScheduler=ns["FCFSPreemptionScheduler"])


# -- Challenge 4: admission with a KV-cache watermark ---------------------------------------------------------------
def _challenge_answer(*edits):
    """The solution's WatermarkScheduler with each (old, new) edit applied once."""
    nb = nbformat.read(ROOT / "solutions" / NB04, as_version=4)
    source = next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("# Challenge 4:"))
    for old, new in edits:
        assert source.count(old) == 1, f"edit {old!r} does not apply once to challenge 4"
        source = source.replace(old, new)
    return _defined(source, "WatermarkScheduler")




def test_challenge_4_delegating_answers_fail():
    calls_super = _defined("class WatermarkScheduler(Scheduler):\n    watermark = 0.0\n\n"
                           "    def _schedule_waiting(self, step):\n        return super()._schedule_waiting(step)\n",
                           "WatermarkScheduler")
    calls_reference = _defined("from minillm.course.exercises.challenges.ch04 import WatermarkScheduler as _W\n\n\n"
                               "class WatermarkScheduler(Scheduler):\n    watermark = 0.0\n\n"
                               "    def _schedule_waiting(self, step):\n        return _W._schedule_waiting(self, step)\n",
                               "WatermarkScheduler")
    for answer in (calls_super, calls_reference):
        e = run_challenge(NB04, 4, WatermarkScheduler=answer)
        assert isinstance(e, AssertionError) and "Challenge 4 asks you to write this yourself" in str(e), e


@pytest.mark.parametrize("edits, why", [
    ([("                if num_new_blocks + num_evictable_hits + watermark_blocks > kv.num_free_blocks:\n"
       "                    break\n", "")],
     "would leave 2, fewer than the watermark's int(0.1 x 40) = 4 blocks: your _schedule_waiting applies no watermark"),
    ([("int(self.watermark * kv.num_blocks)", "int(self.watermark * kv.num_free_blocks)")],
     "a fraction of all the cache's blocks (self.kv_cache_manager.num_blocks), not of the free ones"),
    ([("+ watermark_blocks > kv.num_free_blocks", "+ watermark_blocks >= kv.num_free_blocks")],
     "leaves exactly the watermark's int(0.1 x 40) = 4 blocks: that is allowed"),
    ([("int(self.watermark * kv.num_blocks)", "int(self.watermark * (kv.num_blocks - 1))")],
     "the null block included"),
    ([("int(self.watermark * kv.num_blocks)", "int(-(-(self.watermark * kv.num_blocks) // 1))")], "round down"),
    ([("            if self.running:\n", "            if True:\n")], "an empty engine takes its first request"),
    ([("        while self.waiting and step.token_budget > 0:\n",
       "        anyone_running = bool(self.running)\n        while self.waiting and step.token_budget > 0:\n"),
      ("            if self.running:\n", "            if anyone_running:\n")],
     "Test self.running for each request, not once before the loop"),
    ([("sum(1 for b in hit_blocks if b.ref_cnt == 0)", "0")], "r1's 4 hit blocks are cached but held by nobody"),
    ([("sum(1 for b in hit_blocks if b.ref_cnt == 0)", "len(hit_blocks)")], "r1's 4 hit blocks are held by rc"),
], ids=["no_watermark", "fraction_of_free", "refuses_at_exactly_w", "usable_blocks", "rounds_up", "empty_engine",
        "tested_once", "evictable_hits_free", "shared_hits_counted"])
def test_challenge_4_mistakes(edits, why):
    e = run_challenge(NB04, 4, WatermarkScheduler=_challenge_answer(*edits))
    assert isinstance(e, AssertionError) and why in str(e), e


def test_challenge_4_an_inherited_4_2_admission_is_told_it_applies_no_watermark():
    """A WatermarkScheduler that only inherits exercise 4.2's admission (the learner's own class, so the tripwire
    lets it run) is told that it applies no watermark, not that W is computed from the wrong block count."""
    admission = _scheduler("4.2", "AdmissionScheduler")
    inherits = type("WatermarkScheduler", (admission,), {"watermark": 0.0})
    e = run_challenge(NB04, 4, WatermarkScheduler=inherits)
    assert isinstance(e, AssertionError) and "your _schedule_waiting applies no watermark" in str(e), e
    assert "not of the free ones" not in str(e), e


@pytest.mark.parametrize("exercise, name, edit, why", [
    ("4.1", "RunningLoopScheduler", ("step.schedule(request, num_new_tokens, [b.block_id for b in new_blocks])",
                                     "step.schedule(request, num_new_tokens, new_blocks)"),
     "recorded r0's blocks as KVCacheBlock objects"),
    ("4.2", "AdmissionScheduler", ("self.kv_cache_manager.get_block_ids(request.request_id))",
                                   "self.kv_cache_manager.get_blocks(request.request_id))"),
     "step.schedule(request, n, block_ids) takes block ids, ints"),
    ("4.3", "FCFSPreemptionScheduler", ("                return new_blocks\n",
                                        "                return [b.block_id for b in new_blocks]\n"),
     "return the list of new KVCacheBlock objects allocate_slots gave"),
], ids=["4.1_blocks_for_ids", "4.2_blocks_for_ids", "4.3_ids_for_blocks"])
def test_4_x_type_mistakes_are_named(exercise, name, edit, why):
    assert why in caught(NB04, exercise, **{name: _scheduler(exercise, name, edit)})


# -- lesson 04: no exercise's lines before the fold ---------------------------------------------------------------
# Lines of the reference loops that are exercises 4.1 and 4.2 (a learner's walkthrough found them listed in an open
# evidence cell of the lesson, before the exercise).
SOLUTION_LINES_04 = ["while req_index < len(self.running) and step.token_budget > 0:",
                     "if 0 < threshold < num_new_tokens:",
                     "num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens",
                     "self._allocate_or_preempt(request, num_new_tokens, step)",
                     "while self.waiting and step.token_budget > 0:",
                     "request = self.waiting.peek_request()",
                     "self.kv_cache_manager.get_computed_blocks(request)",
                     "num_new_tokens = request.num_tokens - num_computed_tokens",
                     "self.waiting.pop_request()",
                     "self.running.append(request)"]


def _unfolded(text: str) -> str:
    """`text` without its <details>...</details> blocks."""
    return re.sub(r"<details>.*?</details>", "", text, flags=re.S)


def _open_text_of_lesson(path: Path) -> list[tuple[str, str]]:
    """(cell id, text) for what a reader of lesson 04 sees unfolded: code cells' sources and outputs, markdown."""
    shown = []
    for cell in nbformat.read(path, as_version=4).cells:
        shown.append((cell.get("id"), cell.source if cell.cell_type == "code" else _unfolded(cell.source)))
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            text = out.get("text", "") + data.get("text/plain", "") + data.get("text/html", "")
            shown.append((cell.get("id"), _unfolded(text)))
    return shown


def lesson_04_solution_lines(path: Path = ROOT / "notebooks" / NB04) -> list[tuple[str, str]]:
    return [(cid, line) for cid, text in _open_text_of_lesson(path) for line in SOLUTION_LINES_04 if line in text]


def test_lesson_04_shows_no_line_of_exercises_4_1_and_4_2_unfolded():
    assert lesson_04_solution_lines() == []


def test_the_lesson_check_finds_an_open_listing(tmp_path):
    """The test above can fail: an open code cell that lists a loop's lines is found."""
    nb = nbformat.read(ROOT / "notebooks" / NB04, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell('order = ["while self.waiting and step.token_budget > 0:"]'))
    nb.cells.append(nbformat.v4.new_markdown_cell("- `self.running.append(request)` admits it"))
    nbformat.write(nb, tmp_path / NB04)
    assert [line for _, line in lesson_04_solution_lines(tmp_path / NB04)] == [
        "while self.waiting and step.token_budget > 0:", "self.running.append(request)"]
