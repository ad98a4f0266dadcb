"""Every GPU number of the course in one prepared run: ``make gpu-report OUT=dir`` (or ``python3 bench/gpu_report.py
--out dir``).

Made for the GPU machine as it is: ``python3`` with its own torch, Triton, transformers and numpy, no registry, the
working tree copied in (the model package does not travel). It runs from the tree (``PYTHONPATH``), installs
nothing from a registry, reads no model file, and writes ``report.md`` and ``report.json`` to ``--out``. msgspec (the
engine's message types) is the one package such a machine may lack: ``make gpu-wheels`` puts its wheel in ``.whl/``
on a machine with PyPI, and the report installs it from there with ``--no-index``.

Sections, each in a process of its own under its own time limit (a failure or a timeout is reported and the
others run): ``environment`` (GPU, versions, copy bandwidth, a bf16 matmul), ``kernels`` (``unified_attention`` and
``reshape_and_cache`` against the reference in fp16 and bf16), ``input_kernels`` (Model Runner V2's input kernels
against their PyTorch references: ``tests/kernels/test_input_kernels.py`` on the GPU), ``attention``
(``bench/attention.py``'s table against SDPA's flash backend), ``engine_smollm2`` and ``engine_llama8b`` (the engine
on CUDA with random weights in a real model's shape: greedy tokens against transformers, throughput against
transformers' padded ``generate``, async scheduling on and off, one decode step's achieved memory bandwidth).

Without a GPU every section runs a small CPU configuration (the kernels in Triton's interpreter at tiny shapes, the
engine on the tiny model in fp32): the dry run that ``make test`` runs, so the harness works before a GPU sees it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Wheels carried to a machine with no registry (make gpu-wheels), installed here with --no-index.
WHEELS = ROOT / ".whl"
SITE = Path("/tmp/minillm-gpu-report-site")
# Set to a section's name, that section raises (FAIL) or hangs (HANG) on purpose: the tests that a failing or a
# hung section is reported and the others still run.
FAIL_ENV = "MINILLM_GPU_REPORT_FAIL"
HANG_ENV = "MINILLM_GPU_REPORT_HANG"


@dataclass(frozen=True)
class Section:
    title: str
    gpu_limit_s: int  # the time limits add up to under 8 minutes on a GPU
    cpu_limit_s: int
    run: Callable[[bool], dict[str, Any]]  # (cuda) -> {"tables": [markdown], "data": {...}, "ok": bool, "notes": [...]}


# -- helpers --------------------------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; floats with three significant digits."""
    def cell(x: Any) -> str:
        if isinstance(x, float):
            return "nan" if math.isnan(x) else f"{x:.3g}"
        return str(x)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


# -- environment ----------------------------------------------------------------------------------------------------
def section_environment(cuda: bool) -> dict[str, Any]:
    import torch
    import transformers
    import triton

    from bench.attention import copy_bandwidth_gbs

    data: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "triton": triton.__version__, "transformers": transformers.__version__,
                            "cuda": torch.version.cuda, "machine": platform.machine()}
    if cuda:
        data["device"] = torch.cuda.get_device_name()
        props = torch.cuda.get_device_properties(0)
        data["memory_gib"] = round(props.total_memory / 2**30, 1)
        data["multiprocessors"] = props.multi_processor_count
        try:
            data["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            data["driver"] = f"unknown ({e})"
        data["copy_gbs"] = copy_bandwidth_gbs(2 << 30, "cuda")
        n, dtype = 8192, torch.bfloat16
    else:
        data["device"] = platform.processor() or "cpu"
        data["copy_gbs"] = copy_bandwidth_gbs(64 << 20, "cpu")
        n, dtype = 512, torch.float32
    dev = "cuda" if cuda else "cpu"
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    for _ in range(3):
        a @ b
    _sync(cuda)
    reps = 10
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(cuda)
    data["matmul_tflops"] = 2 * n**3 * reps / (time.perf_counter() - start) / 1e12
    data["matmul"] = f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')}"
    rows = [[k, data[k]] for k in ("device", "driver", "memory_gib", "multiprocessors", "python", "torch", "cuda",
                                   "triton", "transformers", "copy_gbs", "matmul", "matmul_tflops") if k in data]
    return {"ok": True, "data": data, "tables": [_table(["what", "value"], rows)],
            "notes": ["copy_gbs: bytes read + written by one large copy; matmul_tflops: the mean of ten products "
                      "after three warm-ups"]}


# -- kernels --------------------------------------------------------------------------------------------------------
# Absolute tolerances against an fp32 reference computed from the same inputs (tests/kernels/test_kernels.py says
# why): fp16 2e-3, about twice the measured error, most of it the output's rounding (half an fp16 ulp, 2^-11 x |out|
# with |out| < 4). bf16 keeps 3 bits fewer: its half ulp at |out| in [2, 4) is 2^-7 ~ 7.8e-3, so 1.6e-2 is the same
# margin. fp32 (the CPU dry run): 1e-4, summation order only.
KERNEL_ATOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-4}


