"""Exercises 4.1-4.3 (the scheduler): every check cell catches the usual wrong answers and says why, and accepts the
solution. Each wrong answer is the solution's own code with one thing changed (``tests/exercise_helpers.mutated``).
"""
from __future__ import annotations

import pytest

from tests.exercise_helpers import caught, mutated, run_check

NB04 = "04_scheduler.ipynb"


# -- 04 ----------------------------------------------------------------------------------------------------------------
SCHED_HEADER = ("from minillm.core.kv_cache_utils import KVCacheBlock\n"
                "from minillm.core.sched.scheduler import Scheduler, StepState\n"
                "from minillm.request import Request, RequestStatus\n")


def _scheduler(exercise: str, name: str, *edits):
    return mutated(NB04, exercise, name, *edits, header=SCHED_HEADER)


def test_04_checks_accept_the_solutions():
    for exercise in ("4.1", "4.2", "4.3"):
        assert run_check(NB04, exercise) is None


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
], ids=["seats", "hit_not_subtracted", "num_computed_not_set", "hit_not_allocated", "non_chunked_rule",
        "no_budget_cap", "no_threshold", "allocation_failure_ignored", "resumed_as_new", "prompt_length",
        "status_not_running", "not_in_running"])
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


