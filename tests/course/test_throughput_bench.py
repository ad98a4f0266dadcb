"""The throughput benchmark: its workload, its FLOP count, a tiny run of every peer, and one in bf16."""
from __future__ import annotations

import argparse

import pytest
import torch

from minillm.course.benchmarks.throughput import (OUTPUT_LENS, format_report, make_workload, measure_matmul_flops,
                                           run_benchmark, workload_flops)
from minillm.config import LlamaConfig
from tests.engine_helpers import single_thread  # noqa: F401


def test_workload_is_seeded_and_in_range():
    a, b = make_workload(seed=3), make_workload(seed=3)
    assert a == b and a != make_workload(seed=4)
    assert len(a.prompts) == 32 and all(30 <= len(p) <= 400 for p in a.prompts)
    assert set(a.output_lens) <= set(OUTPUT_LENS) and len(set(a.output_lens)) > 1
    with pytest.raises(ValueError, match="min_prompt <= max_prompt"):
        make_workload(min_prompt=50, max_prompt=10)


def test_workload_flops_by_hand():
    """One request, a 3-token prompt and 2 outputs: 3 prompt tokens and 1 fed-back token through every layer,
    causal attention over 1+2+3 keys then 4 keys, the LM head on the 2 sampled rows."""
    cfg = LlamaConfig()
    w = make_workload(1, 3, 3, (2,), seed=0)
    hs, kv, inter, heads_dim = 576, 3 * 64, 1536, 9 * 64
    per_token = 2 * (hs * heads_dim + 2 * hs * kv + heads_dim * hs + 3 * hs * inter)
    attention = 2 * 2 * heads_dim * ((1 + 2 + 3) + 4)
    expected = 30 * (4 * per_token + attention) + 2 * 2 * hs * cfg.vocab_size
    assert workload_flops(cfg, w) == expected


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_tiny_benchmark_run(smollm, hf_oracle):
    """In-process: every request is in before the first step, so the forward passes compared below are exact (with
    the core in its own process they depend on when each request reaches it; tests/course/test_engine_core_bench.py runs
    that path)."""
    w = make_workload(3, 8, 20, (2, 3), seed=1)
    peers = ("minillm", "minillm-ngram", "hf-padded", "hf-batch", "roofline")
    # One round: the rounds are tested below, on the cheaper peers.
    report = run_benchmark(w, peers, model=smollm[0], tokenizer=smollm[1], hf_model=hf_oracle,
                           matmul_seconds=0.2, multiprocess=False)
    tps = report["tokens_per_second"]
    assert report["repeat"] == 1
    assert set(tps) == set(peers) and all(v > 0 for v in tps.values())
    for ours in ("minillm", "minillm-ngram"):
        for peer in ("hf-padded", "hf-batch"):
            same = report[f"greedy_{ours}_vs_{peer}"]
            assert same["real_divergences"] == 0 and same["identical"] + same["near_tie_divergences"] == 3, same
    text = format_report(report)
    assert "minillm reaches" in text and "minillm-ngram reaches" in text and "hf-batch" in text
    passes = report["forward_passes"]
    assert passes["minillm-ngram"] <= passes["minillm"] and "forward passes: minillm" in text


