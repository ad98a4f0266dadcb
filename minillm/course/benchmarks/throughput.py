"""Offline throughput: one seeded workload served by minillm and by its peers, in the same process, on the same machine.

The workload (the issue's): ``num_requests`` prompts of random token ids with lengths uniform in ``[min_prompt,
max_prompt]``, each asking for an output length drawn from ``output_lens``; greedy, EOS ignored, so every system must
produce exactly the same tokens. Measured, in one run:

- **minillm**: :class:`~minillm.entrypoints.llm.LLM` ``.generate`` on all requests at once (continuous batching,
  chunked prefill, paged KV cache).
- **hf-padded**: transformers ``generate`` on the whole batch, left-padded, run to the longest output (the classic
  static batch: short requests keep occupying their row until the longest one ends).
- **hf-batch**: transformers ``generate_batch``-style continuous batching (its ``ContinuousBatchingManager``), each
  request with its own ``max_new_tokens``.
- **llama.cpp**: its ``llama-server`` on an F32 or BF16 GGUF of the same weights, one slot per request, when a
  build is present (:mod:`minillm.course.benchmarks.llama_cpp` says how to build one offline); skipped otherwise.
- **roofline**: the matmul FLOPs the workload needs (every prompt token and every fed-back output token through the
  30 layers, causal attention, the LM head only on the rows that are sampled), divided by the matmul throughput
  measured on this machine in the same run, in the same dtype. No engine can beat it without skipping work.

Every system runs at one precision, ``--dtype``: ``auto`` (the default), what this CPU is built for
(:func:`minillm.platforms.cpu.preferred_cpu_dtype`: bf16 with AMX-BF16 or AVX512-BF16, several times fp32's matmul
speed there; fp32 elsewhere, where bf16 is emulated), ``float32`` (the lessons' dtype) or ``bfloat16``. The dtype and
why it was chosen are printed at start-up; the report names them and PyTorch's CPU capability.

Throughput is *useful* output tokens per second: the tokens each request asked for, ``sum(output_lens)``, over the
wall time; padding and tokens generated past a request's length do not count. Ratios between systems measured in
the same run are what to compare: absolute numbers move with the machine's load.

vLLM counterpart: ``vllm bench throughput`` (``vllm/benchmarks/throughput.py``), whose ``random`` dataset is the
same kind of workload.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minillm.config import LlamaConfig
from minillm.course.analysis.flops import layer_flops, lm_head_flops
from minillm.platforms.dtype import SERVING_DTYPE, resolve_dtype

OUTPUT_LENS = (8, 16, 32, 64, 96)
PEERS = ("minillm", "minillm-ngram", "hf-padded", "hf-batch", "llama.cpp", "roofline")
# What the "minillm-ngram" peer adds to the engine arguments: prompt-lookup speculative decoding.
NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@dataclass
class Workload:
    """Seeded requests: ``prompts[i]`` (token ids) wants exactly ``output_lens[i]`` tokens."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(num_requests: int = 32, min_prompt: int = 30, max_prompt: int = 400,
                  output_lens: tuple[int, ...] = OUTPUT_LENS, seed: int = 0, vocab: tuple[int, int] = (100, 49000)
                  ) -> Workload:
    """Random token-id prompts (ids in ``vocab``, clear of the special tokens) and output lengths, from ``seed``."""
    if num_requests < 1 or not 1 <= min_prompt <= max_prompt or not output_lens or min(output_lens) < 1:
        raise ValueError(f"need num_requests >= 1, 1 <= min_prompt <= max_prompt and positive output lengths, got "
                         f"{num_requests}, {min_prompt}, {max_prompt}, {output_lens}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(*vocab) for _ in range(rng.randint(min_prompt, max_prompt))] for _ in range(num_requests)]
    return Workload(prompts, [rng.choice(output_lens) for _ in range(num_requests)])


def workload_flops(config: LlamaConfig, workload: Workload) -> int:
    """Matmul FLOPs the workload needs at the least: each request's prompt as one causal chunk, then each output
    token but the last fed back as a one-token chunk, through every layer; the LM head on one row per output token
    (only sampled rows need logits)."""
    one_layer = 0
    for prompt, n_out in zip(workload.prompts, workload.output_lens, strict=True):
        one_layer += layer_flops(config, len(prompt), 0)["total"]
        for i in range(n_out - 1):
            one_layer += layer_flops(config, 1, len(prompt) + i)["total"]
    return one_layer * config.num_hidden_layers + lm_head_flops(config, workload.num_output_tokens)


def measure_matmul_flops(config: LlamaConfig, seconds: float = 2.0, rows: int = 512,
                         dtype: torch.dtype = torch.float32) -> float:
    """Best FLOP/s of matmuls of the model's own shapes (``rows`` tokens through the MLP and attention
    projections) in ``dtype``, the ceiling the engine's big prefill steps can reach at that precision (bf16 runs
    several times faster than fp32 on a CPU with AMX-BF16 or AVX512-BF16, slower on one without)."""
    h, i = config.hidden_size, config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    shapes = [(rows, h, i), (rows, i, h), (rows, h, qkv)]
    mats = [(torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)) for m, k, n in shapes]
    flops_per_round = sum(2 * m * k * n for m, k, n in shapes)
    best = 0.0
    end = time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        for a, b in mats:
            torch.mm(a, b)
        dt = time.perf_counter() - t
        best = max(best, flops_per_round / dt)
        if time.perf_counter() > end:
            return best


