"""A real-model runner for the scheduler, as simple as it can be: one request at a time, each with its own cache.

For each request in a :class:`SchedulerOutput` it runs exactly the scheduled chunk (``num_scheduled_tokens`` tokens
starting at ``num_computed_tokens``) through SmolLM2 with a per-request :class:`ContiguousKVCache`, and samples
greedily when the chunk completes the request's tokens. So the schedule's cost on the real model can be measured:
a step's time grows with the tokens scheduled in it, and a decode that shares its step with a long prefill chunk
waits for that chunk.

What it does not do (chapter 6 does): batch all requests into one forward pass over a paged KV cache. Here the
requests of one step run one after the other, and prefix-cache hits are refused (a contiguous cache cannot borrow
another request's blocks), so run the scheduler with ``enable_prefix_caching=False``.

vLLM counterpart: ``vllm/v1/worker/gpu_model_runner.py`` (``GPUModelRunner.execute_model``), much simplified.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minillm.attention.contiguous import ContiguousKVCache
from minillm.config import SchedulerConfig
from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from minillm.core.sched.scheduler import Scheduler
from minillm.model.llama import LlamaForCausalLM
from minillm.request import Request
from minillm.sampling_params import SamplingParams


@dataclass
class _State:
    token_ids: list[int]
    num_computed_tokens: int
    cache: ContiguousKVCache


class SimpleModelRunner:
    """Runs a :class:`SchedulerOutput` on the real model, request by request, greedy sampling.

    Args:
        model: the model (e.g. from :func:`minillm.load_model`).

    Attributes:
        last_step_seconds: wall time of the latest :meth:`execute_model`.
    """

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.requests: dict[str, _State] = {}
        self.last_step_seconds = 0.0

    def _new_state(self, req_id: str, token_ids: list[int], num_computed_tokens: int) -> _State:
        if num_computed_tokens != 0:
            raise ValueError(f"request {req_id!r} arrives with {num_computed_tokens} prefix-cached tokens; the simple "
                             f"runner keeps one contiguous cache per request and cannot reuse them. Create the "
                             f"Scheduler with enable_prefix_caching=False")
        return _State(list(token_ids), 0, ContiguousKVCache.for_model(self.model, capacity=len(token_ids) + 64))

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Compute every scheduled chunk; sample one greedy token for each request whose chunk ends its tokens.

        Rows of requests still mid-prefill are empty lists (no logits are computed for them).
        """
        start = time.perf_counter()
        so = scheduler_output
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = self._new_state(new.req_id, new.prompt_token_ids, new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids:  # preempted earlier: its K/V is gone, recompute from scratch
                self.requests[rid] = self._new_state(rid, cached.all_token_ids[rid], cached.num_computed_tokens[i])
        req_ids, sampled = [], []
        device = self.model.device
        for rid, n in so.num_scheduled_tokens.items():
            state = self.requests[rid]
            begin, end = state.num_computed_tokens, state.num_computed_tokens + n
            ids = torch.tensor(state.token_ids[begin:end], dtype=torch.long, device=device)
            hidden = self.model(ids, torch.arange(begin, end, device=device), attn=state.cache)
            state.num_computed_tokens = end
            tokens: list[int] = []
            if end == len(state.token_ids):
                token = int(torch.argmax(self.model.compute_logits(hidden[-1:])[0]))
                state.token_ids.append(token)
                tokens = [token]
            req_ids.append(rid)
            sampled.append(tokens)
        self.last_step_seconds = time.perf_counter() - start
        return ModelRunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, sampled)