@pytest.mark.usefixtures("single_thread")
def test_tiny_bf16_run_is_at_one_precision(smollm, hf_oracle):
    """Every peer and the roofline run in the model's dtype, and the report says which and on what CPU; a
    transformers model in another dtype is refused (peers compare at equal precision)."""
    from tests.dtype_helpers import bf16_copy

    model, hf = bf16_copy(smollm[0]), bf16_copy(hf_oracle)
    w = make_workload(2, 8, 12, (2, 3), seed=2)
    report = run_benchmark(w, ("minillm", "hf-padded", "roofline"), model=model, tokenizer=smollm[1], hf_model=hf,
                           matmul_seconds=0.1, repeat=2)
    assert report["repeat"] == 2  # interleaved rounds, each system keeping its fastest
    assert report["dtype"] == "bfloat16" and report["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    same = report["greedy_minillm_vs_hf-padded"]
    assert same["real_divergences"] == 0 and same["identical"] + same["near_tie_divergences"] == 2, same
    text = format_report(report)
    assert "dtype: bfloat16" in text and "GFLOP/s in bfloat16" in text
    with pytest.raises(ValueError, match="one precision"):
        run_benchmark(w, ("minillm", "hf-padded"), model=model, tokenizer=smollm[1], hf_model=hf_oracle)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_roofline_is_measured_in_the_dtype_asked_for(dtype, monkeypatch):
    """Every matmul timed is of the model's projection shapes in ``dtype``, and the result is the FLOPs of one round
    over the fastest round's seconds (a clock that gives rounds of 0.25 s and then 0.5 s)."""
    from types import SimpleNamespace

    import minillm.course.benchmarks.throughput as throughput

    cfg = LlamaConfig()
    calls, mm = [], torch.mm

    def recording_mm(a, b):
        calls.append((a.dtype, b.dtype, tuple(a.shape), tuple(b.shape)))
        return mm(a, b)

    ticks = iter([0.0, 0.0, 0.25, 0.3, 0.3, 0.8, 2.0])  # start; round 1 (0.25 s); not over; round 2 (0.5 s); over
    monkeypatch.setattr(torch, "mm", recording_mm)
    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    best = measure_matmul_flops(cfg, seconds=1.0, rows=16, dtype=dtype)
    h, i, qkv = 576, 1536, (9 + 2 * 3) * 64  # SmolLM2-135M: hidden, intermediate, q + k + v features
    one_round = [((16, h), (h, i)), ((16, i), (i, h)), ((16, h), (h, qkv))]
    assert calls == [(dtype, dtype, a, b) for a, b in one_round * 2]
    assert best == 2 * 16 * (h * i + i * h + h * qkv) / 0.25


def test_cli_dtype_choices():
    from minillm.course.benchmarks.throughput import add_cli_args

    parser = add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args([]).dtype == "auto"  # bf16 where the CPU has it (tests/engine/test_serving_dtype.py)
    assert parser.parse_args(["--dtype", "float32"]).dtype == "float32"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float16"])


def test_llama_cpp_peer_is_skipped_without_a_build(smollm, tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    w = make_workload(1, 4, 4, (1,), seed=0)
    report = run_benchmark(w, ("minillm", "llama.cpp"), model=smollm[0], tokenizer=smollm[1],
                           llama_cpp_bin=str(tmp_path))
    assert set(report["tokens_per_second"]) == {"minillm"} and "no build found" in report["skipped"]["llama.cpp"]
    assert "llama.cpp: skipped, no build found" in format_report(report)


@pytest.mark.usefixtures("single_thread")
def test_llama_cpp_peer_at_bf16_when_built(smollm, hf_oracle):
    """Only where a llama.cpp build is found (see minillm/course/benchmarks/llama_cpp.py for how to make one)."""
    from minillm.course.benchmarks.llama_cpp import find_llama_cpp
    from tests.dtype_helpers import bf16_copy

    if find_llama_cpp() is None:
        pytest.skip("no llama.cpp build ($LLAMA_CPP_BIN or llama-server on PATH)")
    w = make_workload(3, 8, 20, (2, 3), seed=1)
    report = run_benchmark(w, ("minillm", "llama.cpp"), model=bf16_copy(smollm[0]), tokenizer=smollm[1],
                           hf_model=bf16_copy(hf_oracle))
    assert report["tokens_per_second"]["llama.cpp"] > 0 and report["dtype"] == "bfloat16"
    assert report["greedy_minillm_vs_llama.cpp"]["real_divergences"] == 0, report["greedy_minillm_vs_llama.cpp"]
