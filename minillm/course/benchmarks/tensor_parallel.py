"""Tensor parallelism inside the engine, measured in one run: what each rank sends, what the plan costs to
broadcast, and step time and throughput at each ``tensor_parallel_size``.

For each size the same workload (greedy, the same prompts) runs through an in-process ``LLMEngine`` (so the
executor can be asked what its ranks did). Reported:

- per rank: all-reduce calls and payload bytes, against the formula of chapter 9
  (:func:`~minillm.distributed.tensor_parallel.expected_all_reduce_bytes` over every token the steps scheduled);
- the step's plan as it crosses to the ranks: pickled bytes of each ``SchedulerOutput`` (mean, max), and the round
  trip of an empty call to every rank (broadcast + one answer each; median of many);
- step time (median) and output tokens per second; the greedy tokens must equal those of one process.

On a CPU of 2 cores more ranks cannot be faster: three processes share two cores, and every layer waits twice for
the slowest rank. What tensor parallelism buys on GPUs (memory per device, bandwidth per token) is printed after
the measurements, on paper: :func:`~minillm.course.analysis.tp_arithmetic.where_tp_pays`, a roofline of one decode
step of Llama-3.1-70B and of SmolLM2 on 1 to 8 H100s, with the datasheet's bandwidths.
"""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from typing import Any

import torch

PROMPT = ("The river town woke slowly. Fishermen pulled their boats onto the gravel, counted the night's catch and "
          "argued about the weather, as they had every morning for forty years.")


def _workload(tokenizer: Any, num_requests: int) -> list[list[int]]:
    base = tokenizer.encode(PROMPT)
    return [base[: 8 + (7 * i) % (len(base) - 8)] + tokenizer.encode(f" Day {i}.") for i in range(num_requests)]


def run_one(model: Any, tokenizer: Any, tp: int, prompts: list[list[int]], max_tokens: int,
            rpc_rounds: int = 50) -> dict[str, Any]:
    """The workload on ``tp`` ranks: tokens, step times, plan bytes, and (``tp > 1``) the ranks' collectives."""
    from minillm.distributed.tensor_parallel import expected_all_reduce_bytes, expected_num_all_reduces
    from minillm.engine.arg_utils import EngineArgs
    from minillm.engine.llm_engine import LLMEngine
    from minillm.sampling_params import SamplingParams

    start = time.perf_counter()
    engine = LLMEngine(model, tokenizer, EngineArgs(tensor_parallel_size=tp, max_model_len=512,
                                                    max_num_batched_tokens=256))
    startup_s = time.perf_counter() - start
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        step_s, plan_bytes = [], []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outputs = engine.step()
            step_s.append(time.perf_counter() - t)
            plan_bytes.append(len(pickle.dumps(engine.last_scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)))
            for out in outputs:
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        total_s = time.perf_counter() - start
        result: dict[str, Any] = {
            "tp": tp, "startup_s": startup_s, "total_s": total_s, "num_steps": len(step_s),
            "median_step_ms": 1e3 * statistics.median(step_s),
            "output_tok_per_s": sum(map(len, tokens.values())) / total_s,
            "plan_bytes_mean": statistics.fmean(plan_bytes), "plan_bytes_max": max(plan_bytes),
            "scheduled_tokens": engine.stats.num_scheduled_tokens, "tokens": tokens,
        }
        if tp > 1:
            executor = engine.model_executor
            ranks = executor.collective_rpc("describe")
            rtt = []
            for _ in range(rpc_rounds):
                t = time.perf_counter()
                executor.collective_rpc("check_health")
                rtt.append(time.perf_counter() - t)
            cfg = model.config
            # Every forward pass (one per step) all-reduces the embedding and twice per layer, [tokens, hidden].
            result.update(
                rpc_round_trip_us=1e6 * statistics.median(rtt),
                all_reduce_bytes_per_rank=[r["bytes_all_reduced"] for r in ranks],
                all_reduces_per_rank=[r["num_all_reduces"] for r in ranks],
                expected_all_reduce_bytes=expected_all_reduce_bytes(
                    cfg, engine.stats.num_scheduled_tokens, tp, torch.empty((), dtype=model.dtype).element_size()),
                expected_all_reduces=expected_num_all_reduces(cfg, tp) * engine.stats.num_steps,
                kv_cache_bytes_per_rank=[r["kv_cache_bytes"] for r in ranks],
                param_bytes_per_rank=[r["param_bytes"] for r in ranks])
        return result
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3], help="tensor_parallel_size values (1 first)")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="PyTorch threads, shared out among the ranks")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    import minillm

    torch.set_num_threads(args.threads)
    model, tokenizer = minillm.load_model()
    prompts = _workload(tokenizer, args.num_requests)
    results = [run_one(model, tokenizer, tp, prompts, args.max_tokens) for tp in args.tp]
    base = results[0]
    print(f"{len(prompts)} requests, {args.max_tokens} tokens each, {args.threads} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    for r in results:
        same = r["tokens"] == base["tokens"]
        print(f"tp={r['tp']}: start {r['startup_s']:.1f} s, {r['num_steps']} steps, median step "
              f"{r['median_step_ms']:.1f} ms, {r['output_tok_per_s']:.1f} tok/s "
              f"({r['output_tok_per_s'] / base['output_tok_per_s']:.2f}x tp={base['tp']}), same tokens: {same}; "
              f"plan {r['plan_bytes_mean']:.0f} B mean, {r['plan_bytes_max']} B max")
        if r["tp"] > 1:
            print(f"      all-reduce per rank {r['all_reduce_bytes_per_rank']} B in {r['all_reduces_per_rank']} calls; "
                  f"formula {r['expected_all_reduce_bytes']} B in {r['expected_all_reduces']}; empty call to every "
                  f"rank {r['rpc_round_trip_us']:.0f} us; KV cache per rank {r['kv_cache_bytes_per_rank'][0]} B, "
                  f"weights {r['param_bytes_per_rank'][0]} B")
    print()
    from minillm.course.analysis.tp_arithmetic import where_tp_pays

    where_tp_pays()
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in results], f, indent=1)
