"""The engine core in its own process: what crossing the process boundary costs per step, and what async
scheduling wins back, measured on the throughput benchmark's workload in one run.

Three measurements (``python bench/engine_core.py``):

1. **IPC cost per step.** The workload runs in-process and synchronously; at every step the plan
   (:class:`~minillm.core.sched.output.SchedulerOutput`) and the step's
   :class:`~minillm.engine.EngineCoreOutputs` are encoded to msgpack and decoded back with the engine's own
   :mod:`minillm.serial_utils` (bytes, and the encode+decode time). The plan is also written out *in full*, every
   scheduled request as a :class:`~minillm.core.sched.output.NewRequestData` with all its token ids and all its
   block ids, rebuilt by a :class:`PlanMirror` (what a receiver holds): the ratio is what sending the plan as a diff
   saves. Steps with a prompt chunk ("prefill") and decode-only steps ("decode") are reported apart. In minillm
   only the outputs cross a process boundary (the executor lives in the core's process); the plan would cross one
   to reach workers in other processes, as in vLLM's ``MultiprocExecutor``.
2. **Throughput**: (a) the in-process synchronous engine, (b) the engine core in its own process with async
   scheduling (asked for: vLLM v0.33.0 leaves it off on a CPU), (c) its own process without (``LLM``'s default on a
   CPU), (d) as (c) with the worker in a process of its own (what vLLM v0.33.0 runs on a CPU). Each engine's
   start-up time, and the same greedy tokens in all four (checked; a divergence is classified at its first token as
   :func:`~minillm.course.benchmarks.throughput.compare_greedy` does, with minillm's own model as the oracle), tok/s
   and the ratios b/a, c/a and d/c.
3. **A timeline** of each run (``call_utility("start_timeline")`` / ``"take_timeline"``): ``(what, start, end)``
   events, ``what`` in schedule/execute/update. From it: how often the scheduling of step N+1 overlapped the
   execution of step N, the mean schedule and update times, and the executor's idle gaps between steps (what
   async scheduling exists to close). ``--plot PATH`` draws the first steps of the async run.

Every engine is driven the same way: the timer starts, every request is added, then the front end takes each
step's outputs (``engine_core.get_output()``) and processes them (detokenizing, as ``LLMEngine.step`` does) until
all have finished. A short untimed warm-up request runs first in each engine (a fresh process's first steps pay
for allocations and thread start-up), and the prefix cache is reset before each timed round.

vLLM counterpart: ``vllm/v1/engine/core.py`` (``EngineCore.step_with_batch_queue``) for the overlap,
``vllm/v1/serial_utils.py`` (``MsgpackEncoder``) for the wire format, and ``vllm/v1/executor/multiproc_executor.py``
(``MultiprocExecutor``), which broadcasts each plan to its workers through ``MessageQueue`` (pickled, in shared
memory: ``vllm/distributed/device_communicators/shm_broadcast.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from minillm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minillm.course.benchmarks.throughput import OUTPUT_LENS, TIE_GAPS, Workload, compare_greedy, make_workload
from minillm.engine import EngineCoreOutputs
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.model.llama import LlamaForCausalLM
from minillm.sampling_params import SamplingParams
from minillm.serial_utils import MsgpackDecoder, MsgpackEncoder

# name -> (what the report calls it, multiprocess_mode, EngineArgs.async_scheduling,
# EngineArgs.distributed_executor_backend). Async scheduling is asked for explicitly: vLLM v0.33.0 (and minillm)
# leave it off on a CPU. (d) is vLLM's CPU layout: the engine core in its own process, synchronous, and its one
# worker in a process of its own (CpuPlatform.check_and_update_config turns "uni" into "mp").
ENGINES = {"inproc_sync": ("(a) in-process, synchronous", False, False, "uni"),
           "mp_async": ("(b) own process, async scheduling", True, True, "uni"),
           "mp_sync": ("(c) own process, synchronous", True, False, "uni"),
           "mp_sync_worker": ("(d) (c) + worker process (vLLM on CPU)", True, False, "mp")}
EVENT_KINDS = ("schedule", "execute", "update")


# -- 1. IPC cost per step ---------------------------------------------------------------------------------------
class PlanMirror:
    """What the receiver of the plans holds per request (as the model runner's persistent batch does): its token
    ids and its block ids, rebuilt from the diffs and the steps' outputs alone, so that any plan can also be
    written out in full.

    Call :meth:`apply_plan` with each step's plan, then :meth:`apply_outputs` with that step's outputs.
    """

    def __init__(self) -> None:
        self.token_ids: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.sampling_params: dict[str, Any] = {}

    def _drop(self, req_id: str) -> None:
        for table in (self.token_ids, self.block_ids, self.sampling_params):
            table.pop(req_id, None)

    def apply_plan(self, plan: SchedulerOutput) -> None:
        """Take in a step's plan: forget finished requests, add new ones, extend the cached ones. A preempted
        request is kept, as the runner keeps it: when it resumes, its tokens and blocks come again whole."""
        for req_id in plan.finished_req_ids:  # first, as the runner does
            self._drop(req_id)
        for new in plan.scheduled_new_reqs:
            self.token_ids[new.req_id] = list(new.prompt_token_ids)
            self.block_ids[new.req_id] = list(new.block_ids)
            self.sampling_params[new.req_id] = new.sampling_params
        cached = plan.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id in cached.all_token_ids:  # resumed, or not scheduled in the previous step: sent whole
                self.token_ids[req_id] = list(cached.all_token_ids[req_id])
            if req_id in cached.resumed_req_ids:  # its block list starts over
                self.block_ids[req_id] = list(new_blocks)
            else:
                self.block_ids[req_id].extend(new_blocks)

    def apply_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Append each request's new tokens; forget the requests that finished."""
        for out in outputs.outputs:
            if out.request_id not in self.token_ids:
                continue
            if out.finished:
                self._drop(out.request_id)
            else:
                self.token_ids[out.request_id].extend(out.new_token_ids)

    def full_plan(self, plan: SchedulerOutput) -> SchedulerOutput:
        """``plan`` with every scheduled request sent as a new one: all its token ids (prompt and outputs so far)
        and all its block ids. Call after :meth:`apply_plan` of that plan."""
        cached = plan.scheduled_cached_reqs
        context = {new.req_id: new.num_computed_tokens for new in plan.scheduled_new_reqs}
        context.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        full = [NewRequestData(rid, list(self.token_ids[rid]), self.sampling_params[rid], list(self.block_ids[rid]),
                               context[rid]) for rid in plan.num_scheduled_tokens]
        return SchedulerOutput(full, CachedRequestData(), dict(plan.num_scheduled_tokens),
                               plan.total_num_scheduled_tokens, set(plan.preempted_req_ids),
                               set(plan.finished_req_ids), dict(plan.scheduled_spec_decode_tokens),
                               plan.kv_connector_metadata)


def step_kind(plan: SchedulerOutput) -> str:
    """``"decode"`` when every scheduled request computes one token of a request already running, else
    ``"prefill"`` (the step holds a prompt chunk: a new or resumed request, or a chunk of several tokens)."""
    cached = plan.scheduled_cached_reqs
    if plan.scheduled_new_reqs or cached.resumed_req_ids or any(n > 1 for n in plan.num_scheduled_tokens.values()):
        return "prefill"
    return "decode"


def roundtrip(obj: Any, encoder: MsgpackEncoder, decoder: MsgpackDecoder, reps: int = 3) -> tuple[int, float]:
    """``(msgpack bytes, encode+decode µs)`` of ``obj``: the best of ``reps`` timings (other processes on a shared
    machine only ever slow one down)."""
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        data = encoder.encode(obj)
        decoder.decode(data)
        best = min(best, time.perf_counter() - start)
    return len(data), best * 1e6


@dataclass
class StepIPC:
    """One step's messages: bytes and encode+decode µs of the plan as sent (a diff), of the same plan in full, and
    of the step's outputs (``outputs_bytes == 0`` when the step produced no output: the core sends nothing then)."""

    kind: str
    num_reqs: int
    step_s: float
    plan_bytes: int
    plan_us: float
    full_plan_bytes: int
    full_plan_us: float
    outputs_bytes: int
    outputs_us: float


def sampling_params(workload: Workload) -> list[SamplingParams]:
    """The benchmark's requests: greedy, exactly ``output_lens[i]`` tokens (EOS ignored), as in the throughput
    benchmark."""
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]