@dataclass
class PeerResult:
    """One timed run: wall seconds, and the CPU seconds this process spent (all its threads), which other
    processes on a busy machine do not inflate; ``num_steps`` is the number of forward passes where known."""

    name: str
    seconds: float
    output_tokens: int
    tokens: list[list[int]] = field(default_factory=list, repr=False)
    cpu_seconds: float = float("nan")
    num_steps: int | None = None
    acceptance_rate: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


@contextlib.contextmanager
def multiprocessing_switch(multiprocess: bool | None) -> Iterator[None]:
    """``MINILLM_ENABLE_V1_MULTIPROCESSING`` set to ``multiprocess`` while the block runs (``None``: left as it is),
    for building an ``LLM``, which reads it as vLLM's reads ``VLLM_ENABLE_V1_MULTIPROCESSING``."""
    name = "MINILLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(name)
    if multiprocess is not None:
        os.environ[name] = "1" if multiprocess else "0"
    try:
        yield
    finally:
        if multiprocess is not None:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before


def _cpu_seconds(core_pid: int | None) -> float:
    """CPU seconds used so far by this process and, when the engine core has its own, by that one too."""
    cpu = time.process_time()
    if core_pid is not None:
        import psutil

        times = psutil.Process(core_pid).cpu_times()
        cpu += times.user + times.system
    return cpu


def run_minillm(model: Any, tokenizer: Any, workload: Workload, multiprocess: bool | None = None,
                **engine_args: Any) -> PeerResult:
    """The workload through minillm's ``LLM``, greedy, each request its own ``max_tokens``.

    Args:
        multiprocess: the engine core in its own process (synchronous on a CPU, as vLLM v0.33.0 runs it there,
            unless ``engine_args`` ask for ``async_scheduling=True``); ``None``: ``LLM``'s default
            (``MINILLM_ENABLE_V1_MULTIPROCESSING``). ``cpu_seconds`` counts both processes' CPU time.
    """
    from minillm.engine.core_client import MPClient
    from minillm.entrypoints.llm import LLM
    from minillm.sampling_params import SamplingParams

    with multiprocessing_switch(multiprocess):
        llm = LLM(model, tokenizer=tokenizer, **engine_args)
    client = llm.llm_engine.engine_core
    core_pid = client.proc.pid if isinstance(client, MPClient) and client.proc is not None else None
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
        prompts = [{"prompt_token_ids": p} for p in workload.prompts]
        start, cpu = time.perf_counter(), _cpu_seconds(core_pid)
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds, cpu = time.perf_counter() - start, _cpu_seconds(core_pid) - cpu
        tokens = [o.outputs[0].token_ids for o in outs]
        assert [len(t) for t in tokens] == workload.output_lens
        stats = llm.llm_engine.stats
    finally:
        llm.shutdown()
    return PeerResult("minillm", seconds, workload.num_output_tokens, tokens, cpu_seconds=cpu,
                      num_steps=stats.num_steps,
                      acceptance_rate=stats.acceptance_rate if stats.num_draft_tokens else None)


