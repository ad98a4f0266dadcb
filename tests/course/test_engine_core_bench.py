"""The engine-core benchmark (``bench/engine_core.py``): its measurements are of the right things.

On the tiny random model with a few requests: the plan mirror rebuilds exactly what the scheduler holds (through
a forced preemption), so the "full plan" is the true full plan; the diff plan is smaller than it on every decode
step; the timeline analysis computes overlaps and gaps as defined (by hand); and one whole run gives the same
tokens in the three engines, well-formed timelines whose order is what ``EngineCore.step`` and
``step_with_batch_queue`` guarantee, a JSON report with every key, a figure, and no engine-core process left.
"""
from __future__ import annotations

import json

import psutil
import pytest

from minillm.course.benchmarks.engine_core import (ENGINES, PlanMirror, analyze_timeline, format_report, make_engine,
                                            measure_ipc, plot_timeline, run_benchmark, sampling_params, split_timeline,
                                            step_kind, summarize_ipc, to_json)
from minillm.course.benchmarks.throughput import make_workload
from minillm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from tests.engine_helpers import single_thread, tiny_model  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

# Small chunks, small blocks: prefill spans several steps and decodes grow their block lists.
ARGS = dict(block_size=4, num_gpu_blocks=300, max_num_batched_tokens=32, long_prefill_token_threshold=16,
            max_num_seqs=4)


def tiny_workload(num_requests: int = 5, seed: int = 1):
    return make_workload(num_requests, 5, 50, (4, 10), seed=seed, vocab=(0, 211))


def test_plan_mirror_holds_what_the_scheduler_holds():
    """After every step (chunked prefill, decodes, a preemption and a resume), the mirror built from the diffs and
    the outputs alone has each running request's token ids and block ids, and its full plan lists every scheduled
    request whole."""
    workload = make_workload(8, 30, 60, (20, 30), seed=2, vocab=(0, 211))  # ~140 blocks of 4: more than 39
    engine = LLMEngine(tiny_model(), None, EngineArgs(block_size=4, num_gpu_blocks=40, max_num_batched_tokens=64,
                                                      max_model_len=128, long_prefill_token_threshold=16,
                                                      async_scheduling=False))
    for i, (prompt, params) in enumerate(zip(workload.prompts, sampling_params(workload))):
        engine.add_request(f"r{i}", prompt, params)
    mirror = PlanMirror()
    resumed = 0
    while engine.has_requests():
        outputs = engine.engine_core.get_output()
        plan = engine.last_scheduler_output
        resumed += len(plan.scheduled_cached_reqs.resumed_req_ids)
        mirror.apply_plan(plan)
        full = mirror.full_plan(plan)
        assert not full.scheduled_cached_reqs.req_ids
        assert [n.req_id for n in full.scheduled_new_reqs] == list(plan.num_scheduled_tokens)
        mirror.apply_outputs(outputs)
        sched = engine.scheduler
        running = {r.request_id for r in sched.running}
        assert running <= set(mirror.token_ids) <= set(sched.requests)  # preempted ones stay, finished ones go
        for rid in running:
            assert mirror.token_ids[rid] == sched.requests[rid].all_token_ids, rid
            assert mirror.block_ids[rid] == engine.kv_cache_manager.get_block_ids(rid), rid
        engine._process_engine_outputs(outputs)
    assert engine.stats.num_preemptions > 0 and resumed > 0, "the cache was meant to force a preemption"


def test_step_kind():
    new = NewRequestData("a", [1, 2, 3], None, [1], 0)
    assert step_kind(SchedulerOutput([new], CachedRequestData(), {"a": 3}, 3)) == "prefill"
    decode = CachedRequestData(["a", "b"], set(), [[], [7]], [5, 9], [1, 2])
    assert step_kind(SchedulerOutput([], decode, {"a": 1, "b": 1}, 2)) == "decode"
    chunk = CachedRequestData(["a", "b"], set(), [[], [7]], [5, 9], [0, 2])
    assert step_kind(SchedulerOutput([], chunk, {"a": 8, "b": 1}, 9)) == "prefill"
    resumed = CachedRequestData(["a"], {"a"}, [[3]], [0], [1], {"a": [4]})
    assert step_kind(SchedulerOutput([], resumed, {"a": 1}, 1)) == "prefill"


def test_the_diff_plan_is_smaller_on_decode_steps():
    """A decode sends one integer-sized diff per request; in full it sends all its tokens and blocks."""
    steps = measure_ipc(tiny_model(), None, tiny_workload(), ARGS)
    kinds = {s.kind for s in steps}
    assert kinds == {"prefill", "decode"}, kinds
    for s in steps:
        assert s.plan_bytes > 0 and s.full_plan_bytes > 0 and s.plan_us > 0 and s.full_plan_us > 0
        if s.kind == "decode":
            assert s.plan_bytes < s.full_plan_bytes, s
    summary = summarize_ipc(steps)
    assert summary["decode"]["full_over_diff"] > 1.5, summary["decode"]
    assert summary["prefill"]["steps"] + summary["decode"]["steps"] == len(steps)
    assert summary["decode"]["outputs_bytes"] > 0