@dataclass
class TimedRun:
    """Latencies of one :func:`run_timed` workload.

    Attributes:
        outputs: request id -> generated token ids.
        ttft: request id -> seconds from its arrival to the end of the step that produced its first token.
        itl: request id -> seconds between its consecutive tokens (inter-token latencies).
        itl_cpu: the same gaps in CPU seconds of this process (all its threads). Other programs busy on the machine
            stretch wall-clock gaps but not these, so comparisons that must hold under load use them.
        step_seconds: wall time of each step (schedule + model + update).
        step_tokens: tokens scheduled in each step.
        first_token_step: request id -> step index of its first token.
        num_preemptions: request id -> how many times it was preempted.
        total_seconds: wall time of the whole run.
        total_cpu_seconds: CPU time of this process over the whole run (see ``itl_cpu``).
    """

    outputs: dict[str, list[int]]
    ttft: dict[str, float] = field(default_factory=dict)
    itl: dict[str, list[float]] = field(default_factory=dict)
    itl_cpu: dict[str, list[float]] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    first_token_step: dict[str, int] = field(default_factory=dict)
    num_preemptions: dict[str, int] = field(default_factory=dict)
    total_seconds: float = 0.0
    total_cpu_seconds: float = 0.0

    @property
    def throughput(self) -> float:
        """Generated tokens per second over the whole run."""
        return sum(len(v) for v in self.outputs.values()) / self.total_seconds

    @property
    def cpu_throughput(self) -> float:
        """Generated tokens per CPU second of this process: throughput that other programs' load does not lower."""
        return sum(len(v) for v in self.outputs.values()) / self.total_cpu_seconds


def run_timed(model: LlamaForCausalLM, config: SchedulerConfig, prompts: Sequence[tuple[str, list[int], int, int]],
              num_gpu_blocks: int = 512, block_size: int = 16) -> TimedRun:
    """Serve ``prompts`` with a :class:`Scheduler` and a :class:`SimpleModelRunner`, timing every step.

    Args:
        model: the real model.
        config: the scheduler configuration to measure.
        prompts: ``(request_id, prompt_token_ids, max_tokens, arrival_step)`` for each request; greedy, EOS ignored.
        num_gpu_blocks / block_size: the (bookkeeping-only) KV cache the scheduler allocates from.
    """
    scheduler = Scheduler(config, num_gpu_blocks, block_size, enable_prefix_caching=False)
    runner = SimpleModelRunner(model)
    pending = sorted(prompts, key=lambda p: p[3])
    run = TimedRun({p[0]: [] for p in prompts})
    arrived: dict[str, float] = {}
    requests: dict[str, Request] = {}
    last_token_time: dict[str, float] = {}
    last_token_cpu: dict[str, float] = {}
    t0, cpu0 = time.perf_counter(), time.process_time()
    step = 0
    while pending or scheduler.has_unfinished_requests():
        now = time.perf_counter()
        while pending and pending[0][3] <= step:
            rid, ids, max_tokens, _ = pending.pop(0)
            requests[rid] = Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                    arrival_time=float(step))
            scheduler.add_request(requests[rid])
            arrived[rid] = now
        so = scheduler.schedule()
        outs = scheduler.update_from_output(so, runner.execute_model(so))
        done, done_cpu = time.perf_counter(), time.process_time()
        run.step_seconds.append(done - now)
        run.step_tokens.append(so.total_num_scheduled_tokens)
        for out in outs:
            if out.new_token_ids and out.request_id not in run.ttft:
                run.ttft[out.request_id] = done - arrived[out.request_id]
                run.first_token_step[out.request_id] = step
            elif out.new_token_ids:
                run.itl.setdefault(out.request_id, []).append(done - last_token_time[out.request_id])
                run.itl_cpu.setdefault(out.request_id, []).append(done_cpu - last_token_cpu[out.request_id])
            last_token_time[out.request_id] = done
            last_token_cpu[out.request_id] = done_cpu
            run.outputs[out.request_id].extend(out.new_token_ids)
        step += 1
    run.total_seconds = time.perf_counter() - t0
    run.total_cpu_seconds = time.process_time() - cpu0
    run.num_preemptions = {rid: r.num_preemptions for rid, r in requests.items()}
    return run