def measure_ipc(model: LlamaForCausalLM, tokenizer: Any, workload: Workload,
                engine_args: dict[str, Any] | None = None) -> list[StepIPC]:
    """Run ``workload`` in-process and synchronously; per step, what its plan and its outputs cost on the wire."""
    engine = LLMEngine(model, tokenizer, EngineArgs(**{**(engine_args or {}), "async_scheduling": False}))
    encoder = MsgpackEncoder()
    plan_decoder, outputs_decoder = MsgpackDecoder(SchedulerOutput), MsgpackDecoder(EngineCoreOutputs)
    mirror = PlanMirror()
    steps: list[StepIPC] = []
    try:
        for i, (prompt, params) in enumerate(zip(workload.prompts, sampling_params(workload), strict=True)):
            engine.add_request(f"r{i}", prompt, params)
        while engine.has_requests():
            start = time.perf_counter()
            outputs = engine.engine_core.get_output()  # in-process and synchronous: exactly one step
            step_s = time.perf_counter() - start
            plan = engine.last_scheduler_output
            assert plan is not None  # the step just taken planned it
            mirror.apply_plan(plan)
            full = mirror.full_plan(plan)
            mirror.apply_outputs(outputs)
            plan_bytes, plan_us = roundtrip(plan, encoder, plan_decoder)
            full_bytes, full_us = roundtrip(full, encoder, plan_decoder)
            out_bytes, out_us = roundtrip(outputs, encoder, outputs_decoder) if outputs.outputs else (0, 0.0)
            steps.append(StepIPC(step_kind(plan), len(plan.num_scheduled_tokens), step_s, plan_bytes, plan_us,
                                 full_bytes, full_us, out_bytes, out_us))
            engine._process_engine_outputs(outputs)
    finally:
        engine.shutdown()
    return steps


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize_ipc(steps: list[StepIPC]) -> dict[str, dict[str, float]]:
    """Per step kind: how many steps, the median step time, and per message the median bytes and the median and
    p90 encode+decode µs; ``full_over_diff``: the bytes of the full plans over those of the diffs, summed."""
    summary = {}
    for kind in ("prefill", "decode"):
        mine = [s for s in steps if s.kind == kind]
        sent = [s for s in mine if s.outputs_bytes]
        row: dict[str, float] = {"steps": len(mine), "median_reqs": _pct([s.num_reqs for s in mine], 50),
                                 "median_step_ms": _pct([s.step_s * 1e3 for s in mine], 50)}
        for name, pool, nbytes, us in (("plan", mine, "plan_bytes", "plan_us"),
                                       ("full_plan", mine, "full_plan_bytes", "full_plan_us"),
                                       ("outputs", sent, "outputs_bytes", "outputs_us")):
            row[f"{name}_bytes"] = _pct([getattr(s, nbytes) for s in pool], 50)
            row[f"{name}_us_median"] = _pct([getattr(s, us) for s in pool], 50)
            row[f"{name}_us_p90"] = _pct([getattr(s, us) for s in pool], 90)
        diff = sum(s.plan_bytes for s in mine)
        row["full_over_diff"] = sum(s.full_plan_bytes for s in mine) / diff if diff else float("nan")
        summary[kind] = row
    return summary