@torch.inference_mode()
def run_hf_padded(hf_model: Any, workload: Workload, pad_token_id: int = 0) -> PeerResult:
    width = max(len(p) for p in workload.prompts)
    ids = torch.full((len(workload.prompts), width), pad_token_id, dtype=torch.long, device=hf_model.device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(workload.prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=ids.device)
        mask[i, width - len(p):] = 1
    start, cpu = time.perf_counter(), time.process_time()
    out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(workload.output_lens),
                            do_sample=False, eos_token_id=None, pad_token_id=pad_token_id)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = [out[i, width:width + n].tolist() for i, n in enumerate(workload.output_lens)]
    return PeerResult("hf-padded", seconds, workload.num_output_tokens, tokens, cpu_seconds=cpu,
                      num_steps=max(workload.output_lens))


@torch.inference_mode()
def run_hf_batch(hf_model: Any, workload: Workload, timeout_s: float = 1800.0) -> PeerResult:
    """transformers' continuous batching (the manager behind ``generate_batch``), per-request ``max_new_tokens``."""
    import logging

    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=None,
                              pad_token_id=0)
    # It warns that eos_token_id is unset: on purpose (ignore_eos, like the other systems).
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    cb_kwargs: dict[str, Any] = {}
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:  # an older transformers: its own sizing
        pass
    else:
        # Its paged cache sized to the workload, as minillm's engine is given num_gpu_blocks: left to itself it
        # takes most of the free memory and builds its step tensors for it, which on a CPU costs ~15 s inside the
        # timed run (the manager builds them at its first request), whatever the workload.
        page = 256
        pages = sum(-(-(len(p) + n) // page) for p, n in zip(workload.prompts, workload.output_lens, strict=True))
        cb_kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            page_size=page, num_blocks=pages + len(workload.prompts), max_batch_tokens=2048)
    manager = hf_model.init_continuous_batching(generation_config=config, **cb_kwargs)
    manager.start()  # allocates its paged cache; not timed, like building minillm's engine
    start = time.perf_counter()
    try:
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
               for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True))]
        results: dict[str, Any] = {}
        deadline = time.perf_counter() + timeout_s
        while len(results) < len(ids):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"transformers' continuous batching finished {len(results)}/{len(ids)} requests")
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
        seconds = time.perf_counter() - start  # stopping its thread is not timed, like building it
    finally:
        manager.stop(block=True)
    tokens = [list(results[rid].generated_tokens)[:n] for rid, n in zip(ids, workload.output_lens, strict=True)]
    return PeerResult("hf-batch", seconds, workload.num_output_tokens, tokens)


# Two logits closer than this are a tie that rounding in that dtype may break either way. fp32: 1e-4, far above
# its rounding (~1e-6 on logits of size 10-30). bf16 keeps 8 significant bits (a logit in [16, 32) is a multiple of
# 0.125) and rounds every layer's output: on the top-2 logits of 1,032 positions of tests/engine/test_bf16_oracle.py's
# prompts, minillm in bf16 sat a median 0.125 from transformers in bf16, 0.5 at the 99th percentile, 0.875 at most
# (transformers' bf16 from its own fp32: 0.09, 0.5, 0.76). So 0.5, four steps of that grid.
TIE_GAPS = {torch.float32: 1e-4, torch.bfloat16: 0.5}


