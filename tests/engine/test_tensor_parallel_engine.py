"""Tensor parallelism inside the engine: ``tensor_parallel_size=N`` serves requests on N worker processes.

Tokens: the tiny model's workload (chunked prefill, prefix hits, a forced preemption, stop ids, seeded sampling,
n-gram drafts) at tp = 2 and 4 (4 ranks share 2 KV heads: each head replicated on 2 ranks) equals the one-process
engine's, with async scheduling on and off; SmolLM2 on 2 ranks is refused with vLLM's message. SmolLM2 served on 3
ranks is ``tests/engine/tp_smollm2.py``'s (``make test-tp``). ``collective_rpc`` runs a worker method or a function on every
rank, and refuses in the caller what no rank could run.

Each rank caches only its KV heads, and a memory budget buys tp times the blocks while ranks do not outnumber the KV
heads. Faults: a rank killed mid-generate gives ``EngineDeadError`` naming it within 10 s (in this process, and
through the engine-core process whose children the ranks are), a rank stuck (SIGSTOP)
fails the step with a timeout that names the collective, and no process is left behind (``psutil``).
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time

import psutil
import pytest
import torch

import safetensors.torch

from minillm.distributed.disaggregation import prefill_then_decode, run_requests
from minillm.distributed.kv_transfer.shared_storage_connector import prompt_key
from minillm.engine import EngineDeadError
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.executor.multiproc_executor import MultiprocExecutor
from minillm.kv_cache_interface import KVCacheConfig
from minillm.worker.worker import Worker
from minillm.model.parallel_layers import num_kv_heads_per_rank
from minillm.sampling_params import SamplingParams
from tests.engine_helpers import TINY, single_thread, tiny_model  # noqa: F401
from tests.engine.test_engine_core import CONFIGS, run, workload
from tests.engine.test_engine_core_process import wait_gone

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]


def engine(tp: int, async_scheduling: bool = False, **args) -> LLMEngine:
    return LLMEngine(tiny_model(), None, EngineArgs(tensor_parallel_size=tp, async_scheduling=async_scheduling,
                                                    **args))


def rank_pids(eng: LLMEngine) -> list[int]:
    return [p.pid for p in eng.model_executor.procs]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("tp, config, async_scheduling, drafts", [
    (2, "chunks of 5, block 4", False, False),
    (2, "chunks of 5, block 4", False, True),
    (2, "tight cache: preemption", True, False),
    (4, "tight cache: preemption", False, False),
])
def test_ranks_give_the_one_process_tokens(tp, config, async_scheduling, drafts):
    args = dict(CONFIGS[config], speculative_config=NGRAM) if drafts else CONFIGS[config]
    requests = workload(seed=3, seeded_sampling=True)
    want = run(engine(1, async_scheduling, **args), requests)
    eng = engine(tp, async_scheduling, **args)
    try:
        got = run(eng, requests)
        info = eng.model_executor.worker_info
        stats = eng.model_executor.collective_rpc("describe")
        if "preemption" in config:
            assert eng.stats.num_preemptions > 0, "the workload must force a preemption"
    finally:
        eng.shutdown()
    assert got == want
    assert any(p.seed is not None for _, _, _, p, _ in requests)  # seeded sampling was in it
    # Each rank: its query heads, the KV heads they read (replicated when ranks outnumber KV heads), its cache.
    kv, per_rank = TINY.num_key_value_heads, num_kv_heads_per_rank(TINY.num_key_value_heads, tp)
    assert [i["query_heads"] for i in info] == [list(range(r * 4 // tp, (r + 1) * 4 // tp)) for r in range(tp)]
    assert [i["kv_heads"] for i in info] == [[r // (tp // kv)] if tp > kv  # replicated on tp // kv neighbours
                                             else list(range(r * per_rank, (r + 1) * per_rank)) for r in range(tp)]
    assert all(i["kv_cache_shape"] == (args["num_gpu_blocks"], args["block_size"], per_rank, TINY.head_dim)
               for i in info)
    # Every rank ran every step: the same all-reduces (1 embedding + 2 per layer per forward pass) on each.
    assert len({s["num_all_reduces"] for s in stats}) == 1 and stats[0]["num_all_reduces"] > 0
    assert stats[0]["num_all_reduces"] % (1 + 2 * TINY.num_hidden_layers) == 0


def test_a_memory_budget_buys_tp_times_the_blocks_while_ranks_split_the_kv_heads():
    budget = 4 << 20
    blocks = {tp: EngineArgs(kv_cache_memory_bytes=budget, tensor_parallel_size=tp).resolved_num_gpu_blocks(
        TINY, 512, torch.float32) for tp in (1, 2, 4)}
    assert blocks[2] == 2 * blocks[1]            # 2 KV heads over 2 ranks: one each
    assert blocks[4] == blocks[2]                # 4 ranks, 2 KV heads: one each, replicated
    bytes_per_block = 2 * TINY.num_hidden_layers * 1 * TINY.head_dim * 4 * 16
    assert blocks[2] == budget // bytes_per_block




def test_smollm2_on_2_ranks_is_refused_with_vllms_message():
    from minillm import LLM

    with pytest.raises(ValueError, match=r"Total number of attention heads \(9\) must be divisible by tensor "
                                         r"parallel size \(2\)\."):
        LLM(max_model_len=256, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="the KV connector TorchDistributedConnector does not support "
                                         "tensor_parallel_size > 1"):
        EngineArgs(tensor_parallel_size=2, kv_transfer_config={"kv_connector": "TorchDistributedConnector",
                                                               "kv_role": "kv_producer"})


def test_one_worker_in_a_process_of_its_own_gives_the_same_tokens():
    """vLLM v0.33.0's CPU layout at one rank: ``distributed_executor_backend="mp"`` (what ``CpuPlatform.
    check_and_update_config`` turns "uni" into) runs the whole model in one worker process; same tokens as the worker
    in this process, and the process is gone after shutdown."""
    requests = workload(seed=3, seeded_sampling=True)
    args = CONFIGS["tight cache: preemption"]
    want = run(engine(1, **args), requests)
    eng = engine(1, distributed_executor_backend="mp", **args)
    try:
        assert isinstance(eng.model_executor, MultiprocExecutor) and eng.model_executor.world_size == 1
        (pid,) = rank_pids(eng)
        assert pid != os.getpid() and psutil.Process(pid).is_running()
        assert run(eng, requests) == want
        assert eng.stats.num_preemptions > 0
    finally:
        eng.shutdown()
    assert wait_gone(pid), f"the worker process {pid} outlived shutdown()"


def test_executor_backend_is_checked():
    assert EngineArgs().resolved_distributed_executor_backend() == "uni"
    assert EngineArgs(tensor_parallel_size=2).resolved_distributed_executor_backend() == "mp"
    assert EngineArgs(distributed_executor_backend="mp").resolved_distributed_executor_backend() == "mp"
    with pytest.raises(ValueError, match=r"distributed_executor_backend must be one of \('uni', 'mp'\) or None, "
                                         r"got 'ray'"):
        EngineArgs(distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 'mp'"):
        EngineArgs(distributed_executor_backend="uni", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="TorchDistributedConnector does not support tensor_parallel_size > 1 or "
                                         "worker processes"):
        EngineArgs(distributed_executor_backend="mp", kv_transfer_config={
            "kv_connector": "TorchDistributedConnector", "kv_role": "kv_producer"})


def _connector_stats(worker) -> dict[str, int]:
    """Run on each rank by ``collective_rpc``: that rank's connector counters (each rank has its own worker side)."""
    return dict(worker.model_runner.kv_connector.stats)


