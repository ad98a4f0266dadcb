"""Benchmark ``kernels.unified_attention`` against PyTorch SDPA (flash backend), measured in the same run.

Run on a machine with a CUDA GPU::

    python bench/attention.py            # the full table of the chapter-3 issue
    python bench/attention.py --quick    # a few rows (what notebook 03 runs)

Prefill: one request, ``query`` = 1k/4k/16k new tokens, context 0 or equal to the query, head dim 64 and 128, fp16,
32 query heads over 8 KV heads (GQA 4). Reported: TFLOP/s of useful work (only the (query, key) pairs the causal
mask keeps: ``4 * head_dim * num_heads * pairs``) and the ratio to SDPA's. Target: >= 0.5x SDPA.

Decode: ``batch`` requests of one new token each, context 1k-32k, head dim 128. Reported: GB/s of K/V read
(``2 * batch * context * num_kv_heads * head_dim * 2`` bytes), the fraction of the copy bandwidth measured on the
same GPU in the same run, and the ratio to SDPA's time. Target: >= 50% of the memory bandwidth.

Both sides read the same memory: the paged cache uses block ``r * blocks_per_req + i`` for block ``i`` of request
``r``, so the cache *is* a dense ``[batch, seq, kv_heads, head_dim]`` tensor that SDPA reads through a transposed
view (``[batch, kv_heads, seq, head_dim]``, head_dim contiguous). On a CPU the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE = 32, 8, 16
DTYPE = torch.float16


@dataclass
class Row:
    kind: str            # "prefill" or "decode"
    batch: int
    query: int
    context: int
    head_dim: int
    kernel_ms: float
    sdpa_ms: float
    kernel_rate: float   # TFLOP/s (prefill) or GB/s (decode)
    sdpa_rate: float
    max_abs_diff: float  # kernel vs SDPA output, a sanity check

    @property
    def ratio(self) -> float:
        """Kernel speed relative to SDPA (> 1: faster)."""
        return self.sdpa_ms / self.kernel_ms


def _paged_inputs(batch: int, query: int, context: int, head_dim: int, device: str = "cuda"):
    """Random q and a paged cache laid out so that it is also a dense [batch, seq, kv_heads, head_dim] tensor."""
    seq = context + query
    blocks_per_req = -(-seq // BLOCK_SIZE)
    padded = blocks_per_req * BLOCK_SIZE
    g = torch.Generator(device=device).manual_seed(0)
    dense_k = torch.randn(batch, padded, NUM_KV_HEADS, head_dim, device=device, dtype=DTYPE, generator=g)
    dense_v = torch.randn(batch, padded, NUM_KV_HEADS, head_dim, device=device, dtype=DTYPE, generator=g)
    key_cache = dense_k.view(batch * blocks_per_req, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    value_cache = dense_v.view(batch * blocks_per_req, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    block_table = torch.arange(batch * blocks_per_req, device=device, dtype=torch.int32).view(batch, blocks_per_req)
    q = torch.randn(batch * query, NUM_HEADS, head_dim, device=device, dtype=DTYPE, generator=g)
    query_start_loc = torch.arange(0, (batch + 1) * query, query, device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), seq, device=device, dtype=torch.int32)
    # SDPA's view of the same memory: [batch, heads, tokens, head_dim]
    sdpa_q = q.view(batch, query, NUM_HEADS, head_dim).transpose(1, 2)
    sdpa_k = dense_k[:, :seq].transpose(1, 2)
    sdpa_v = dense_v[:, :seq].transpose(1, 2)
    kernel_args = (q, key_cache, value_cache, query_start_loc, seq_lens, block_table, query, seq)
    return kernel_args, (sdpa_q, sdpa_k, sdpa_v)


def _sdpa_call(q, k, v, context: int):
    """SDPA restricted to its flash backend (on a GPU; a CPU has none, its default backend runs there); causal
    aligned bottom-right when there is a context."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    query = q.shape[2]
    if query == 1:  # decode: the one new token sees everything
        mask, causal = None, False
    elif context == 0:
        mask, causal = None, True
    else:
        mask, causal = causal_lower_right(query, k.shape[2]), False

    backends = [SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]

    def run():
        with sdpa_kernel(backends):
            return sdpa(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    return run


def _time_ms(fn, device: str = "cuda") -> float:
    """Median time of ``fn`` in ms, replayed from a CUDA graph so Python launch overhead (tens of microseconds,
    as long as a whole small decode) is not counted for either side; plain ``do_bench`` if capture fails. On a CPU
    (the dry run of ``bench/gpu_report.py``): the median of five calls by the wall clock."""
    import time

    import triton.testing

    if device != "cuda":
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * sorted(times)[2]

    try:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")
    except Exception:  # noqa: BLE001 - capture is an optimisation of the measurement, not a requirement
        return triton.testing.do_bench(fn, return_mode="median")


def measure(batch: int, query: int, context: int, head_dim: int, device: str = "cuda") -> Row:
    """Time the kernel and SDPA on one shape (median of repeated runs). ``device="cpu"`` runs the kernel in
    Triton's interpreter: it checks the harness, its times say nothing about speed."""
    import kernels

    kernel_args, (sq, sk, sv) = _paged_inputs(batch, query, context, head_dim, device=device)
    run_kernel = lambda: kernels.unified_attention(*kernel_args)  # noqa: E731
    run_sdpa = _sdpa_call(sq, sk, sv, context)
    out_kernel = run_kernel().view(batch, query, NUM_HEADS, head_dim)
    out_sdpa = run_sdpa().transpose(1, 2)
    diff = (out_kernel.float() - out_sdpa.float()).abs().max().item()
    kernel_ms = _time_ms(run_kernel, device)
    sdpa_ms = _time_ms(run_sdpa, device)
    if query > 1:
        pairs = batch * (query * context + query * (query + 1) // 2)
        work = 4 * head_dim * NUM_HEADS * pairs / 1e12  # TFLOP
        kind = "prefill"
    else:
        work = 2 * batch * (context + 1) * NUM_KV_HEADS * head_dim * DTYPE.itemsize / 1e9  # GB of K and V
        kind = "decode"
    return Row(kind, batch, query, context, head_dim, kernel_ms, sdpa_ms, work / (kernel_ms / 1e3),
               work / (sdpa_ms / 1e3), diff)


def copy_bandwidth_gbs(num_bytes: int = 2 << 30, device: str = "cuda") -> float:
    """Memory bandwidth as a large copy achieves it (bytes read + bytes written), in GB/s: device to device on a
    GPU, RAM to RAM on a CPU (pass a smaller ``num_bytes`` there)."""
    x = torch.empty(num_bytes // 2, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    if device == "cuda":
        import triton.testing

        ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    else:
        ms = _time_ms(lambda: y.copy_(x), device)
    return 2 * num_bytes / 1e9 / (ms / 1e3)


def prefill_shapes(quick: bool) -> list[tuple[int, int, int, int]]:
    """``(batch, query, context, head_dim)`` of the prefill rows."""
    queries = (1024, 4096) if quick else (1024, 4096, 16384)
    return [(1, q, c, d) for d in (64, 128) for q in queries for c in (0, q)]


def decode_shapes(quick: bool) -> list[tuple[int, int, int, int]]:
    """``(batch, 1, context, head_dim)`` of the decode rows (batch 1-256, context 1k-32k)."""
    pairs = [(1, 4096), (64, 4096)] if quick else [
        (1, 1024), (1, 8192), (1, 32768), (16, 4096), (16, 32768), (64, 1024), (64, 8192), (256, 1024),
        (256, 4096), (256, 32768)]
    return [(b, 1, c - 1, 128) for b, c in pairs]  # context c - 1 plus the new token: c keys per request


def _fits(batch: int, query: int, context: int, head_dim: int) -> bool:
    seq = context + query
    need = 2 * batch * (seq + BLOCK_SIZE) * NUM_KV_HEADS * head_dim * DTYPE.itemsize
    need += 3 * batch * query * NUM_HEADS * head_dim * DTYPE.itemsize  # q, two outputs
    free, _ = torch.cuda.mem_get_info()
    return need < 0.8 * free


def run(quick: bool = False, out=print) -> tuple[list[Row], float]:
    """Measure every shape; print a table through ``out``; return the rows and the copy bandwidth (GB/s)."""
    bandwidth = copy_bandwidth_gbs()
    out(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  copy bandwidth {bandwidth:.0f} GB/s")
    out(f"heads {NUM_HEADS} q / {NUM_KV_HEADS} kv, block size {BLOCK_SIZE}, {DTYPE}; SDPA = flash backend")
    rows: list[Row] = []
    out("\nprefill  query  context  head_dim  kernel TFLOP/s  SDPA TFLOP/s  ratio  target>=0.5  max|diff|")
    for shape in prefill_shapes(quick):
        if not _fits(*shape):
            out(f"         {shape[1]:>5}  {shape[2]:>7}  {shape[3]:>8}  skipped: not enough GPU memory")
            continue
        r = measure(*shape)
        rows.append(r)
        out(f"         {r.query:>5}  {r.context:>7}  {r.head_dim:>8}  {r.kernel_rate:>14.1f}  {r.sdpa_rate:>12.1f}"
            f"  {r.ratio:>5.2f}  {'yes' if r.ratio >= 0.5 else 'NO':>11}  {r.max_abs_diff:.1e}")
    out("\ndecode   batch  context  kernel GB/s  SDPA GB/s  %copy-bw  ratio  target>=50%  max|diff|")
    for shape in decode_shapes(quick):
        if not _fits(*shape):
            out(f"         {shape[0]:>5}  {shape[2] + 1:>7}  skipped: not enough GPU memory")
            continue
        r = measure(*shape)
        rows.append(r)
        frac = r.kernel_rate / bandwidth
        out(f"         {r.batch:>5}  {r.context + 1:>7}  {r.kernel_rate:>11.0f}  {r.sdpa_rate:>9.0f}"
            f"  {100 * frac:>7.0f}%  {r.ratio:>5.2f}  {'yes' if frac >= 0.5 else 'NO':>11}  {r.max_abs_diff:.1e}")
        torch.cuda.empty_cache()
    return rows, bandwidth


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA GPU: on a CPU the kernels run in Triton's interpreter, whose timings "
              "say nothing about GPU speed. Nothing was measured.")
        return 0
    run(quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