def test_timeline_analysis_by_hand():
    """Two async steps (schedule 1 during execute 0) and a third scheduled after execute 1 ended: one overlap of
    two, gaps 1 ms and 3 ms between executions; the means as computed by hand."""
    ms = 1e-3
    events = [("schedule", 0 * ms, 1 * ms), ("execute", 1 * ms, 5 * ms), ("schedule", 2 * ms, 3 * ms),
              ("update", 5 * ms, 6 * ms), ("execute", 6 * ms, 10 * ms), ("update", 10 * ms, 11 * ms),
              ("schedule", 11 * ms, 12 * ms), ("execute", 13 * ms, 14 * ms), ("update", 14 * ms, 16 * ms)]
    row = analyze_timeline(events[::-1])  # any order: events are sorted by start
    assert row["steps"] == 3 and row["overlap_fraction"] == pytest.approx(0.5)
    assert row["schedule_ms"] == pytest.approx(1.0) and row["update_ms"] == pytest.approx(4 / 3)
    assert row["gaps_s"] == pytest.approx(4 * ms) and row["gap_ms_median"] == pytest.approx(2.0)
    assert row["execute_s"] == pytest.approx(9 * ms) and row["span_s"] == pytest.approx(16 * ms)
    with pytest.raises(ValueError, match="what in"):
        split_timeline([("sample", 0.0, 1.0)])
    with pytest.raises(ValueError, match="start <= end"):
        split_timeline([("execute", 2.0, 1.0)])


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        make_engine("nope", tiny_model(), None)
    with pytest.raises(ValueError, match="repeat must be a positive integer, got 0"):
        run_benchmark(tiny_workload(), model=tiny_model(), repeat=0)


def check_step_order(events: list[tuple[str, float, float]], async_scheduling: bool) -> None:
    """What the core guarantees by construction. Every step: schedule, then execute, then update, and the
    executions one after another (one thread). Synchronous (``EngineCore.step``): step N+1 is scheduled after
    step N's update ended. Async (``step_with_batch_queue``): step N+1 is scheduled *before* step N's update
    begins, since a turn schedules and launches a step before it waits for the oldest one in flight. (Whether that
    scheduling also overlaps step N's execution depends on how long each takes: not asserted.)"""
    t = split_timeline(events)
    sched, execute, update = t["schedule"], t["execute"], t["update"]
    assert len(sched) == len(execute) == len(update) > 2
    for k in range(len(sched)):
        assert sched[k][1] <= execute[k][0] and execute[k][1] <= update[k][0], k
        if k:
            assert execute[k - 1][1] <= execute[k][0], k
    for k in range(len(sched) - 1):
        if async_scheduling:
            assert sched[k + 1][0] < update[k][0], k
        else:
            assert sched[k + 1][0] >= update[k][1], k


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """``True`` once no live process has ``pid`` (a zombie counts as gone: it runs nothing)."""
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    return True


@pytest.mark.slow
def test_a_whole_run_on_the_tiny_model(tmp_path):
    """The four engines give the same tokens (the worker process of (d) included), their timelines keep the core's order, the report and its JSON have
    every key, the figure is written, and no engine-core process is left (run_benchmark shuts them down)."""
    workload = tiny_workload(5)
    model = tiny_model()
    report = run_benchmark(workload, model=model, engine_args=ARGS, repeat=2)
    assert report["async_scheduling"] == {"inproc_sync": False, "mp_async": True, "mp_sync": False,
                                          "mp_sync_worker": False}
    # A worker process costs start-up (spawn, imports, the model through shared memory): (d) starts after (c).
    assert report["startup_s"]["mp_sync_worker"] > report["startup_s"]["mp_sync"] > 0
    for what, same in report["greedy"].items():
        assert same["identical"] == len(workload.prompts), (what, same)
    runs = report["runs"]
    for name, run in runs.items():
        assert run.tokens == runs["inproc_sync"].tokens, name
        assert [len(t) for t in run.tokens] == workload.output_lens
        check_step_order(run.timeline, async_scheduling=report["async_scheduling"][name])
    assert runs["mp_async"].num_steps > 0 and report["timeline"]["mp_async"]["steps"] >= runs["mp_async"].num_steps
    data = json.loads(json.dumps(to_json(report)))
    assert {"num_requests", "dtype", "dtype_reason", "cpu_capability", "ipc", "throughput", "ratios", "greedy",
            "timeline", "async_scheduling"} <= set(data)
    assert set(data["throughput"]) == set(data["timeline"]) == set(ENGINES)
    assert set(data["ratios"]) == {"b/a", "c/a", "d/c"} and all(v > 0 for v in data["ratios"].values())
    assert {"overlap_fraction", "schedule_ms", "update_ms", "gap_ms_median", "gaps_s"} <= set(
        data["timeline"]["mp_async"])
    assert {"plan_bytes", "full_plan_bytes", "full_over_diff", "outputs_bytes", "plan_us_median",
            "plan_us_p90"} <= set(data["ipc"]["decode"])
    text = format_report(report)
    assert "b/a = " in text and "d/c = " in text and "(d) (c) + worker process (vLLM on CPU)" in text and "where the time goes" in text and "(b) own process, async scheduling" in text
    plot_timeline(runs["mp_async"].timeline, str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    assert set(report["core_pids"]) == {"mp_async", "mp_sync", "mp_sync_worker"}
    for name, pid in report["core_pids"].items():
        assert wait_gone(pid), f"the engine core of {name} (pid {pid}) is still running"
