"""Async scheduling: plan step N+1 while step N still runs.

With the synchronous :class:`~minillm.core.sched.scheduler.Scheduler` the engine core does, one after another:
schedule, run the model, update from its output, and only then schedule again, so the CPU work of scheduling (and of
sending the outputs) adds to every step's time while the model waits. The engine core's batch queue
(``EngineCore.step_with_batch_queue``) instead schedules step N+1 as soon as step N has been handed to the executor.
Step N+1 must then ask for a token it does not know yet: the one step N is sampling.

That token is an **output placeholder**. After scheduling a step that samples (a decode, or the last chunk of a
prefill), a request's ``num_output_placeholders`` grows by one; when the token comes back it shrinks by one. So
between the two, ``num_computed_tokens`` is one ahead of ``num_tokens``, and the running request asks for

.. math::  \\text{num\\_new\\_tokens} = \\text{num\\_tokens} + \\text{num\\_output\\_placeholders} -
           \\text{num\\_computed\\_tokens} = 1

(the placeholder's position), whose input id the worker already has when step N+1 runs: it appended step N's sampled
token itself, and one executor thread runs the steps in order. Three consequences, each handled here or in the base
scheduler:

* a request whose step in flight samples its ``max_tokens``-th token is not scheduled again;
* a request that finishes on a token (EOS, a stop id) has already been scheduled once more: that step's output for it
  arrives after it finished, and is dropped (the scheduler no longer knows it);
* a request rolled back while a step is in flight for it (preempted, or a KV load it counted on failed) loses that
  step's token: its placeholders go back to 0, the in-flight tokens become stale output
  (``Request.num_stale_output_tokens``) that ``update_from_output`` drops when it comes back, and it samples them
  again after recomputing (``Scheduler._drop_in_flight_outputs``).

vLLM counterpart: ``vllm/v1/core/sched/async_scheduler.py:AsyncScheduler._update_after_schedule``, and in
``vllm/v1/core/sched/scheduler.py`` the placeholder terms of ``Scheduler.schedule`` and
``Scheduler._update_request_with_output`` (v0.33.0 decrements the placeholders in the base class). vLLM v0.33.0
delivers a preempted request's stale tokens (to keep draft acceptance unperturbed) and supports drafts under async
scheduling; minillm's n-gram drafts are, as in vLLM's V1 runner, incompatible with it.
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
