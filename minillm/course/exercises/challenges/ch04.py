"""Challenge 4's reference: admission with headroom, the KV-cache watermark.

A waiting request is admitted only if, once its blocks are taken, ``watermark_blocks = int(watermark x
num_blocks)`` blocks are still free; the headroom is left for the running requests' decodes and chunks, so that
newcomers do not fill the cache only to be preempted a step later. The watermark applies only while some request
is running (an empty engine takes its first request whatever it needs), and only to admission: the running loop
may use the headroom.

vLLM counterpart: ``vllm/config/scheduler.py:SchedulerConfig.watermark`` (v0.33.0, default 0.0: off),
``vllm/v1/core/kv_cache_manager.py:KVCacheManager.__init__`` (``watermark_blocks``) and ``allocate_slots`` (the
check, for WAITING and PREEMPTED requests when ``has_scheduled_reqs``), which
``vllm/v1/core/sched/scheduler.py:Scheduler.schedule`` calls with ``has_scheduled_reqs=bool(self.running)``. The
blocks counted are those of ``vllm/v1/core/single_type_kv_cache_manager.py:get_num_blocks_to_allocate``: new blocks,
plus the prefix-cache hits that sit in the free queue. vLLM also checks by default that the whole prompt fits
(``scheduler_reserve_full_isl=True``); this reference checks this step's allocation only, vLLM's rule with
``scheduler_reserve_full_isl=False``.
"""
from __future__ import annotations

from minillm.core.kv_cache_manager import cdiv
from minillm.core.kv_cache_utils import KVCacheBlock
from minillm.core.sched.scheduler import Scheduler, StepState
from minillm.request import Request, RequestStatus


class WatermarkScheduler(Scheduler):
    """:class:`Scheduler` whose admission keeps ``watermark`` (a fraction of all KV blocks) free."""

    watermark: float = 0.0

    def _blocks_taken(self, request: Request, num_new_tokens: int, hit_blocks: list[KVCacheBlock],
                      num_hit_tokens: int) -> int:
        """Free blocks that ``allocate_slots(request, num_new_tokens, num_hit_tokens, hit_blocks)`` would take."""
        num_new_blocks = cdiv(num_hit_tokens + num_new_tokens, self.block_size) - len(hit_blocks)
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(0, num_new_blocks) + num_evictable_hits

    def _schedule_waiting(self, step: StepState) -> None:
        """Exercise 4.2's admission, refusing a request that would leave fewer than the watermark's blocks free."""
        kv = self.kv_cache_manager
        watermark_blocks = int(self.watermark * kv.num_blocks)
        threshold = self.scheduler_config.long_prefill_token_threshold
        while self.waiting and step.token_budget > 0:
            if len(self.running) == self.max_num_running_reqs:
                break
            request = self.waiting.peek_request()
            hit_blocks, hit = kv.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - hit
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if not self.scheduler_config.enable_chunked_prefill and num_new_tokens > step.token_budget:
                break
            num_new_tokens = min(num_new_tokens, step.token_budget)
            # The headroom: only while someone runs (counting this step's admissions), as has_scheduled_reqs.
            if self.running and (self._blocks_taken(request, num_new_tokens, hit_blocks, hit) + watermark_blocks
                                 > kv.num_free_blocks):
                break
            if kv.allocate_slots(request, num_new_tokens, hit, hit_blocks) is None:
                break
            self.waiting.pop_request()
            self.running.append(request)
            if request.status == RequestStatus.WAITING:
                step.scheduled_new_reqs.append(request)
            else:
                step.scheduled_resumed_reqs.append(request)
            step.schedule(request, num_new_tokens, kv.get_block_ids(request.request_id))
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit


TARGETS = ("minillm.course.exercises.challenges.ch04:WatermarkScheduler._schedule_waiting",
           "minillm.course.exercises.challenges.ch04:WatermarkScheduler._blocks_taken",
           "minillm.core.sched.scheduler:Scheduler._schedule_waiting")