def _kernel_cases(cuda: bool) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query lengths, context lengths) per request."""
    if cuda:
        return {"prefill": ([1000], [0]), "chunked prefill": ([512, 333], [700, 64]),
                "decode": ([1] * 16, [100 + 97 * i for i in range(16)]),
                "mixed varlen": ([700, 1, 45, 1, 130, 1], [0, 2000, 300, 15, 1024, 1])}
    return {"prefill": ([20], [0]), "chunked prefill": ([9, 5], [13, 4]), "decode": ([1] * 3, [5, 16, 23]),
            "mixed varlen": ([11, 1, 6], [0, 17, 9])}


def section_kernels(cuda: bool) -> dict[str, Any]:
    import torch

    import kernels
    from kernels.testing import make_paged_batch, paged_reference_attention

    dev = "cuda" if cuda else "cpu"
    heads, kv_heads, head_dim, block_size = (32, 8, 128, 16) if cuda else (4, 2, 16, 4)
    dtypes = [torch.float16, torch.bfloat16] if cuda else [torch.float32, torch.float16]
    rows, ok = [], True
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for case, (query_lens, context_lens) in _kernel_cases(cuda).items():
            g = torch.Generator(device=dev).manual_seed(0)
            b = make_paged_batch(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype=dtype,
                                 device=dev, generator=g)
            # reshape_and_cache: write this step's K/V over garbage and read them back at their slots.
            num_tokens = sum(query_lens)
            k_new = torch.randn(num_tokens, kv_heads, head_dim, device=dev, generator=g).to(dtype)
            v_new = torch.randn(num_tokens, kv_heads, head_dim, device=dev, generator=g).to(dtype)
            kernels.reshape_and_cache(k_new, v_new, b.key_cache, b.value_cache, b.slot_mapping)
            slots = b.slot_mapping.long()
            kc = b.key_cache.view(-1, kv_heads, head_dim)[slots]
            vc = b.value_cache.view(-1, kv_heads, head_dim)[slots]
            cache_exact = bool(torch.equal(kc, k_new) and torch.equal(vc, v_new))
            out = kernels.unified_attention(b.q, b.key_cache, b.value_cache, b.query_start_loc, b.seq_lens,
                                            b.block_table, max(query_lens), max(b.seq_lens_list))
            ref = paged_reference_attention(b.q.float(), b.key_cache.float(), b.value_cache.float(),
                                            b.query_start_loc, b.seq_lens, b.block_table)
            err = float((out.float() - ref.float()).abs().max())
            passed = cache_exact and err <= KERNEL_ATOL[name]
            ok &= passed
            rows.append([name, case, len(query_lens), num_tokens, max(b.seq_lens_list), "exact" if cache_exact
                         else "WRONG", err, KERNEL_ATOL[name], "pass" if passed else "FAIL"])
    table = _table(["dtype", "batch", "requests", "new tokens", "longest seq", "reshape_and_cache",
                    "attention max abs err", "tolerance", "result"], rows)
    return {"ok": ok, "data": {"rows": rows, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                               "block_size": block_size, "interpreted": kernels.INTERPRETED},
            "tables": [table], "notes": [f"{heads} query heads over {kv_heads} KV heads, head_dim {head_dim}, "
                                         f"block size {block_size}; reference: fp32 PyTorch over the same inputs"]}


# -- Model Runner V2's input kernels --------------------------------------------------------------------------------
def section_input_kernels(cuda: bool) -> dict[str, Any]:
    """tests/kernels/test_input_kernels.py with the kernels on the GPU: each Triton kernel equals its PyTorch
    reference (exactly: integer indexing) on hypothesis's random batches, and the worked examples."""
    import re

    # No plugins loaded from entry points: the file needs only hypothesis, and a machine's other plugins (nbval here)
    # may import what it lacks.
    env = dict(os.environ, MINILLM_KERNEL_TEST_DEVICE="cuda" if cuda else "cpu", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    # --noconftest: the suite's conftest files load notebook plugins this machine may not have; the file needs none.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
                           "-o", "addopts=", str(ROOT / "tests" / "kernels" / "test_input_kernels.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = next((line for line in reversed(proc.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
                   proc.stdout[-300:] or proc.stderr[-300:])
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", summary)}
    ok = proc.returncode == 0 and counts.get("passed", 0) > 0
    rows = [[k, v] for k, v in counts.items()] or [["result", summary]]
    notes = [f"pytest: {summary.strip('= ')}"]
    if not ok:
        notes.append("output tail: " + (proc.stdout[-1500:] + proc.stderr[-1500:]).replace("\n", " / "))
    return {"ok": ok, "data": {"counts": counts, "returncode": proc.returncode, "device": env[
        "MINILLM_KERNEL_TEST_DEVICE"]}, "tables": [_table(["tests", "count"], rows)], "notes": notes}


# -- attention benchmark --------------------------------------------------------------------------------------------
def section_attention(cuda: bool) -> dict[str, Any]:
    import bench.attention as attention

    if cuda:
        lines: list[str] = []
        rows, bandwidth = attention.run(quick=False, out=lines.append)
    else:  # the harness at tiny shapes, kernel in the interpreter: times say nothing about a GPU
        bandwidth = attention.copy_bandwidth_gbs(64 << 20, "cpu")
        rows = [attention.measure(1, 16, 16, 64, device="cpu"), attention.measure(2, 1, 31, 64, device="cpu")]
    prefill = [[r.query, r.context, r.head_dim, r.kernel_rate, r.sdpa_rate, r.ratio, "yes" if r.ratio >= 0.5
                else "NO", r.max_abs_diff] for r in rows if r.kind == "prefill"]
    decode = [[r.batch, r.context + 1, r.kernel_rate, r.sdpa_rate, r.kernel_rate / bandwidth, r.ratio,
               "yes" if r.kernel_rate / bandwidth >= 0.5 else "NO", r.max_abs_diff] for r in rows if r.kind == "decode"]
    tables = [_table(["query", "context", "head_dim", "kernel TFLOP/s", "SDPA TFLOP/s", "kernel / SDPA",
                      ">= 0.5x SDPA", "max abs diff"], prefill),
              _table(["batch", "keys per request", "kernel GB/s", "SDPA GB/s", "fraction of copy bandwidth",
                      "SDPA time / kernel time", ">= 50 % of bandwidth", "max abs diff"], decode)]
    # The goals are reported, not enforced: a kernel slower than its goal is a finding, not a harness failure.
    ok = all(r.max_abs_diff < 2e-2 for r in rows)
    return {"ok": ok, "data": {"copy_gbs": bandwidth, "rows": [r.__dict__ for r in rows]}, "tables": tables,
            "notes": [f"copy bandwidth in the same run: {bandwidth:.0f} GB/s; fp16, 32 query heads over 8 KV heads; "
                      f"SDPA's flash backend on a GPU; goals from bench/attention.py"]}


# -- the engine -----------------------------------------------------------------------------------------------------
# Real models' shapes, filled with random weights from a seed (nothing downloaded, nothing carried). Llama-3.1-8B's
# config without its "llama3" RoPE scaling, which minillm does not implement: the shape (and so the bytes moved and
# the FLOPs) is Llama-3.1-8B's; positions stay under 8192, where that scaling changes only the low frequencies.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                    max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-5),
}
# The CPU dry run: chapter 10's tiny model's shape (minillm/course/exercises/ch10/tiny.py).
TINY_SHAPE = dict(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
                  tie_word_embeddings=True, rms_norm_eps=1e-5)