# -- 2. throughput, 3. timeline -------------------------------------------------------------------------------
@dataclass
class EngineRun:
    """One timed run of the workload through one engine.

    Attributes:
        tokens: each request's output token ids, in workload order.
        delivery_s: per message, from the core's ``outputs.timestamp`` (its outputs ready) to the front end
            holding them decoded (the same monotonic clock in both processes); ~0 in-process.
        timeline: the core's ``(what, start, end)`` events of the run.
    """

    name: str
    seconds: float
    output_tokens: int
    tokens: list[list[int]] = field(repr=False)
    num_steps: int
    delivery_s: list[float] = field(repr=False)
    timeline: list[tuple[str, float, float]] = field(repr=False)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def make_engine(name: str, model: LlamaForCausalLM, tokenizer: Any,
                engine_args: dict[str, Any] | None = None) -> LLMEngine:
    """Engine ``name`` of :data:`ENGINES` around ``model`` (sent to the core's process once, through shared
    memory, for the multiprocess ones). The caller shuts it down.

    Raises:
        ValueError: ``name`` is not one of :data:`ENGINES`.
    """
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {sorted(ENGINES)}")
    _, multiprocess, async_scheduling, backend = ENGINES[name]
    args = EngineArgs(**{**(engine_args or {}), "async_scheduling": async_scheduling,
                         "distributed_executor_backend": backend})
    return LLMEngine(model, tokenizer, args, multiprocess_mode=multiprocess)