@torch.inference_mode()
def compare_greedy(ours: list[list[int]], theirs: list[list[int]], hf_model: Any, workload: Workload,
                   tie_gap: float | None = None) -> dict[str, Any]:
    """Count identical sequences; at the first divergence, recompute transformers' logits there (unpadded, alone).

    It is a **near tie** if both tokens' logits are within ``tie_gap`` (default: :data:`TIE_GAPS` of the model's
    dtype) of the best logit, which rounding may then pick either way; a **peer divergence** if our token is the
    best and the peer's is not near it (the peer's own batch, padded or mixed, moved it off its unpadded logits);
    else a **real** divergence. ``tie_gaps`` lists the two tokens' logit gaps at the near ties. (In bf16 three or
    more logits are often exactly equal, so "the two best" of ``topk(2)`` would be an arbitrary pick among them.)
    """
    if tie_gap is None:
        if hf_model.dtype not in TIE_GAPS:
            raise ValueError(f"no near-tie gap measured for {hf_model.dtype} (only {sorted(map(str, TIE_GAPS))}); "
                             f"pass tie_gap")
        tie_gap = TIE_GAPS[hf_model.dtype]
    identical = ties = peer = real = 0
    gaps = []
    for prompt, a, b in zip(workload.prompts, ours, theirs, strict=False):
        if a == b:
            identical += 1
            continue
        i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        if i == min(len(a), len(b)):  # one is a prefix of the other: a length bug, not rounding
            real += 1
            continue
        logits = hf_model(torch.tensor([prompt + a[:i]])).logits[0, -1].float()
        best = float(logits.max())
        ours_below, theirs_below = best - float(logits[a[i]]), best - float(logits[b[i]])
        if ours_below < tie_gap and theirs_below < tie_gap:
            ties += 1
            gaps.append(round(abs(ours_below - theirs_below), 6))
        elif ours_below == 0:
            peer += 1
        else:
            real += 1
    return {"identical": identical, "near_tie_divergences": ties, "peer_divergences": peer,
            "real_divergences": real, "tie_gaps": gaps}