def _random_models(shape: dict[str, Any], dtype: Any, device: str, seed: int = 0) -> tuple[Any, Any]:
    """transformers' ``LlamaForCausalLM`` with its own random initialisation from ``seed``, and minillm's model
    holding the same weights (loaded through minillm's Hugging Face loader, so the name mapping is tested too)."""
    import torch
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from minillm.loaders.gguf_loader import _load_state
    from minillm.loaders.hf_loader import config_from_hf
    from minillm.model.llama import LlamaForCausalLM

    hf_config = HFLlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype: 8B in fp32 first would need 32 GB
    try:
        with torch.device(device):
            hf = HFLlama(hf_config).eval()
    finally:
        torch.set_default_dtype(before)
    with torch.device("meta"):
        ours = LlamaForCausalLM(config_from_hf(hf_config.to_dict()))
    ours.to_empty(device=device)
    _load_state(ours, dict(hf.state_dict()), dtype)  # assign=True: the two models share the weight tensors
    return hf, ours.eval()


def _tie_gap(best_logit: float, dtype: Any) -> float:
    """How close two logits must be for rounding to pick either: four ulps of the best logit in bf16 (0.5 for
    logits in [16, 32), the gap minillm/course/benchmarks/throughput.py measured for the real model), 1e-4 in
    fp32. Random weights give logits of another scale than a trained model's, hence a gap relative to it."""
    import torch

    from minillm.course.benchmarks.throughput import TIE_GAPS

    if dtype == torch.float32:
        return TIE_GAPS[torch.float32]
    return 4 * 2.0 ** (math.floor(math.log2(max(abs(best_logit), 1e-3))) - 7)


