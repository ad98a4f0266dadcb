"""Per-step input-build time: ``prepare_inputs`` over the request states against the runner's build from its slots.

Run from the repository root (under a minute on 2 cores)::

    python bench/input_build.py
    python bench/input_build.py --num-requests 64 --reps 9

The workload is bench/throughput.py's (:func:`minillm.course.benchmarks.throughput.make_workload`: 32 requests, random
prompts of 30-400 tokens, outputs of 8-96 tokens, greedy), served by a real :class:`LLMEngine` with chunked prefill
and the default token budget. The model is a random 2-layer Llama with SmolLM2's vocabulary: only the inputs are
timed, and they do not depend on the model's size. At every step, on the same runner state, it times

- **old**: :func:`~minillm.worker.model_runner.prepare_inputs` (exercise 6.1's reference): fresh arrays from the
  :class:`CachedRequestState` of every scheduled request, a Python loop over the requests;
- **slots**: ``ModelRunner.prepare_inputs`` (Model Runner V2) building the step's
  :class:`~minillm.worker.input_batch.InputBatch` by index from the :class:`~minillm.worker.states.RequestState`
  slots with the input kernels of ``kernels/input_batch.py`` and ``kernels/block_table.py`` (their PyTorch
  formulation on a CPU);
- **upkeep**: the runner's ``finish_requests``, ``add_requests`` and ``update_requests`` of that step (the writes
  into the slots that the build by index reads).

Each build runs ``--reps`` times per step and its fastest run counts (the least disturbed by the machine's other
load); the table gives the median over steps, by kind of step. The two builds are checked equal, request by request,
at every step.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from minillm.config import LlamaConfig  # noqa: E402
from minillm.course.benchmarks.throughput import make_workload  # noqa: E402
from minillm.engine.arg_utils import EngineArgs  # noqa: E402
from minillm.engine.llm_engine import LLMEngine  # noqa: E402
from minillm.model.llama import LlamaForCausalLM  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402
from minillm.worker.model_runner import prepare_inputs  # noqa: E402

SMALL = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                    eos_token_id=None, bos_token_id=None)


def _fastest_us(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def measure(num_requests: int, reps: int, block_size: int) -> list[dict]:
    """Serve the workload; one record per step: its kind, size and the three times (µs)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(SMALL).eval()
    workload = make_workload(num_requests)
    lens = zip(workload.prompts, workload.output_lens, strict=True)
    blocks = sum(-(-(len(p) + n) // block_size) for p, n in lens) + 1
    engine = LLMEngine(model, None, EngineArgs(block_size=block_size, num_gpu_blocks=blocks, max_model_len=1024,
                                               max_num_seqs=num_requests))
    runner = engine.model_runner
    records: list[dict] = []

    def timed(name):
        method = getattr(runner, name)

        def run(so):
            t0 = time.perf_counter()
            method(so)
            if name == "finish_requests":
                records.append({"upkeep": 0.0})
            records[-1]["upkeep"] += (time.perf_counter() - t0) * 1e6
        return run

    build = runner.prepare_inputs

    def timed_prepare(so):
        rec = records[-1]
        old = lambda: prepare_inputs(so, runner.request_views(so.num_scheduled_tokens), runner.block_size,  # noqa: E731
                                     runner.device)
        got, want = build(so), old()
        gq, wq = got.query_start_loc.tolist(), want.query_start_loc.tolist()
        for b, rid in enumerate(got.req_ids):
            w = want.req_ids.index(rid)
            for name in ("input_ids", "positions", "slot_mapping"):
                assert torch.equal(getattr(got, name)[gq[b]:gq[b + 1]], getattr(want, name)[wq[w]:wq[w + 1]])
            assert torch.equal(got.block_table[b], want.block_table[w])
        rec["old"], rec["new"] = _fastest_us(old, reps), _fastest_us(lambda: build(so), reps)
        rec["reqs"], rec["tokens"] = len(so.num_scheduled_tokens), so.total_num_scheduled_tokens
        rec["kind"] = "decode" if so.total_num_scheduled_tokens == rec["reqs"] else "prefill+decode"
        return got

    for name in ("finish_requests", "add_requests", "update_requests"):
        setattr(runner, name, timed(name))
    runner.prepare_inputs = timed_prepare
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return [r for r in records if "old" in r]


def table(records: list[dict]) -> str:
    rows = [("steps", "kind", "reqs/step", "tokens/step", "old µs", "slots µs", "speed-up", "upkeep µs")]
    for kind in ("prefill+decode", "decode", "all"):
        rs = [r for r in records if kind in ("all", r["kind"])]
        if not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in ("reqs", "tokens", "old", "new", "upkeep")}
        rows.append((str(len(rs)), kind, f"{med['reqs']:.0f}", f"{med['tokens']:.0f}", f"{med['old']:.0f}",
                     f"{med['new']:.0f}", f"{med['old'] / med['new']:.2f}x", f"{med['upkeep']:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5, help="timed runs of each build per step (the fastest counts)")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.reps < 1 or args.block_size < 1:
        raise ValueError(f"--num-requests, --reps and --block-size must be >= 1, got {args.num_requests}, "
                         f"{args.reps}, {args.block_size}")
    torch.set_num_threads(1)  # the builds are small single-threaded ops; keep the model's threads off the other core
    t0 = time.perf_counter()
    records = measure(args.num_requests, args.reps, args.block_size)
    print(f"input build per step, {args.num_requests} requests (bench/throughput.py's workload), block size "
          f"{args.block_size}, median over steps of the fastest of {args.reps} runs:")
    print(table(records))
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