def _wait_idle(engine: LLMEngine, timeout_s: float = 30.0) -> None:
    """Wait until the core has nothing left to do: with async scheduling a step can still be in flight after the
    last output arrived, and its events belong to the timeline."""
    deadline = time.monotonic() + timeout_s
    while engine.engine_core.call_utility("has_requests"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine core still had requests {timeout_s:.0f} s after the last output")
        time.sleep(0.01)


def _drive(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], prefix: str
           ) -> tuple[dict[str, list[int]], list[float]]:
    """Add every request, then take and process outputs until all have finished: ``LLMEngine.step``'s two halves,
    kept apart to time each message's delivery."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{prefix}{i}", prompt, p)
    tokens: dict[str, list[int]] = {}
    delivery = []
    while engine.has_requests():
        outputs = engine.engine_core.get_output()
        if outputs.timestamp:
            delivery.append(time.monotonic() - outputs.timestamp)
        for out in engine._process_engine_outputs(outputs):
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens, delivery


def warm_up(engine: LLMEngine) -> None:
    """One short untimed request (a fresh process's first steps pay for allocations and thread start-up), then an
    empty prefix cache."""
    _drive(engine, [[101, 102, 103, 104, 105, 106, 107, 108]], [SamplingParams(temperature=0.0, max_tokens=4,
                                                                              ignore_eos=True)], "warm-up-")
    _reset_prefix_cache(engine)


def _reset_prefix_cache(engine: LLMEngine) -> None:
    # Each timed round must compute every prompt: a later round would otherwise hit the previous round's blocks.
    _wait_idle(engine)
    if not engine.engine_core.call_utility("reset_prefix_cache"):
        raise RuntimeError("the engine core could not reset its prefix cache (blocks still in use)")


def run_engine(engine: LLMEngine, workload: Workload, name: str = "") -> EngineRun:
    """Time ``workload`` through ``engine`` (from before the first request is added, since a core in its own
    process starts at once), recording the core's timeline."""
    engine.engine_core.call_utility("start_timeline")
    steps_before = _num_steps(engine)
    start = time.perf_counter()
    tokens, delivery = _drive(engine, workload.prompts, sampling_params(workload), "r")
    seconds = time.perf_counter() - start
    _wait_idle(engine)
    timeline = [tuple(e) for e in engine.engine_core.call_utility("take_timeline")]
    ordered = [tokens[f"r{i}"] for i in range(len(workload.prompts))]
    if [len(t) for t in ordered] != workload.output_lens:
        raise RuntimeError(f"{name or 'the engine'} returned {[len(t) for t in ordered]} tokens, the workload asked "
                           f"for {workload.output_lens}")
    return EngineRun(name, seconds, workload.num_output_tokens, ordered, _num_steps(engine) - steps_before, delivery,
                     timeline)


def _num_steps(engine: LLMEngine) -> int:
    return engine.engine_core.get_stats().engine.num_steps


def split_timeline(events: list[tuple[str, float, float]]) -> dict[str, list[tuple[float, float]]]:
    """``{what: [(start, end), ...]}`` in start order. The k-th schedule, execute and update of each kind belong to
    step k: the core records them in step order, and the one executor thread runs the steps in order.

    Raises:
        ValueError: an event of another kind, or one that ends before it starts.
    """
    out: dict[str, list[tuple[float, float]]] = {kind: [] for kind in EVENT_KINDS}
    for what, start, end in sorted(events, key=lambda e: e[1]):
        if what not in out or end < start:
            raise ValueError(f"a timeline event must be (what, start, end) with what in {EVENT_KINDS} and "
                             f"start <= end, got {(what, start, end)}")
        out[what].append((start, end))
    return out


def analyze_timeline(events: list[tuple[str, float, float]]) -> dict[str, float]:
    """What one run's timeline says about the overlap.

    Returns:
        ``steps``; ``overlap_fraction``: of the steps N followed by a step N+1, those during whose execution step
        N+1 was (at least partly) scheduled; ``schedule_ms`` / ``update_ms``: mean per step; ``execute_s``: the
        executor's busy time; ``gap_ms_median`` / ``gap_ms_p90`` / ``gaps_s``: its idle time between one step's
        execution and the next's; ``span_s``: first event to last; ``busy_fraction``: ``execute_s / span_s``.
    """
    t = split_timeline(events)
    sched, execute, update = t["schedule"], t["execute"], t["update"]
    n = len(execute)
    overlaps = [sched[k + 1][0] < execute[k][1] and sched[k + 1][1] > execute[k][0]
                for k in range(min(n, len(sched)) - 1)]
    gaps = [execute[k + 1][0] - execute[k][1] for k in range(n - 1)]
    span = max(e for _, _, e in events) - min(s for _, s, _ in events) if events else float("nan")
    busy = sum(e - s for s, e in execute)
    return {"steps": n, "overlap_fraction": float(np.mean(overlaps)) if overlaps else float("nan"),
            "schedule_ms": 1e3 * float(np.mean([e - s for s, e in sched])) if sched else float("nan"),
            "update_ms": 1e3 * float(np.mean([e - s for s, e in update])) if update else float("nan"),
            "execute_s": busy, "gap_ms_median": 1e3 * _pct(gaps, 50), "gap_ms_p90": 1e3 * _pct(gaps, 90),
            "gaps_s": float(sum(gaps)), "span_s": span, "busy_fraction": busy / span if span else float("nan")}


def plot_timeline(events: list[tuple[str, float, float]], path: str, num_steps: int = 15,
                  title: str = "engine core, own process, async scheduling") -> None:
    """Save a figure of the first ``num_steps`` steps, one row per event kind, time in ms from the first event;
    below it, a zoom on the last three of them, where the sub-millisecond schedule and update events show."""
    # A Figure of its own, not pyplot's: switching pyplot's backend would close a notebook's figures.
    from matplotlib.figure import Figure

    t = split_timeline(events)
    if not t["schedule"]:
        raise ValueError("the timeline has no step to draw")
    t0 = t["schedule"][0][0]
    ms = {kind: [(1e3 * (s - t0), 1e3 * (e - t0)) for s, e in t[kind][:num_steps]] for kind in EVENT_KINDS}
    last = min(num_steps, len(t["execute"])) - 1
    first_zoomed = max(last - 2, 0)
    # The zoom: from the scheduling of the first zoomed step to the update of the last one.
    zoom = (ms["schedule"][first_zoomed][0], max(e for kind in EVENT_KINDS for s, e in ms[kind][first_zoomed:last + 1]))
    colors = {"schedule": "tab:blue", "execute": "tab:orange", "update": "tab:green"}
    fig = Figure(figsize=(12, 4.8))
    axes = fig.subplots(2, 1)
    for ax, (lo, hi) in zip(axes, [(0.0, max(e for kind in EVENT_KINDS for _, e in ms[kind])), zoom], strict=True):
        min_width = (hi - lo) / 400  # an event much shorter than the axis would not show at all
        for row, kind in enumerate(EVENT_KINDS):
            ax.broken_barh([(s, max(e - s, min_width)) for s, e in ms[kind]], (row - 0.35, 0.7),
                           facecolors=colors[kind], edgecolor="black", linewidth=0.3)
            for k, (s, e) in enumerate(ms[kind]):
                if lo <= s <= hi and (kind == "execute" or ax is axes[1]):  # step numbers where they fit
                    ax.text(max(s, lo) + max(e - s, min_width) / 2, row, str(k), ha="center", va="center",
                            fontsize=7)
        ax.set_xlim(lo - (hi - lo) * 0.01, hi + (hi - lo) * 0.01)
        ax.set_yticks(range(len(EVENT_KINDS)), EVENT_KINDS)
        ax.invert_yaxis()
    axes[0].set_title(f"{title}: the first {last + 1} steps")
    axes[1].set_title(f"steps {first_zoomed}-{last}, zoomed")
    axes[1].set_xlabel("ms since the first step was scheduled")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class _ModelAsOracle:
    """:func:`compare_greedy`'s view of minillm's own model: ``dtype``, and token ids ``[1, T]`` -> an object
    whose ``logits`` is ``[1, 1, vocab]`` (the last position's, all that ``compare_greedy`` reads), computed with
    no KV cache."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model, self.dtype = model, model.dtype

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> SimpleNamespace:
        hidden = self.model(input_ids[0])
        return SimpleNamespace(logits=self.model.compute_logits(hidden[-1:])[None])


def compare_tokens(reference: EngineRun, other: EngineRun, model: LlamaForCausalLM,
                   workload: Workload) -> dict[str, Any]:
    """``compare_greedy``'s counts for ``other``'s tokens against ``reference``'s (without recomputing anything
    when they are identical)."""
    if reference.tokens == other.tokens:
        return {"identical": len(reference.tokens), "near_tie_divergences": 0, "peer_divergences": 0,
                "real_divergences": 0, "tie_gaps": []}
    return compare_greedy(reference.tokens, other.tokens, _ModelAsOracle(model), workload,
                          tie_gap=TIE_GAPS.get(model.dtype))


# -- the whole benchmark -----------------------------------------------------------------------------------------
def run_benchmark(workload: Workload, model: LlamaForCausalLM | None = None, tokenizer: Any = None,
                  engine_args: dict[str, Any] | None = None, dtype: str | torch.dtype | None = "float32",
                  repeat: int = 1, log: Any = None) -> dict[str, Any]:
    """Measure 1.-3. on ``workload``; return the report (``format_report`` prints it, ``to_json`` keeps its data).

    Args:
        model: the model (default: SmolLM2 in ``dtype``, with its tokenizer).
        dtype: the model's dtype when ``model`` is not given (default fp32), as ``EngineArgs.dtype`` takes it.
        repeat: timed rounds per engine, interleaved (a, b, c, a, b, c, ...); each engine keeps its fastest (load
            from other processes only ever slows a run down). Timelines and delivery times are the fastest round's.

    Raises:
        ValueError: ``repeat`` is not a positive integer.
    """
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a positive integer, got {repeat!r}")
    say = log or (lambda *a: None)
    from minillm.platforms.cpu import cpu_capability, native_bf16
    from minillm.platforms.dtype import resolve_dtype

    choice = resolve_dtype(dtype if model is None else model.dtype, "cpu")
    if model is None:
        import minillm

        model, tokenizer = minillm.load_model(dtype=choice.dtype)
    report: dict[str, Any] = {
        "num_requests": len(workload.prompts), "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens, "threads": torch.get_num_threads(), "dtype": choice.name,
        "dtype_reason": choice.reason, "cpu_capability": cpu_capability(), "cpu_native_bf16": native_bf16(),
        "repeat": repeat}
    start = time.perf_counter()
    steps = measure_ipc(model, tokenizer, workload, engine_args)
    report["ipc"] = summarize_ipc(steps)
    say(f"1. IPC per step: {len(steps)} steps measured in {time.perf_counter() - start:.1f} s")
    engines: dict[str, LLMEngine] = {}
    runs: dict[str, EngineRun] = {}
    try:
        startup: dict[str, float] = {}
        for name in ENGINES:
            begin = time.perf_counter()
            engines[name] = make_engine(name, model, tokenizer, engine_args)
            startup[name] = time.perf_counter() - begin
            warm_up(engines[name])
        report["startup_s"] = startup
        report["async_scheduling"] = {name: e.async_scheduling for name, e in engines.items()}
        report["core_pids"] = {name: e.engine_core.ready["pid"] for name, e in engines.items() if e.multiprocess_mode}
        for round_ in range(repeat):
            for name, engine in engines.items():
                if round_:
                    _reset_prefix_cache(engine)
                r = run_engine(engine, workload, name)
                say(f"round {round_ + 1}: {ENGINES[name][0]}: {r.tokens_per_second:.1f} tok/s ({r.seconds:.1f} s)")
                if name not in runs or r.seconds < runs[name].seconds:
                    runs[name] = r
    finally:
        for engine in engines.values():
            engine.shutdown()
    a = runs["inproc_sync"]
    report["throughput"] = {name: {"tokens_per_second": r.tokens_per_second, "seconds": r.seconds,
                                   "num_steps": r.num_steps, "delivery_ms_median": 1e3 * _pct(r.delivery_s, 50),
                                   "delivery_ms_p90": 1e3 * _pct(r.delivery_s, 90)} for name, r in runs.items()}
    report["ratios"] = {"b/a": runs["mp_async"].tokens_per_second / a.tokens_per_second,
                        "c/a": runs["mp_sync"].tokens_per_second / a.tokens_per_second,
                        "d/c": runs["mp_sync_worker"].tokens_per_second / runs["mp_sync"].tokens_per_second}
    report["greedy"] = {f"{name} vs inproc_sync": compare_tokens(a, runs[name], model, workload)
                        for name in ENGINES if name != "inproc_sync"}
    report["timeline"] = {name: analyze_timeline(r.timeline) for name, r in runs.items()}
    report["runs"] = runs
    return report


def to_json(report: dict[str, Any]) -> dict[str, Any]:
    """The report's data without the runs' token lists and events (``--json``)."""
    return {k: v for k, v in report.items() if k != "runs"}


def format_report(report: dict[str, Any]) -> str:
    """The readable table: IPC per step kind, throughput and ratios, the timelines, where the time goes."""
    lines = [f"workload: {report['num_requests']} requests, {report['prompt_tokens']} prompt tokens, "
             f"{report['output_tokens']} output tokens; torch threads: {report['threads']}; "
             f"best of {report['repeat']} round(s)",
             f"dtype: {report['dtype']} ({report['dtype_reason']})",
             f"CPU: torch capability {report['cpu_capability']}, bf16 instructions: "
             f"{report.get('cpu_native_bf16') or 'none'}", "",
             "1. IPC per step (msgpack via minillm.serial_utils; encode+decode µs, median / p90)",
             f"{'steps':<9}{'n':>5}{'reqs':>6}{'step ms':>9}{'plan B':>9}{'µs':>12}{'full plan B':>13}{'µs':>14}"
             f"{'full/diff':>10}{'outputs B':>11}{'µs':>12}"]
    for kind, row in report["ipc"].items():
        if not row["steps"]:
            continue
        us = lambda name, row=row: f"{row[f'{name}_us_median']:.0f} / {row[f'{name}_us_p90']:.0f}"  # noqa: E731
        lines.append(f"{kind:<9}{row['steps']:>5}{row['median_reqs']:>6.0f}{row['median_step_ms']:>9.1f}"
                     f"{row['plan_bytes']:>9.0f}{us('plan'):>12}{row['full_plan_bytes']:>13.0f}{us('full_plan'):>14}"
                     f"{row['full_over_diff']:>9.1f}x{row['outputs_bytes']:>11.0f}{us('outputs'):>12}")
    lines += ["", "2. throughput (same workload, greedy)",
              f"{'engine':<38}{'start s':>8}{'tok/s':>8}{'s':>8}{'steps':>7}{'vs (a)':>8}"
              f"{'delivery ms (median / p90)':>29}"]
    tput = report["throughput"]
    base = tput["inproc_sync"]["tokens_per_second"]
    for name, row in tput.items():
        delivery = f"{row['delivery_ms_median']:.2f} / {row['delivery_ms_p90']:.2f}"
        lines.append(f"{ENGINES[name][0]:<38}{report['startup_s'][name]:>8.2f}{row['tokens_per_second']:>8.1f}"
                     f"{row['seconds']:>8.1f}{row['num_steps']:>7}{row['tokens_per_second'] / base:>8.2f}"
                     f"{delivery:>29}")
    ratios = report["ratios"]
    lines.append(f"b/a = {ratios['b/a']:.2f} (goal >= 1.0: {'met' if ratios['b/a'] >= 1.0 else 'not met'}), "
                 f"c/a = {ratios['c/a']:.2f}, d/c = {ratios['d/c']:.2f} (a worker process per step; its start-up "
                 f"costs {report['startup_s']['mp_sync_worker'] - report['startup_s']['mp_sync']:+.2f} s)")
    for what, same in report["greedy"].items():
        lines.append(f"greedy tokens, {what}: {same}")
    lines += ["", "3. timelines (the core's schedule / execute / update events)",
              f"{'engine':<38}{'steps':>6}{'overlap':>9}{'sched ms':>10}{'update ms':>10}{'execute s':>10}"
              f"{'gaps s':>8}{'gap ms (median / p90)':>24}{'busy':>7}"]
    for name, row in report["timeline"].items():
        gap = f"{row['gap_ms_median']:.2f} / {row['gap_ms_p90']:.2f}"
        lines.append(f"{ENGINES[name][0]:<38}{row['steps']:>6}{row['overlap_fraction']:>9.0%}"
                     f"{row['schedule_ms']:>10.2f}{row['update_ms']:>10.2f}{row['execute_s']:>10.2f}"
                     f"{row['gaps_s']:>8.2f}{gap:>24}{row['busy_fraction']:>7.0%}")
    lines += ["", where_the_time_goes(report)]
    return "\n".join(lines)


def where_the_time_goes(report: dict[str, Any]) -> str:
    """The summary from the numbers: the executor's idle time between steps (all that async scheduling can win
    back) next to a step's length, what the wire costs, and the execution times (the same model on nearly the same
    plans: a difference there is the cores' contention, not the engine's design)."""
    ipc, tl = report["ipc"], report["timeline"]
    decode = ipc["decode"] if ipc["decode"]["steps"] else ipc["prefill"]
    per_step = {n: 1e3 * tl[n]["gaps_s"] / max(tl[n]["steps"] - 1, 1) for n in ENGINES}
    idle = ", ".join(f"{per_step[n]:.2f} ms in {n}" for n in ENGINES)
    busy = ", ".join(f"{tl[n]['execute_s']:.1f} s ({tl[n]['steps']} steps) in {n}" for n in ENGINES)
    return (f"where the time goes: the executor idles between steps {idle}, next to a median decode step of "
            f"{decode['median_step_ms']:.1f} ms in-process: that idle time is all async scheduling can win back "
            f"(it overlapped {tl['mp_async']['overlap_fraction']:.0%} of its steps' scheduling with the previous "
            f"step's execution). The wire: a decode step's outputs take {decode['outputs_us_median']:.0f} µs to "
            f"encode+decode ({decode['outputs_bytes']:.0f} B) and reach the front end "
            f"{report['throughput']['mp_async']['delivery_ms_median']:.2f} ms (median) after the core has them, "
            f"on the core's output thread: the busy loop never waits for them. The model computes for {busy}: "
            f"a difference there is the same work done at a different speed (other processes, and the core's "
            f"extra threads, competing with the torch threads for the cores).")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--num-requests", type=int, default=32,
                        help="requests of the workload (default 32, the throughput benchmark's: ~2 minutes on 2 "
                             "idle cores in fp32)")
    parser.add_argument("--min-prompt", type=int, default=30)
    parser.add_argument("--max-prompt", type=int, default=400)
    parser.add_argument("--output-lens", type=str, default=",".join(map(str, OUTPUT_LENS)),
                        help="comma-separated output lengths to draw from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice); the "
                                                                  "engine core's process gets the same count")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="float32",
                        help="the model's dtype (default float32, the lessons' and LLM's)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="interleaved timed rounds; each engine keeps its fastest (default 1)")
    parser.add_argument("--json", type=str, default=None, help="also write the report to this file")
    parser.add_argument("--plot", type=str, default=None,
                        help="save a figure of the async run's first --plot-steps steps to this file")
    parser.add_argument("--plot-steps", type=int, default=15)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python bench/engine_core.py``: run, print the table, return the report."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = add_cli_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from minillm.platforms.dtype import resolve_dtype

    workload = make_workload(args.num_requests, args.min_prompt, args.max_prompt,
                             tuple(int(x) for x in args.output_lens.split(",")), args.seed)
    engine_args = {"block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "max_num_seqs": args.max_num_seqs}
    print(f"dtype: {resolve_dtype(args.dtype, 'cpu')}", file=sys.stderr, flush=True)  # before the model loads
    start = time.perf_counter()
    report = run_benchmark(workload, engine_args=engine_args, dtype=args.dtype, repeat=args.repeat,
                           log=lambda msg: print(msg, file=sys.stderr, flush=True))
    report["total_seconds"] = time.perf_counter() - start
    print(format_report(report))
    print(f"the whole benchmark took {report['total_seconds']:.0f} s")
    if args.plot:
        plot_timeline(report["runs"]["mp_async"].timeline, args.plot, args.plot_steps)
        print(f"timeline figure: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(report), f, indent=2)
    return report