def _greedy_against_transformers(hf: Any, ours: Any, prompts: list[list[int]], max_tokens: int, dtype: Any,
                                 device: str, engine_args: dict[str, Any]) -> dict[str, Any]:
    """minillm's greedy tokens (one engine, all prompts) against transformers' ``generate`` on each prompt alone;
    the first divergence of each prompt classified by transformers' unpadded logits there."""
    import torch

    from minillm.course.benchmarks.throughput import Workload, run_minillm

    workload = Workload(prompts, [max_tokens] * len(prompts))
    mine = run_minillm(ours, None, workload, multiprocess=False, **engine_args).tokens
    identical = ties = real = 0
    gaps: list[float] = []
    with torch.inference_mode():
        for prompt, a in zip(prompts, mine, strict=True):
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
            b = out[0, len(prompt):].tolist()
            if a == b:
                identical += 1
                continue
            i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            if i is None:  # one a prefix of the other: a length bug, never rounding
                real += 1
                continue
            logits = hf(torch.tensor([prompt + a[:i]], device=device)).logits[0, -1].float()
            best = float(logits.max())
            gap = _tie_gap(best, dtype)
            if best - float(logits[a[i]]) < gap and best - float(logits[b[i]]) < gap:
                ties += 1
                gaps.append(round(abs(float(logits[a[i]]) - float(logits[b[i]])), 6))
            else:
                real += 1
    return {"prompts": len(prompts), "tokens_each": max_tokens, "identical": identical, "near_ties": ties,
            "real_divergences": real, "tie_gaps": gaps}