def _storage(path, role: str, **extra) -> dict:
    return {"kv_connector": extra.pop("kv_connector", "SharedStorageConnector"), "kv_role": role,
            "kv_connector_module_path": extra.pop("module_path", None),
            "kv_connector_extra_config": {"shared_storage_path": str(path), **extra}}


def test_a_kv_connector_runs_on_every_rank_whatever_the_tp_sizes(tmp_path):
    """Chapter 9's connector through files, on 4 ranks that each hold one of the tiny model's 2 KV heads (each head
    on 2 ranks): a save all-gathers one replica of each head, a load keeps each rank's own; the files are one
    process's, so engines of different tensor-parallel sizes share them."""
    prompts = [list(range(1 + i, 23 + 3 * i)) for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    # No prefix cache: the second pass must load from the files, not hit the engine's own blocks.
    args = dict(block_size=4, num_gpu_blocks=120, max_model_len=128, max_num_batched_tokens=16,
                enable_chunked_prefill=True, enable_prefix_caching=False)
    model = tiny_model()

    def make(tp: int, path, role: str) -> LLMEngine:
        return LLMEngine(model, None, EngineArgs(tensor_parallel_size=tp, kv_transfer_config=_storage(path, role),
                                                 **args))

    def requests(tag: str) -> list:
        return [(f"{tag}-{i}", p, greedy) for i, p in enumerate(prompts)]

    one = make(1, tmp_path / "tp1", "kv_producer")
    reference = run_requests(one, requests("req"))      # one process: the tokens, and the files
    one.shutdown()
    four = make(4, tmp_path / "tp4", "kv_both")         # saves what it computes, loads what is there
    try:
        first = run_requests(four, requests("first"))    # nothing stored yet: computed, then saved
        second = run_requests(four, requests("second"))  # the same prompts: loaded from the files
        stats = four.model_executor.collective_rpc(_connector_stats)
        external = four.stats.num_external_prompt_tokens
    finally:
        four.shutdown()
    assert [first[f"first-{i}"] for i in range(4)] == [second[f"second-{i}"] for i in range(4)] == \
        [reference[f"req-{i}"] for i in range(4)]
    assert len(stats) == 4 and all(s == stats[0] for s in stats)  # every rank saved and loaded its share
    assert (stats[0]["saved_requests"], stats[0]["loaded_requests"], stats[0]["failed_loads"]) == (4, 4, 0)
    assert external == sum(len(p) - 1 for p in prompts)
    # What 4 ranks stored is what one process stores: every KV head once, the same numbers to fp32 rounding (the
    # ranks sum the projections' partial products in another order). And one process decodes from it.
    for key in (prompt_key(p) for p in prompts):
        for layer in range(TINY.num_hidden_layers):
            ref, got = (safetensors.torch.load_file(str(tmp_path / d / key / f"layer_{layer}.safetensors"))["kv"]
                        for d in ("tp1", "tp4"))
            assert ref.shape[0] == 2 and ref.shape[2:] == (TINY.num_key_value_heads, TINY.head_dim)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    decode = make(1, tmp_path / "tp4", "kv_consumer")
    assert run_requests(decode, requests("req")) == reference
    assert decode.stats.num_external_prompt_tokens == sum(len(p) - 1 for p in prompts)
    decode.shutdown()


def test_ranks_agree_on_a_load_that_failed_on_one_of_them(tmp_path):
    """A load that fails on rank 1 only must fail on every rank (only rank 0's report reaches the scheduler): the
    request recomputes, and the tokens stay right."""
    prompts = [list(range(3, 30))]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    args = dict(block_size=4, num_gpu_blocks=80, max_model_len=128)
    reference = run_requests(engine(1, **args), [("req-0", prompts[0], greedy)])
    model = tiny_model()
    prefill = LLMEngine(model, None, EngineArgs(kv_transfer_config=_storage(tmp_path, "kv_producer"), **args))
    decode = LLMEngine(model, None, EngineArgs(tensor_parallel_size=2, **args, kv_transfer_config=_storage(
        tmp_path, "kv_consumer", kv_connector="OneRankFailsToLoadConnector", module_path="tests.engine.kv_faults",
        fail_rank=1)))
    try:
        assert prefill_then_decode(prefill, decode, prompts, greedy) == reference
        stats = decode.model_executor.collective_rpc(_connector_stats)
        assert [s["failed_loads"] for s in stats] == [1, 1] and [s["loaded_requests"] for s in stats] == [0, 0]
    finally:
        prefill.shutdown()
        decode.shutdown()


def _rank_plus(worker, extra: int = 0) -> tuple[int, int]:
    """Run by ``collective_rpc`` on each rank (module-level: it travels by name): the worker comes first, as in
    vLLM's ``run_method``."""
    return worker.rank + extra, len(worker.model_runner.kv_caches)


def check_collective_rpc(ex) -> None:
    """``collective_rpc`` runs a function on every worker (or one), and refuses in the caller what cannot travel."""
    assert ex.collective_rpc(_rank_plus, (10,)) == [(10, TINY.num_hidden_layers), (11, TINY.num_hidden_layers)]
    assert ex.collective_rpc(_rank_plus, kwargs={"extra": 5}, unique_reply_rank=1)[0] == 6
    for bad, match in [("no_such_method", "Worker has no method 'no_such_method'"),
                       (lambda worker: 0, "module-level function"), (42, "module-level function")]:
        with pytest.raises(ValueError, match=match):
            ex.collective_rpc(bad)
    with pytest.raises(ValueError, match=r"unique_reply_rank must be None or an int in \[0, 2\), got 2"):
        ex.collective_rpc("describe", unique_reply_rank=2)
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0, got 0"):
        ex.collective_rpc("describe", timeout_s=0)
    assert not ex.is_failed and [d["rank"] for d in ex.collective_rpc("describe")] == [0, 1]  # still serving


def test_collective_rpc_runs_a_function_in_process_too():
    one = engine(1, num_gpu_blocks=40, block_size=4, max_model_len=64)
    assert one.model_executor.collective_rpc(_rank_plus, (10,)) == [(10, TINY.num_hidden_layers)]
    one.shutdown()


def test_a_killed_rank_gives_engine_dead_error_naming_it_within_10_seconds():
    eng = engine(2, max_num_batched_tokens=64, num_gpu_blocks=200, block_size=4)
    pids = rank_pids(eng)
    killed_at: list[float] = []

    def kill_soon():
        time.sleep(0.5)
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    threading.Thread(target=kill_soon, daemon=True).start()
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    try:
        with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {pids[1]}\) died with exit code -9"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # one request after another, so the kill lands mid-step
                eng.add_request(f"r{time.monotonic_ns()}", list(range(1, 40)), long)
                while eng.has_unfinished_requests():
                    eng.step()
        assert time.monotonic() - killed_at[0] < 10.0
        with pytest.raises(EngineDeadError):  # and every later step
            eng.model_executor.execute_model(eng.last_scheduler_output)
    finally:
        eng.shutdown()
    assert all(wait_gone(pid) for pid in pids)


