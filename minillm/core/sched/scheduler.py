"""The scheduler: each step, decide which requests run and how many tokens each computes.

There is no prefill or decode phase: a request needs ``num_tokens - num_computed_tokens`` more tokens. One step
serves the RUNNING requests first (each up to ``long_prefill_token_threshold`` and the budget left, preempting by
recompute when the KV cache is short), then, if nothing was preempted, admits WAITING ones in policy order while the
budget, the seats and the cache last; ``num_computed_tokens`` advances at once. The budget counts the requests
admitted in this very step. Drafts (speculative decoding) are scheduled with their request and the rejected ones
rolled back; with a KV connector a waiting request counts the tokens it can load from another engine as computed.

vLLM counterpart: ``vllm/v1/core/sched/scheduler.py`` (``Scheduler.schedule``, ``_preempt_request``,
``update_from_output``, ``finish_requests``, ``_update_from_kv_xfer_finished``); vLLM adds encoder budgets, LoRA,
structured output and asynchronous KV loads. :class:`~minillm.core.sched.async_scheduler.AsyncScheduler` is the
async-scheduling subclass.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Unpack

from minillm.config import SchedulerConfig
from minillm.core.kv_cache_manager import KVCacheFns, KVCacheManager
from minillm.core.kv_cache_utils import KVCacheBlock
from minillm.core.sched.output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from minillm.core.sched.request_queue import SchedulingPolicy, create_request_queue
from minillm.core.sched.utils import check_stop
from minillm.request import Request, RequestStatus

if TYPE_CHECKING:
    from minillm.core.sched.output import KVConnectorOutput
    from minillm.distributed.kv_transfer.base import KVConnectorBase_V1


@dataclass
class StepState:
    """The bookkeeping of one :meth:`Scheduler.schedule` call while it runs (vLLM keeps these as local variables).

    Attributes:
        token_budget: tokens still available in this step.
        num_scheduled_tokens: request id -> tokens scheduled so far in this step.
        req_to_new_block_ids: request id -> block ids to send (new blocks of a running request; all blocks of an
            admitted one).
        scheduled_running_reqs / scheduled_new_reqs / scheduled_resumed_reqs: who was scheduled, by kind.
        preempted_reqs: requests preempted in this step.
        num_external_computed_tokens: request id -> tokens a KV connector loads for it this step (chapter 9).
    """

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    req_to_new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    scheduled_running_reqs: list[Request] = field(default_factory=list)
    scheduled_new_reqs: list[Request] = field(default_factory=list)
    scheduled_resumed_reqs: list[Request] = field(default_factory=list)
    preempted_reqs: list[Request] = field(default_factory=list)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_external_computed_tokens: dict[str, int] = field(default_factory=dict)

    def schedule(self, request: Request, num_new_tokens: int, block_ids: list[int]) -> None:
        """Record ``num_new_tokens`` for ``request`` and charge them to the budget."""
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.req_to_new_block_ids[request.request_id] = block_ids
        self.token_budget -= num_new_tokens

    def unschedule(self, request: Request) -> None:
        """Undo :meth:`schedule` for a running request preempted later in the same step (priority policy)."""
        self.scheduled_running_reqs.remove(request)
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id)
        del self.req_to_new_block_ids[request.request_id]
        self.scheduled_spec_decode_tokens.pop(request.request_id, None)


class Scheduler:
    """Continuous batching with a token budget, chunked prefill, prefix caching and preemption by recompute.

    Args:
        scheduler_config: budget, seats, ``max_model_len``, chunking and policy.
        num_gpu_blocks: KV cache blocks (including the null block the block pool reserves).
        block_size: tokens per KV block.
        enable_prefix_caching: reuse full blocks whose token prefix matches.
        check_stop_fn: decides after each appended token whether a request is finished (exercise 5.3's
            signature; default: :func:`~minillm.core.sched.utils.check_stop`).
        kv_cache_fns: passed on to the :class:`KVCacheManager` (``allocate_fn``, ``block_hashes_fn``,
            ``num_cached_tokens_fn``, ``free_fn``); default: its own. Chapter 8's engine hands a learner's down
            through these two, so the scheduler never imports the engine.
    """

    def __init__(self, scheduler_config: SchedulerConfig, num_gpu_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True, *,
                 check_stop_fn: Callable[[Request, int], bool] = check_stop,
                 **kv_cache_fns: Unpack[KVCacheFns]) -> None:
        if not isinstance(scheduler_config, SchedulerConfig):
            raise ValueError(f"scheduler_config must be a SchedulerConfig, got {type(scheduler_config).__name__}")
        self.scheduler_config = scheduler_config
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.policy = SchedulingPolicy(scheduler_config.policy)
        self.block_size = block_size
        self.check_stop_fn = check_stop_fn
        self.kv_cache_manager = KVCacheManager(num_gpu_blocks, block_size, enable_caching=enable_prefix_caching,
                                               **kv_cache_fns)
        # One request of max_model_len tokens must fit alone, or it would preempt itself forever.
        if self.kv_cache_manager.num_free_blocks * block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.kv_cache_manager.num_free_blocks} usable blocks x {block_size} tokens = "
                f"{self.kv_cache_manager.num_free_blocks * block_size} tokens, fewer than max_model_len "
                f"({self.max_model_len}); raise num_gpu_blocks or lower max_model_len")

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the previous schedule(): sent once in the next SchedulerOutput so the runner frees them.
        self.finished_req_ids: set[str] = set()
        self.prev_step_scheduled_req_ids: set[str] = set()
        # Chapter 9: the scheduler side of a KV connector (set_kv_connector), finished requests whose blocks a send
        # still reads, and how many waiting requests the last schedule() skipped because their K/V had not arrived.
        self.connector: KVConnectorBase_V1 | None = None
        self.pending_kv_sends: dict[str, Request] = {}
        self._waiting_for_remote_kvs: list[Request] = []
        # The steps planned and not yet updated from, oldest first, each with the Request objects it scheduled: a
        # step's output goes to those objects, not to whatever request holds the id by then (one aborted while the
        # step ran may come back under the same id).
        self._steps_in_flight: deque[tuple[SchedulerOutput, dict[str, Request]]] = deque()

    def set_kv_connector(self, connector: KVConnectorBase_V1 | None) -> None:
        """Use ``connector``'s scheduler side (chapter 9); ``None``: none."""
        self.connector = connector
        if connector is not None:
            connector.bind_kv_cache_manager(self.kv_cache_manager)

    # -- requests in and out ------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"request {request.request_id!r}: its prompt has {request.num_tokens} tokens, which "
                             f"leaves no room for an output within max_model_len ({self.max_model_len})")
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} must be WAITING to be added, got {request.status.name}")
        self.waiting.add_request(request)
        self.requests[request.request_id] = request
        if self.connector is not None:
            self.connector.on_new_request(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests from outside (e.g. a client went away): leave the queues, free the blocks.

        Unknown or already finished ids are ignored.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        # A finished request whose K/V is still being sent is not unfinished: leave it to the send.
        requests = [self.requests[i] for i in dict.fromkeys(ids) if i in self.requests and i not in
                    self.pending_kv_sends]
        # Both queues, whatever the status says: a schedule() interrupted between moving a request to ``running``
        # and marking it RUNNING must not leave it behind in either.
        drop = {id(r) for r in requests}
        self.running = [r for r in self.running if id(r) not in drop]
        self.waiting.remove_requests(requests)
        for request in requests:
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        delay_free_blocks = False
        if self.connector is not None:
            delay_free_blocks, _ = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(request.request_id))
        self.finished_req_ids.add(request.request_id)
        if delay_free_blocks:
            self.pending_kv_sends[request.request_id] = request  # freed in _update_from_kv_xfer_finished
        else:
            self._free_blocks(request)

    def _free_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def get_request_counts(self) -> tuple[int, int]:
        """``(len(running), len(waiting))``."""
        return len(self.running), len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """Finished requests not yet sent to the runner (``finished_req_ids``, sent with the next plan), or whose
        K/V a connector still sends (vLLM v0.33.0: ``vllm/v1/core/sched/scheduler.py:Scheduler.has_finished_requests``).
        """
        return bool(self.finished_req_ids) or bool(self.pending_kv_sends)

    def has_requests(self) -> bool:
        """Unfinished or finished requests: another :meth:`schedule` has something to do, if only to tell the runner
        which requests finished (vLLM v0.33.0: ``vllm/v1/core/sched/interface.py:SchedulerInterface.has_requests``).
        """
        return self.has_unfinished_requests() or self.has_finished_requests()

    # -- one step -----------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then (if nothing was preempted) waiting ones."""
        step = StepState(token_budget=self.max_num_scheduled_tokens)
        self._schedule_running(step)
        # A preemption means the KV cache is full: admitting newcomers now would only preempt them next step.
        if not step.preempted_reqs:
            self._schedule_waiting(step)

        total_num_scheduled_tokens = sum(step.num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens
        assert step.token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs

        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData.from_request(r, step.req_to_new_block_ids[r.request_id])
                                for r in step.scheduled_new_reqs],
            scheduled_cached_reqs=self._make_cached_request_data(step),
            num_scheduled_tokens=dict(step.num_scheduled_tokens),
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            preempted_req_ids={r.request_id for r in step.preempted_reqs},
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_decode_tokens=dict(step.scheduled_spec_decode_tokens),
        )
        for new_data, request in zip(scheduler_output.scheduled_new_reqs, step.scheduled_new_reqs, strict=True):
            new_data.num_external_computed_tokens = step.num_external_computed_tokens.get(request.request_id, 0)
        if self.connector is not None:
            scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(scheduler_output)
        self._update_after_schedule(scheduler_output)
        return scheduler_output

    def _schedule_running(self, step: StepState) -> None:
        """Give each RUNNING request, in order, the tokens it needs (capped), preempting when KV runs out."""
        threshold = self.scheduler_config.long_prefill_token_threshold
        req_index = 0
        while req_index < len(self.running) and step.token_budget > 0:
            request = self.running[req_index]
            if request.num_output_placeholders and self._in_flight_step_is_its_last(request):
                req_index += 1  # async scheduling only: no further step is needed
                continue
            num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens
            num_new_tokens += request.num_output_placeholders  # async scheduling's tokens in flight (else 0)
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            num_new_tokens = min(num_new_tokens, step.token_budget)
            # Drafts must not run past max_model_len: the token sampled after the last fed position is the
            # sequence's last, so the fed positions stop at max_model_len - 2 (as in vLLM).
            num_new_tokens = min(num_new_tokens, self.max_model_len - 1 - request.num_computed_tokens)
            if num_new_tokens <= 0:
                # Async scheduling only: the steps in flight already take it to max_model_len.
                req_index += 1
                continue

            later = self.running[req_index + 1:]
            new_blocks = self._allocate_or_preempt(request, num_new_tokens, step)
            if new_blocks is None:
                # It preempted itself, so it ranked lowest of all running requests. Under FCFS it was the last one;
                # under priority the requests after it rank higher and may still fit in the blocks it just freed
                # (vLLM v0.33.0's Scheduler.schedule continues too).
                req_index = next((self.running.index(r) for r in later if r in self.running), len(self.running))
                continue
            step.scheduled_running_reqs.append(request)
            step.schedule(request, num_new_tokens, [b.block_id for b in new_blocks])
            num_scheduled_spec = request.num_computed_tokens + num_new_tokens - request.num_tokens
            if request.spec_token_ids and num_scheduled_spec > 0:
                # The budget may cut the drafts short: only the scheduled ones are verified.
                step.scheduled_spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_scheduled_spec]
            # Under the priority policy a victim may sit before this request; find where it is now.
            req_index = self.running.index(request) + 1

    @staticmethod
    def _in_flight_step_is_its_last(request: Request) -> bool:
        """Async scheduling: the step in flight samples the request's ``max_tokens``-th token (vLLM v0.33.0's
        condition in ``Scheduler.schedule``: ``num_computed_tokens + 2 - num_output_placeholders >=
        num_prompt_tokens + max_tokens``)."""
        return (request.max_tokens is not None and request.num_computed_tokens + 2 - request.num_output_placeholders
                >= request.num_prompt_tokens + request.max_tokens)

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int,
                             step: StepState) -> list[KVCacheBlock] | None:
        """Allocate KV slots for ``request``, preempting running requests until they fit.

        Returns the new blocks, or ``None`` when ``request`` itself was the victim.
        """
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks
            if self.policy is SchedulingPolicy.PRIORITY:
                victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                self.running.remove(victim)
                if victim in step.scheduled_running_reqs:
                    step.unschedule(victim)  # its tokens and blocks go back to the step
            else:
                victim = self.running.pop()
            self._preempt_request(victim)
            step.preempted_reqs.append(victim)
            if victim is request:
                return None

    def _preempt_request(self, request: Request) -> None:
        """Preempt by recompute: free the blocks, forget the K/V, queue it again in front. (Already off ``running``.)"""
        assert request.status == RequestStatus.RUNNING, f"only a running request can be preempted, got {request}"
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        # Async scheduling: the token of a step in flight for it is stale, dropped when it comes back; it is
        # recomputed after resuming.
        self._drop_in_flight_outputs(request, 0)
        request.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _schedule_waiting(self, step: StepState) -> None:
        """Admit WAITING (new or preempted) requests in policy order while budget, seats and KV cache last."""
        threshold = self.scheduler_config.long_prefill_token_threshold
        skipped: list[Request] = []  # their K/V is still on its way (KV connector): they wait, others go ahead
        while self.waiting and step.token_budget > 0:
            if len(self.running) == self.max_num_running_reqs:
                break
            request = self.waiting.peek_request()

            new_computed_blocks, num_local_computed_tokens = self.kv_cache_manager.get_computed_blocks(request)
            # Chapter 9: tokens whose K/V a KV connector loads from another engine count as computed too.
            num_external_tokens = self._get_num_external_tokens(request, num_local_computed_tokens)
            if num_external_tokens is None:  # its K/V has not arrived yet: the requests behind it go first
                self.waiting.remove_request(request)
                skipped.append(request)
                continue
            num_computed_tokens = num_local_computed_tokens + num_external_tokens
            # num_tokens, not num_prompt_tokens: a resumed request recomputes its outputs too.
            num_new_tokens = request.num_tokens - num_computed_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if not self.scheduler_config.enable_chunked_prefill and num_new_tokens > step.token_budget:
                break  # no chunking: wait for a step with room for the whole prompt
            num_new_tokens = min(num_new_tokens, step.token_budget)

            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, num_local_computed_tokens,
                                                              new_computed_blocks, num_external_tokens)
            if new_blocks is None:
                break  # the KV cache is full; requests behind it wait too (no overtaking)
            # Counted now, once: a request that waited several steps was looked up in each (as vLLM v0.33.0's
            # Scheduler.schedule: "Record at admission so unscheduled lookups are not counted").
            self.kv_cache_manager.record_prefix_cache_stats(request, num_local_computed_tokens)
            if self.connector is not None:
                request.num_computed_tokens = num_local_computed_tokens  # where the connector's load starts
                self.connector.update_state_after_alloc(request, self.kv_cache_manager.get_blocks(request.request_id),
                                                        num_external_tokens)

            self.waiting.pop_request()
            self.running.append(request)
            if request.status == RequestStatus.WAITING:
                step.scheduled_new_reqs.append(request)
            else:
                step.scheduled_resumed_reqs.append(request)
            step.schedule(request, num_new_tokens, self.kv_cache_manager.get_block_ids(request.request_id))
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:  # first admission only: a resumed request keeps its first count
                request.num_cached_tokens = num_computed_tokens
            if num_external_tokens:
                step.num_external_computed_tokens[request.request_id] = num_external_tokens
        for request in reversed(skipped):
            self.waiting.prepend_request(request)
        self._waiting_for_remote_kvs = skipped

    @property
    def num_waiting_for_remote_kvs(self) -> int:
        """Waiting requests whose K/V a KV connector has not delivered yet (chapter 9): those the latest waiting pass
        skipped for it, less any since admitted, aborted or preempted-and-requeued by a step that ran no waiting pass
        (so the count is never stale after a preempting step)."""
        return sum(1 for r in self._waiting_for_remote_kvs
                   if r.status == RequestStatus.WAITING and self.requests.get(r.request_id) is r)

    def _get_num_external_tokens(self, request: Request, num_local_computed_tokens: int) -> int | None:
        """Tokens of ``request`` a KV connector can load beyond its local prefix-cache hit (0 without a connector);
        ``None`` while the connector cannot tell yet (chapter 9). Like a prefix-cache hit, at most ``num_tokens -
        1`` tokens in all: the last token is computed for its logits."""
        if self.connector is None:
            return 0
        num_external, _ = self.connector.get_num_new_matched_tokens(request, num_local_computed_tokens)
        if num_external is None:
            return None
        return max(0, min(num_external, request.num_tokens - 1 - num_local_computed_tokens))

    def _make_cached_request_data(self, step: StepState) -> CachedRequestData:
        data = CachedRequestData()
        data.resumed_req_ids = {r.request_id for r in step.scheduled_resumed_reqs}
        for request in step.scheduled_running_reqs + step.scheduled_resumed_reqs:
            rid = request.request_id
            data.req_ids.append(rid)
            if rid not in self.prev_step_scheduled_req_ids:
                data.all_token_ids[rid] = list(request.all_token_ids)
            data.new_block_ids.append(step.req_to_new_block_ids[rid])
            data.num_computed_tokens.append(request.num_computed_tokens)
            data.num_output_tokens.append(request.num_output_tokens)
        return data

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        # Advance now, not after the model ran: the output above carries the old values (where each chunk starts),
        # and the next schedule() can already hand out the next chunk.
        scheduled = {rid: self.requests[rid] for rid in scheduler_output.num_scheduled_tokens}
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            scheduled[rid].num_computed_tokens += n
            scheduled[rid].num_in_flight_tokens += n
        if scheduled:  # a plan of 0 tokens has no output to match (and callers may drop it un-updated)
            self._steps_in_flight.append((scheduler_output, scheduled))
        self.prev_step_scheduled_req_ids = set(scheduler_output.num_scheduled_tokens)
        # A new set, not clear(): the output just built still holds the old one.
        self.finished_req_ids = set()

    # -- after the model ran ------------------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append the sampled tokens, stop finished requests and free their blocks.

        A step's output goes to the requests it scheduled: it is dropped for one that finished (or was aborted)
        since, even if its id is back as a new request, and for one moved back since (its stale output).

        Args:
            scheduler_output: what :meth:`schedule` returned for this step.
            model_runner_output: the runner's result for it (``req_id_to_index``, ``sampled_token_ids`` as one
                list of ints per row, ``kv_connector_output`` with a KV connector).

        Returns:
            One :class:`EngineCoreOutput` per request that got tokens or finished in this step.
        """
        outputs: list[EngineCoreOutput] = []
        stopped: set[int] = set()
        scheduled = self._take_step_in_flight(scheduler_output)
        kv_output = model_runner_output.kv_connector_output
        failed_loads = self._handle_kv_load_failures(kv_output, scheduler_output) if kv_output is not None else set()
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            # The Request this step scheduled (a plan not made here: whoever holds the id).
            request = scheduled.get(rid) if scheduled is not None else self.requests.get(rid)
            if request is None:
                continue
            if scheduled is not None:
                request.num_in_flight_tokens -= num_scheduled
            if request.num_stale_output_tokens:
                # Rolled back after this step was planned (preempted, or a KV load failed): its output is stale.
                request.num_stale_output_tokens = max(request.num_stale_output_tokens - num_scheduled, 0)
                continue
            if request.is_finished() or self.requests.get(rid) is not request or rid in failed_loads:
                continue  # finished or aborted while the model ran (its id may be back, as a new request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # still mid-prefill: its sampled token followed a partial prompt, so it is meaningless
            new_token_ids = list(model_runner_output.sampled_token_ids[model_runner_output.req_id_to_index[rid]])
            scheduled_spec = scheduler_output.scheduled_spec_decode_tokens.get(rid)
            if scheduled_spec:
                # The K/V of rejected drafts were written but are not part of the sequence: step back over them.
                request.num_computed_tokens -= len(scheduled_spec) + 1 - len(new_token_ids)
                request.spec_token_ids = []
            new_token_ids, finished = self._update_request_with_output(request, new_token_ids)
            reason = request.get_finished_reason() if finished else None
            if finished:
                stopped.add(id(request))
                self._free_request(request)
            if new_token_ids or finished:
                outputs.append(EngineCoreOutput(rid, new_token_ids, reason, request.stop_reason,
                                                num_cached_tokens=max(request.num_cached_tokens, 0)))
        if stopped:
            self.running = [r for r in self.running if id(r) not in stopped]
        if kv_output is not None:
            self._update_from_kv_xfer_finished(kv_output)
        return outputs

    def _take_step_in_flight(self, scheduler_output: SchedulerOutput) -> dict[str, Request] | None:
        """The requests that ``scheduler_output`` scheduled, taken off the steps in flight; ``None`` for a plan of 0
        tokens or one :meth:`schedule` did not return. Steps planned before it that were never updated from
        (abandoned after an error) are forgotten, and their tokens no longer count as in flight."""
        i = next((k for k, (plan, _) in enumerate(self._steps_in_flight) if plan is scheduler_output), None)
        if i is None:
            return None
        for _ in range(i):
            plan, abandoned = self._steps_in_flight.popleft()
            for rid, request in abandoned.items():
                n = plan.num_scheduled_tokens[rid]
                request.num_in_flight_tokens = max(request.num_in_flight_tokens - n, 0)
                request.num_stale_output_tokens = max(request.num_stale_output_tokens - n, 0)
        return self._steps_in_flight.popleft()[1]

    def _update_request_with_output(self, request: Request, new_token_ids: list[int]) -> tuple[list[int], bool]:
        """Append the step's tokens to ``request`` one by one until one stops it.

        Returns:
            ``(the tokens kept, whether it stopped)``: the tokens after a stop are dropped.
        """
        for i, token_id in enumerate(new_token_ids, 1):
            request.append_output_token_ids(token_id)
            if self.check_stop_fn(request, self.max_model_len):
                return new_token_ids[:i], True
        return new_token_ids, False

    # -- KV transfer (chapter 9) ----------------------------------------------------------------------------------
    def _update_from_kv_xfer_finished(self, kv_output: KVConnectorOutput) -> None:
        """Free the blocks of finished requests whose K/V has been sent; pass the report to the connector."""
        for rid in kv_output.finished_sending:
            request = self.pending_kv_sends.pop(rid, None)
            if request is not None:
                self._free_blocks(request)
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)

    def _handle_kv_load_failures(self, kv_output: KVConnectorOutput,
                                 scheduler_output: SchedulerOutput) -> set[str]:
        """What a KV connector failed to load this step, handled as vLLM v0.33.0 does under
        ``kv_load_failure_policy="recompute"`` (the only policy here). Returns the ids of the requests rolled back:
        their tokens of this step (and of any later step already planned) ran on K/V that was not there."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        failed = self._handle_failed_recving(kv_output.failed_recving, num_scheduled)
        # The blocks a failed whole load was to fill, and those computed from them, are rewritten in place by its
        # request; to any other request that found them in the prefix cache they are as bad as invalid blocks.
        rewritten: set[int] = set()
        first_loaded = {new.req_id: (new.num_computed_tokens - new.num_external_computed_tokens) // self.block_size
                        for new in scheduler_output.scheduled_new_reqs}
        for rid in failed:
            rewritten.update(self.kv_cache_manager.get_block_ids(rid)[first_loaded.get(rid, 0):])
        if kv_output.invalid_block_ids or rewritten:
            failed |= self._handle_invalid_blocks(kv_output.invalid_block_ids, num_scheduled, rewritten)
        return failed

    def _handle_failed_recving(self, failed_req_ids: set[str], num_scheduled_tokens: dict[str, int]) -> set[str]:
        """Requests whose whole load failed recompute from the start, keeping their blocks.

        vLLM v0.33.0's ``Scheduler._handle_failed_recving`` sets ``num_computed_tokens = 0`` for such a request
        while it is still ``WAITING_FOR_REMOTE_KVS`` (an asynchronous load). minillm loads synchronously, in the
        step that admits the request, so the request named here is already running and has sampled a token from
        the missing K/V: it goes back to 0 too (:meth:`_roll_back`) and that token is dropped. A request still
        waiting is left to the connector, which answers 0 matched tokens for it from now on (it sees
        ``failed_recving`` too).
        """
        affected: set[str] = set()
        for rid in failed_req_ids:
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING or rid not in num_scheduled_tokens:
                continue
            self._roll_back(request, 0)
            affected.add(rid)
        return affected

    def _handle_invalid_blocks(self, invalid_block_ids: set[int], num_scheduled_tokens: dict[str, int],
                               rewritten: AbstractSet[int] = frozenset()) -> set[str]:
        """A load failed to fill ``invalid_block_ids``: the running requests that count one of them as computed
        recompute it (vLLM v0.33.0's ``_update_requests_with_invalid_blocks``, for synchronous loads).

        In running order, the first request holding an invalid block goes back to that block's first token and
        recomputes from there, into the same blocks. A later request sharing one of the blocks it rewrites (through
        the prefix cache; ``rewritten`` are those a failed whole load's request rewrites) keeps counting it as
        computed, since it is rewritten in place before anyone reads it again: it only drops its tokens computed
        from the bad K/V (this step's, and under async scheduling those of the step planned after it). Under the
        recompute policy the blocks stay in the prefix cache, to be reused once recomputed (v0.33.0 evicts them
        only under ``"fail"``: "only when not using recompute policy"). Returns the ids of every affected request.
        """
        affected: set[str] = set()
        marked = set(rewritten)  # blocks that an earlier request rewrites in place
        for request in self.running:
            rid = request.request_id
            # Only the blocks computed before this step can hold loaded K/V. In flight (not stale): this step's
            # tokens, and under async scheduling the next step's (for a plan not made by schedule(): this step's).
            pending = (request.num_in_flight_tokens - request.num_stale_output_tokens if request.num_in_flight_tokens
                       else num_scheduled_tokens.get(rid, 0))
            num_computed_before = request.num_computed_tokens - pending
            block_ids = self.kv_cache_manager.get_block_ids(rid)
            computed = block_ids[:-(-num_computed_before // self.block_size)]
            bad = [i for i, block_id in enumerate(computed) if block_id in invalid_block_ids or block_id in marked]
            if not bad:
                continue
            mine = [i for i in bad if computed[i] not in marked]
            if mine:
                # E.g. blocks of 4, computed before [0, 12), bad blocks 1 and 2: recompute from token 4, rewriting
                # block 1 and every block after it.
                marked.update(block_ids[mine[0]:])
            self._roll_back(request, mine[0] * self.block_size if mine else num_computed_before)
            affected.add(rid)
        return affected

    def _roll_back(self, request: Request, num_computed_tokens: int) -> None:
        """After a failed KV load: recompute ``request`` from ``num_computed_tokens``, in the blocks it holds. The
        runner appended the token it sampled this step, now dropped: its token ids go whole in the next plan
        (``CachedRequestData.all_token_ids``)."""
        self._drop_in_flight_outputs(request, num_computed_tokens)
        self.prev_step_scheduled_req_ids.discard(request.request_id)

    @staticmethod
    def _drop_in_flight_outputs(request: Request, num_computed_tokens: int) -> None:
        """Move ``request`` back to ``num_computed_tokens`` (a preemption, a failed KV load). The outputs of the steps
        already planned for it are stale: each is dropped when it comes back (:meth:`update_from_output`), and its
        output placeholders are gone, so the next plan asks for ``num_tokens - num_computed_tokens`` tokens. vLLM
        v0.33.0 rolls back the same way (``vllm/v1/core/sched/scheduler.py`` (``Scheduler._preempt_request``,
        ``Scheduler._handle_stopped_request``): ``num_stale_output_tokens = num_in_flight_tokens``,
        ``num_output_placeholders = 0``); it still delivers a preempted request's stale tokens (unless
        ``drop_stale_output``), minillm drops them and samples them again."""
        request.num_computed_tokens = num_computed_tokens
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.spec_token_ids = []

    def update_draft_token_ids(self, model_runner_output: ModelRunnerOutput) -> None:
        """Store the drafts the runner proposed (``model_runner_output.draft_token_ids``) on their requests, to be
        verified next step. Finished or unknown requests, and requests still mid-prefill, get none."""
        drafts = model_runner_output.draft_token_ids
        if drafts is None:
            return
        for rid, draft in zip(model_runner_output.req_ids, drafts, strict=False):
            request = self.requests.get(rid)
            if request is None or request.is_finished() or request.num_computed_tokens < request.num_tokens - 1:
                continue
            request.spec_token_ids = list(draft)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block (new weights make the cached K/V stale). ``False`` while a request holds blocks;
        with ``reset_running_requests``, every running request is preempted first, so the reset succeeds, and each
        recomputes when it resumes (vLLM v0.33.0: ``vllm/v1/core/sched/scheduler.py:Scheduler.reset_prefix_cache``).

        The runner still holds those requests in its batch. The next plan resumes them, as if none had run in the step
        before: it resends their tokens, and the runner, which takes a resumed request out of its slot, adds each back
        whole."""
        if reset_running_requests:
            # Last first: each goes to the front of the waiting queue, so they come back in running order.
            while self.running:
                self._preempt_request(self.running.pop())
            self.prev_step_scheduled_req_ids = set()
        reset = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not reset:
            raise RuntimeError(f"the prefix cache could not be reset with every running request preempted: the "
                               f"finished requests {sorted(self.pending_kv_sends)} hold blocks while a connector "
                               f"sends their K/V")
        return reset