def _decode_bandwidth(ours: Any, cuda: bool, engine_args: dict[str, Any], num_reqs: int, prompt_len: int,
                      steps: int) -> dict[str, Any]:
    """One decode step's achieved memory bandwidth: (weights + the K/V every request reads) / step time, over
    ``steps`` decode steps of ``num_reqs`` requests of ``prompt_len`` prompt tokens."""
    import torch

    from minillm.engine.arg_utils import EngineArgs
    from minillm.engine.llm_engine import LLMEngine
    from minillm.sampling_params import SamplingParams

    engine = LLMEngine(ours, None, EngineArgs(**{**engine_args, "async_scheduling": False}), multiprocess_mode=False)
    try:
        g = torch.Generator().manual_seed(1)
        vocab = ours.config.vocab_size
        for r in range(num_reqs):
            prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
            engine.add_request(f"bw{r}", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 8,
                                                                ignore_eos=True))
        prefilled: set[str] = set()
        while len(prefilled) < num_reqs:  # every prompt prefilled: each has its first token
            prefilled.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
        for _ in range(2):  # warm-up decode steps
            engine.step()
        cfg = ours.config
        kv_bytes_per_token = cfg.kv_cache_bytes_per_token(ours.dtype.itemsize)  # the cache follows the model
        weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
        times, kv_read = [], []
        for s in range(steps):
            context = prompt_len + 3 + s  # the prompt, the first token, two warm-up tokens, then this step's
            _sync(cuda)
            start = time.perf_counter()
            engine.step()
            _sync(cuda)
            times.append(time.perf_counter() - start)
            kv_read.append(num_reqs * context * kv_bytes_per_token)
        best = min(range(steps), key=lambda k: times[k])
        median = sorted(times)[steps // 2]
        nbytes = weight_bytes + kv_read[best]
    finally:
        engine.shutdown()
    return {"requests": num_reqs, "context": prompt_len, "weight_bytes": weight_bytes,
            "kv_bytes_read": kv_read[best], "best_step_ms": 1e3 * times[best], "median_step_ms": 1e3 * median,
            "achieved_gbs": nbytes / times[best] / 1e9}


def _engine_section(name: str, cuda: bool) -> dict[str, Any]:
    import torch

    from bench.attention import copy_bandwidth_gbs
    from minillm.course.benchmarks.throughput import make_workload, run_hf_batch, run_hf_padded, run_minillm

    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SHAPES[name] if cuda else TINY_SHAPE
    t0 = time.perf_counter()
    hf, ours = _random_models(shape, dtype, device)
    build_s = time.perf_counter() - t0
    vocab = shape["vocab_size"]
    low, high = (100, min(49000, vocab)) if cuda else (0, vocab)
    if cuda:
        greedy_w = make_workload(16, 20, 200, output_lens=(16,), seed=3, vocab=(low, high))
        workload = make_workload(32, 30, 400, seed=0, vocab=(low, high))  # bench/throughput.py's workload
        bw = dict(num_reqs=32, prompt_len=1024, steps=16)
    else:
        greedy_w = make_workload(4, 4, 20, output_lens=(6,), seed=3, vocab=(low, high))
        workload = make_workload(4, 5, 20, output_lens=(4, 8), seed=0, vocab=(low, high))
        bw = dict(num_reqs=2, prompt_len=16, steps=4)
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    max_model_len = max(2048, bw["prompt_len"] + 64) if cuda else 128
    blocks = sum(-(-(len(p) + n) // 16) + 1 for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    blocks = max(blocks, bw["num_reqs"] * (-(-(bw["prompt_len"] + bw["steps"] + 16) // 16) + 1)) + 16
    engine_args = dict(device=device, dtype=dtype, num_gpu_blocks=blocks, max_model_len=max(max_model_len, longest),
                       block_size=16, enable_prefix_caching=False)
    data: dict[str, Any] = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "build_seconds": build_s,
                            "attention_backend": "triton" if cuda else "torch"}
    notes = []

    greedy = _greedy_against_transformers(hf, ours, greedy_w.prompts, greedy_w.output_lens[0], dtype, device,
                                          {**engine_args, "async_scheduling": False})
    data["greedy"] = greedy

    runs = {}
    for label, async_on in (("minillm, async scheduling off", False), ("minillm, async scheduling on", True)):
        result = run_minillm(ours, None, workload, multiprocess=False, **engine_args, async_scheduling=async_on)
        runs[label] = result
    _sync(cuda)
    peer = run_hf_padded(hf, workload)
    _sync(cuda)
    base = peer.tokens_per_second
    throughput_rows = [[label, r.tokens_per_second, r.tokens_per_second / base, r.num_steps]
                       for label, r in runs.items()] + [["transformers padded generate", base, 1.0, peer.num_steps]]
    try:  # transformers' continuous batching (generate_batch's manager), where this transformers has it
        batch = run_hf_batch(hf, workload, timeout_s=30.0)
        throughput_rows.append(["transformers continuous batching", batch.tokens_per_second,
                                batch.tokens_per_second / base, "-"])
    except Exception as e:  # noqa: BLE001 - an optional peer: its absence is a note, not a failure
        notes.append(f"transformers' continuous batching did not run: {type(e).__name__}: {str(e)[:200]}")
    data["throughput"] = {"workload": {"requests": len(workload.prompts), "prompt_tokens": workload.num_prompt_tokens,
                                       "output_tokens": workload.num_output_tokens},
                          "rows": throughput_rows}
    same = sum(a == b for a, b in zip(runs["minillm, async scheduling off"].tokens,
                                      runs["minillm, async scheduling on"].tokens, strict=True))
    data["async_same_tokens"] = f"{same}/{len(workload.prompts)}"

    copy = copy_bandwidth_gbs(2 << 30 if cuda else 64 << 20, device)
    band = _decode_bandwidth(ours, cuda, engine_args, **bw)
    band["copy_gbs"] = copy
    band["fraction_of_copy"] = band["achieved_gbs"] / copy
    data["decode_bandwidth"] = band

    tables = [
        _table(["prompts", "tokens each", "identical", "near ties", "real divergences"],
               [[greedy["prompts"], greedy["tokens_each"], greedy["identical"], greedy["near_ties"],
                 greedy["real_divergences"]]]),
        _table(["system", "output tok/s", "vs transformers", "forward passes"], throughput_rows),
        _table(["requests", "prompt tokens", "weights GB", "K/V read GB", "best step ms", "median step ms",
                "achieved GB/s", "copy GB/s", "fraction"],
               [[band["requests"], band["context"], band["weight_bytes"] / 1e9, band["kv_bytes_read"] / 1e9,
                 band["best_step_ms"], band["median_step_ms"], band["achieved_gbs"], copy,
                 band["fraction_of_copy"]]]),
    ]
    notes.append(f"workload: {len(workload.prompts)} requests, {workload.num_prompt_tokens} prompt + "
                 f"{workload.num_output_tokens} output tokens, greedy, ignore_eos; the async on/off runs gave the "
                 f"same tokens for {data['async_same_tokens']} requests")
    notes.append("greedy: transformers' generate on each prompt alone is the oracle; a divergence is a near tie when "
                 "both tokens sit within four ulps of the best logit (bf16), else real")
    del hf, ours
    if cuda:
        torch.cuda.empty_cache()
    return {"ok": greedy["real_divergences"] == 0 and same == len(workload.prompts), "data": data,
            "tables": tables, "notes": notes}


def section_engine_smollm2(cuda: bool) -> dict[str, Any]:
    return _engine_section("smollm2", cuda)


def section_engine_llama8b(cuda: bool) -> dict[str, Any]:
    return _engine_section("llama8b", cuda)


SECTIONS: dict[str, Section] = {
    "environment": Section("The machine", 30, 30, section_environment),
    "kernels": Section("Kernels against the reference", 60, 60, section_kernels),
    "input_kernels": Section("Model Runner V2's input kernels against their references", 40, 30,
                             section_input_kernels),
    "attention": Section("unified_attention against SDPA", 100, 40, section_attention),
    "engine_smollm2": Section("The engine, SmolLM2-135M's shape, random weights", 90, 60, section_engine_smollm2),
    "engine_llama8b": Section("The engine, Llama-3.1-8B's shape, random weights", 150, 60, section_engine_llama8b),
}


# -- one section, in its own process ------------------------------------------------------------------------------
def run_section(name: str, out: Path, force_cpu: bool) -> int:
    import torch

    cuda = torch.cuda.is_available() and not force_cpu
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    started = time.perf_counter()
    try:
        if os.environ.get(FAIL_ENV) == name:
            raise RuntimeError(f"{name} failed on purpose ({FAIL_ENV}={name})")
        if os.environ.get(HANG_ENV) == name:
            time.sleep(3600)
        result = SECTIONS[name].run(cuda)
        result["status"] = "ok" if result.get("ok", False) else "failed"
    except Exception as e:  # noqa: BLE001 - reported in the section, the next section runs
        result = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    result["seconds"] = time.perf_counter() - started
    result["cuda"] = cuda
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


def _ensure_msgspec(env: dict[str, str]) -> str | None:
    """msgspec importable by the sections, from ``.whl/`` if need be; a note when it was installed or is missing."""
    try:
        import msgspec  # noqa: F401
        return None
    except ImportError:
        pass
    wheels = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    if not wheels:
        return "msgspec is missing and .whl/ holds no wheel (make gpu-wheels): the engine sections will fail"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(SITE), *map(str, wheels)], check=True)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), env["PYTHONPATH"]])
    return f"installed from .whl/ with --no-index: {', '.join(w.name for w in wheels)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for report.md and report.json")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections (default: all of "
                        f"{', '.join(SECTIONS)})")
    parser.add_argument("--cpu", action="store_true", help="the CPU dry run even where a GPU is present")
    parser.add_argument("--limits", default="", help="override time limits, e.g. attention=200,kernels=90 (s)")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.section:
        return run_section(args.section, args.out, args.cpu)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")

    limits: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in args.limits.split(","))):
        key, _, value = item.partition("=")
        if key not in SECTIONS or not value.isdigit() or int(value) < 1:
            parser.error(f"--limits wants name=seconds with a section of {list(SECTIONS)} and a positive whole "
                         f"number, got {item!r}")
        limits[key] = int(value)

    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    notes = [n for n in [_ensure_msgspec(env)] if n]
    mode = "GPU" if cuda else "CPU dry run (no GPU: tiny shapes, the kernels interpreted, the tiny model in fp32)"
    print(f"minillm gpu-report: {mode}; sections {', '.join(names)}; out {args.out}", flush=True)
    results: dict[str, Any] = {}
    start = time.perf_counter()
    for name in names:
        section = SECTIONS[name]
        limit = limits.get(name, section.gpu_limit_s if cuda else section.cpu_limit_s)
        print(f"[{time.perf_counter() - start:6.1f} s] {name}: {section.title} (limit {limit} s) ...", flush=True)
        (args.out / f"{name}.json").unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--out", str(args.out)]
        cmd += ["--cpu"] if args.cpu else []
        # A session of its own: on a timeout the section and anything it started (input_kernels' pytest) are killed.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            results[name] = {"status": "timeout", "error": f"did not finish within {limit} s",
                             "log_tail": (log or "")[-3000:]}
        else:
            path = args.out / f"{name}.json"
            if path.is_file():
                results[name] = json.loads(path.read_text())
            else:
                results[name] = {"status": "error", "error": f"the section's process exited {proc.returncode} "
                                 f"without a result", "log_tail": log[-3000:]}
        results[name]["title"] = section.title
        results[name]["limit_s"] = limit
        r = results[name]
        print(f"[{time.perf_counter() - start:6.1f} s] {name}: {r['status']}"
              + (f" ({r['error']})" if "error" in r else ""), flush=True)
    total = time.perf_counter() - start
    report = {"mode": "gpu" if cuda else "cpu-dry-run", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "seconds": total, "notes": notes, "sections": results}
    (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    md = format_markdown(report)
    (args.out / "report.md").write_text(md)
    print(md, flush=True)
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


def format_markdown(report: dict[str, Any]) -> str:
    lines = [f"# minillm GPU report ({report['mode']}, {report['date']}, {report['seconds']:.0f} s)", ""]
    lines += [f"- {n}" for n in report["notes"]]
    for name, r in report["sections"].items():
        lines += ["", f"## {r['title']} (`{name}`): {r['status']}, {r.get('seconds', float('nan')):.1f} s of "
                      f"{r['limit_s']} s", ""]
        if "error" in r:
            lines += [f"**{r['status']}**: {r['error']}", ""]
            tail = r.get("traceback") or r.get("log_tail") or ""
            if tail:
                lines += ["```", tail.strip()[-2000:], "```"]
        for t in r.get("tables", []):
            lines += [t, ""]
        lines += [f"- {n}" for n in r.get("notes", [])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