def test_a_killed_rank_reaches_llm_through_the_engine_core_process():
    """The ranks are children of the engine-core process: a dead one ends the core, and the caller hears which."""
    eng = LLMEngine(tiny_model(), None, EngineArgs(tensor_parallel_size=2, block_size=4, num_gpu_blocks=200,
                                                   max_num_batched_tokens=64), multiprocess_mode=True)
    core = psutil.Process(eng.engine_core.proc.pid)
    ranks = [p for p in core.children() if p.name() != "resource_tracker"
             and "resource_tracker" not in " ".join(p.cmdline())]
    assert len(ranks) == 2, [p.cmdline() for p in core.children()]
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    killed_at: list[float] = []

    def kill_soon():
        time.sleep(0.5)
        killed_at.append(time.monotonic())
        ranks[1].kill()

    threading.Thread(target=kill_soon, daemon=True).start()
    try:
        with pytest.raises(EngineDeadError, match=r"worker rank \d \(pid \d+\) died with exit code -9"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                eng.add_request(f"r{time.monotonic_ns()}", list(range(1, 40)), long)
                while eng.has_unfinished_requests():
                    eng.step()
        assert time.monotonic() - killed_at[0] < 10.0
    finally:
        eng.shutdown()
    assert all(wait_gone(p.pid) for p in [core, *ranks])


def test_a_rank_stuck_in_a_collective_times_out_with_a_clear_error():
    model = tiny_model()
    # The plan of one step, made by an engine's own scheduler: it is the same SchedulerOutput at any
    # tensor-parallel size, so a one-process engine makes it without starting two ranks only to stop them.
    eng = LLMEngine(model, None, EngineArgs(block_size=4, num_gpu_blocks=40, max_model_len=64))
    eng.add_request("a", list(range(1, 20)), SamplingParams(temperature=0.0, max_tokens=4))
    so = eng.scheduler.schedule()
    eng.shutdown()
    executor = MultiprocExecutor(2, Worker, dict(model=model, block_size=4, max_model_len=64),
                                 timeout_s=3.0, error_cls=EngineDeadError)
    executor.initialize_from_config([KVCacheConfig(num_blocks=40)] * 2)  # what the engine core decides at start-up
    pids = [p.pid for p in executor.procs]
    try:
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 never reaches the first all-reduce
        start = time.monotonic()
        # Two timers of timeout_s race, the group's (gloo: "Timed out waiting 3000ms for recv ...") and the wait's
        # (c10d: "Operation timed out!"); either may fire first, so the match ignores the case.
        with pytest.raises(EngineDeadError, match=r"rank 0 failed: CollectiveError: rank 0: embed_tokens of \(19, 64\) "
                                                  r"(failed: RuntimeError: .*(?i:timed out)|did not complete)"):
            executor.execute_model(so)
        assert time.monotonic() - start < 10
        assert executor.alive_ranks == []  # the failure ended both ranks, the stopped one too
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)
        executor.shutdown()
    assert all(wait_gone(pid) for pid in pids)


