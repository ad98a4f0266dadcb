"""Async scheduling: plan step N+1 while step N still runs.

Step N+1 must ask for the token step N is still sampling: an **output placeholder**. Scheduling a step that samples
adds one to a request's ``num_output_placeholders``, its token coming back takes one off, so meanwhile the request
asks for ``num_tokens + num_output_placeholders - num_computed_tokens = 1`` token, whose input id the worker has
appended itself by then. A request whose step in flight samples its last token is not scheduled again; a step's
output for a request that already finished is dropped; a request rolled back with a step in flight drops that
step's tokens as stale (``Request.num_stale_output_tokens``) and samples them again.

vLLM counterpart: ``vllm/v1/core/sched/async_scheduler.py:AsyncScheduler._update_after_schedule``, with the
placeholder terms of ``Scheduler.schedule`` in ``vllm/v1/core/sched/scheduler.py``; v0.33.0 delivers a preempted
request's stale tokens instead, and runs drafts under async scheduling (minillm's n-gram drafts, like its V1 runner's,
cannot).
"""
from __future__ import annotations

from minillm.core.sched.output import SchedulerOutput
from minillm.core.sched.scheduler import Scheduler
from minillm.request import Request, RequestStatus


class AsyncScheduler(Scheduler):
    """The scheduler of async scheduling: counts the tokens of steps in flight as output placeholders."""

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests[rid]
            if request.num_computed_tokens < request.num_tokens + request.num_output_placeholders:
                continue  # a prefill chunk that stops short of the prompt's end samples nothing
            request.num_output_placeholders += 1

    def _update_request_with_output(self, request: Request, new_token_ids: list[int]) -> tuple[list[int], bool]:
        was_running = request.status == RequestStatus.RUNNING
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids)
        request.num_output_placeholders -= len(new_token_ids)
        assert request.num_output_placeholders >= 0, request
        if was_running and not stopped and self.kv_cache_manager.enable_caching:
            # The blocks the new tokens filled can now be registered in the prefix cache: their token ids are
            # known (allocate_slots could only register the blocks of known tokens).
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens - request.num_output_placeholders)
        return new_token_ids, stopped