def load_hf_model(progress: bool = False, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own model of the course's GGUF file in ``dtype`` (the peer and the oracle), quietly by
    default."""
    import functools

    from transformers import AutoModelForCausalLM

    from minillm.loaders.model_path import default_model_path

    path = default_model_path()
    gguf_utils: Any  # the module whose tqdm is swapped during the load; None if transformers moved it
    try:  # transformers' GGUF conversion draws its own progress bar, ignoring its progress-bar switch
        gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:  # pragma: no cover
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None and not progress:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    if not progress:  # outside fp32 it warns that packed GGUF weights compute in fp32: they are unpacked here
        hf_logging.set_verbosity_error()
    try:
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar is not None:
            gguf_utils.tqdm = bar


def _found(llama_bin: Path | None) -> Path:
    assert llama_bin is not None, "llama.cpp runs only when a build was found"
    return llama_bin


def run_benchmark(workload: Workload, peers: tuple[str, ...] = PEERS, model: Any = None, tokenizer: Any = None,
                  hf_model: Any = None, engine_args: dict[str, Any] | None = None, matmul_seconds: float = 2.0,
                  log: Any = None, repeat: int = 1, dtype: str | torch.dtype | None = SERVING_DTYPE,
                  llama_cpp_bin: str | None = None, multiprocess: bool | None = None) -> dict[str, Any]:
    """Run the chosen peers on ``workload``; return tokens/s of each, the ratios and the greedy comparison.

    ``multiprocess`` is :func:`run_minillm`'s: ``None`` runs ``LLM``'s default, the engine core in its own process.
    There, ``generate`` sends its requests one by one while the core already steps (as vLLM's does), so the forward
    passes counted depend on when each request arrives; ``False`` counts them exactly (every request in before the
    first step).

    Every system runs at one precision: ``dtype`` (as ``EngineArgs.dtype`` takes it; default ``"auto"``, what this
    CPU is built for; ``None`` or ``"float32"``: fp32) when ``model`` is not given, else the given model's dtype.
    transformers is loaded in it, and the roofline's matmuls are measured in it. The ``llama.cpp`` peer is skipped
    (``report["skipped"]`` says why) when :func:`~minillm.course.benchmarks.llama_cpp.find_llama_cpp` finds no build.

    With ``repeat > 1`` the systems run in interleaved rounds (A, B, C, A, B, C, ...) and each keeps its fastest
    round: on a shared machine, load from other processes only ever slows a run down, so the best round is the
    closest to what the machine can do, and interleaving exposes every system to the same load.
    """
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a positive integer, got {repeat!r}")
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peer(s) {sorted(unknown)}; choose from {PEERS}")
    say = log or (lambda *a: None)
    from minillm.platforms.cpu import cpu_capability, native_bf16

    choice = resolve_dtype(dtype if model is None else model.dtype, "cpu")
    if model is None:
        import minillm

        model, tokenizer = minillm.load_model(dtype=choice.dtype)
    if hf_model is None and any(p.startswith("hf") for p in peers):
        hf_model = load_hf_model(dtype=model.dtype)
    if hf_model is not None and hf_model.dtype != model.dtype:
        raise ValueError(f"the peers must run at one precision: minillm's model is {model.dtype}, transformers' "
                         f"{hf_model.dtype}")
    skipped: dict[str, str] = {}
    llama_bin = None
    if "llama.cpp" in peers:
        from minillm.course.benchmarks.llama_cpp import find_llama_cpp, run_llama_cpp

        llama_bin = find_llama_cpp(llama_cpp_bin)
        if llama_bin is None:
            skipped["llama.cpp"] = "no build found (--llama-cpp-bin, $LLAMA_CPP_BIN or llama-server on PATH)"
            say(f"llama.cpp: skipped, {skipped['llama.cpp']}")
            peers = tuple(p for p in peers if p != "llama.cpp")
    results: dict[str, PeerResult] = {}
    report: dict[str, Any] = {"num_requests": len(workload.prompts), "prompt_tokens": workload.num_prompt_tokens,
                              "output_tokens": workload.num_output_tokens, "threads": torch.get_num_threads(),
                              "dtype": choice.name, "dtype_reason": choice.reason, "cpu_capability": cpu_capability(),
                              "cpu_native_bf16": native_bf16()}
    runners = {"minillm": lambda: run_minillm(model, tokenizer, workload, multiprocess, **(engine_args or {})),
               "minillm-ngram": lambda: run_minillm(model, tokenizer, workload, multiprocess,
                                                    **{**(engine_args or {}), "speculative_config": NGRAM_SPEC}),
               "hf-padded": lambda: run_hf_padded(hf_model, workload),
               "hf-batch": lambda: run_hf_batch(hf_model, workload),
               "llama.cpp": lambda: run_llama_cpp(_found(llama_bin), workload, model.dtype, torch.get_num_threads())}
    peak = 0.0
    for round_ in range(repeat):
        for name in (p for p in PEERS if p in peers):
            if name == "roofline":
                peak = max(peak, measure_matmul_flops(model.config, matmul_seconds, dtype=model.dtype))
                say(f"round {round_ + 1}: matmul {peak / 1e9:.1f} GFLOP/s (best so far)")
                continue
            r = runners[name]()
            say(f"round {round_ + 1}: {name} {r.tokens_per_second:.1f} tok/s")
            if name not in results or r.seconds < results[name].seconds:
                results[name] = r
    report["repeat"] = repeat
    report["skipped"] = skipped
    tps = {name: r.tokens_per_second for name, r in results.items()}
    if "roofline" in peers:
        flops = workload_flops(model.config, workload)
        tps["roofline"] = workload.num_output_tokens / (flops / peak)
        report.update(workload_gflop=flops / 1e9, matmul_gflops=peak / 1e9)  # matmuls in the workload's dtype
    report["tokens_per_second"] = tps
    report["seconds"] = {name: r.seconds for name, r in results.items()}
    for ours in ("minillm", "minillm-ngram"):
        if ours in tps:
            report[f"{ours}_over"] = {name: tps[ours] / v for name, v in tps.items() if not name.startswith("minillm")}
        for peer in ("hf-padded", "hf-batch", "llama.cpp"):
            if ours in results and peer in results and hf_model is not None:
                report[f"greedy_{ours}_vs_{peer}"] = compare_greedy(results[ours].tokens, results[peer].tokens,
                                                                     hf_model, workload)
    report["forward_passes"] = {name: r.num_steps for name, r in results.items() if name.startswith("minillm")}
    if "minillm-ngram" in results:
        report["ngram_acceptance_rate"] = results["minillm-ngram"].acceptance_rate
        report["ngram_spec"] = dict(NGRAM_SPEC)
    report["results"] = results
    return report


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=30)
    parser.add_argument("--max-prompt", type=int, default=400)
    parser.add_argument("--output-lens", type=str, default=",".join(map(str, OUTPUT_LENS)),
                        help="comma-separated output lengths to draw from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", type=str, default=",".join(PEERS), help=f"comma-separated subset of {PEERS}")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default=SERVING_DTYPE,
                        help=f"the precision of every system and of the roofline's matmuls (default {SERVING_DTYPE}: "
                             f"bfloat16 on a CPU with AMX-BF16 or AVX512-BF16, else float32; printed with the reason "
                             f"at start-up; float32 is the lessons' dtype, EngineArgs' and LLM's default)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="interleaved rounds; each system keeps its fastest (default 1)")
    parser.add_argument("--llama-cpp-bin", type=str, default=None,
                        help="directory with llama-server and llama-quantize (default: $LLAMA_CPP_BIN, then PATH; "
                             "without a build the llama.cpp peer is skipped)")
    parser.add_argument("--json", type=str, default=None, help="also write the report to this file")
    return parser


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> dict[str, Any]:
    """``python bench/throughput.py`` / ``python -m minillm bench``: run, print a table, return the report."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args is None:
        args = add_cli_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = make_workload(args.num_requests, args.min_prompt, args.max_prompt,
                             tuple(int(x) for x in args.output_lens.split(",")), args.seed)
    engine_args = {"block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "max_num_seqs": args.max_num_seqs}
    peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    print(f"dtype: {resolve_dtype(args.dtype, 'cpu')}", file=sys.stderr, flush=True)  # before the models load
    report = run_benchmark(workload, peers, engine_args=engine_args, repeat=args.repeat, dtype=args.dtype,
                           llama_cpp_bin=args.llama_cpp_bin, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in report.items() if k != "results"}, f, indent=2)
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"workload: {report['num_requests']} requests, {report['prompt_tokens']} prompt tokens, "
             f"{report['output_tokens']} output tokens; torch threads: {report['threads']}; "
             f"best of {report.get('repeat', 1)} round(s)",
             f"dtype: {report['dtype']} ({report['dtype_reason']}), every system and the roofline",
             f"CPU: torch capability {report['cpu_capability']}, bf16 instructions: "
             f"{report.get('cpu_native_bf16') or 'none'}"]
    lines.append(f"{'system':<15}{'tok/s':>10}{'minillm / it':>15}{'minillm-ngram / it':>20}")
    for name, v in report["tokens_per_second"].items():
        cells = [report.get(f"{ours}_over", {}).get(name) for ours in ("minillm", "minillm-ngram")]
        lines.append(f"{name:<15}{v:>10.1f}" + "".join(" " * w if c is None else f"{c:>{w}.2f}"
                                                       for c, w in zip(cells, (15, 20), strict=True)))
    tps = report["tokens_per_second"]
    for ours in ("minillm", "minillm-ngram"):
        if "roofline" in tps and ours in tps:
            lines.append(f"{ours} reaches {tps[ours] / tps['roofline']:.2f} of the roofline "
                         f"({report['workload_gflop']:.0f} GFLOP at {report['matmul_gflops']:.1f} GFLOP/s in "
                         f"{report['dtype']})")
    for name, why in report.get("skipped", {}).items():
        lines.append(f"{name}: skipped, {why}")
    if report.get("forward_passes"):
        lines.append("forward passes: " + ", ".join(f"{k} {v}" for k, v in report["forward_passes"].items()))
    if report.get("ngram_acceptance_rate") is not None:
        lines.append(f"minillm-ngram: {report['ngram_spec']}, {report['ngram_acceptance_rate']:.0%} of the drafts "
                     f"accepted")
    for ours in ("minillm", "minillm-ngram"):
        for peer in ("hf-padded", "hf-batch", "llama.cpp"):
            if f"greedy_{ours}_vs_{peer}" in report:
                lines.append(f"greedy tokens, {ours} vs {peer}: {report[f'greedy_{ours}_vs_{peer}']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