def test_no_rank_outlives_del_or_shutdown():
    eng = engine(2, num_gpu_blocks=40, block_size=4, max_model_len=64)
    pids = rank_pids(eng)
    del eng
    gc.collect()
    assert all(wait_gone(pid) for pid in pids), "deleting the engine must stop its ranks"
    eng = engine(2, num_gpu_blocks=40, block_size=4, max_model_len=64)
    pids = rank_pids(eng)
    check_collective_rpc(eng.model_executor)  # on this engine, rather than start one more
    eng.shutdown()
    assert all(wait_gone(pid) for pid in pids)
    with pytest.raises(EngineDeadError, match="shut down"):
        eng.model_executor.collective_rpc("describe")


def test_the_benchmark_counts_what_the_formula_says():
    """bench/tensor_parallel.py on the tiny model: every rank all-reduced exactly the formula's bytes, in one call
    per all-reduce of every step, and the tokens equal one process's."""
    from minillm.course.benchmarks.tensor_parallel import run_one

    model = tiny_model()
    prompts = [list(range(1, 9 + 3 * i)) for i in range(4)]
    one, two = (run_one(model, None, tp, prompts, max_tokens=5, rpc_rounds=5) for tp in (1, 2))
    assert two["tokens"] == one["tokens"] and len(one["tokens"]) == 4
    assert two["all_reduce_bytes_per_rank"] == [two["expected_all_reduce_bytes"]] * 2
    assert two["all_reduces_per_rank"] == [two["expected_all_reduces"]] * 2
    assert two["plan_bytes_max"] >= two["plan_bytes_mean"] > 0 and two["rpc_round_trip_us"] > 0
