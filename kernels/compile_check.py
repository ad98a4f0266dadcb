"""Compile the Triton kernels for a CUDA GPU on a machine without one, and report their resource use.

The interpreter accepts what the GPU compiler rejects (``tl.dot`` under 16, a loop variable that changes type), so
passing there does not prove compiling. Triton compiles for a named target on the CPU (MLIR, LLVM, the bundled
``ptxas``); this script does it with a real launch's argument specialisation and prints registers, spill bytes and
shared memory per configuration; exit status 1 if a kernel fails or needs more shared memory than the GPU has::

    python -m kernels.compile_check                 # sm_80 and sm_90, every configuration
    python -m kernels.compile_check --arch 90 --quick

vLLM counterpart: none; speed is measured on a GPU (``bench/attention.py``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any

SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def _reexec_compiled(argv: list[str]) -> int:
    """The kernels must be *defined* with the interpreter off; re-run this module in a child that says so."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return subprocess.call([sys.executable, "-m", "kernels.compile_check", *argv], env=env)


def _compile(fn, values: dict, pointer_types: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs, consts = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(values[name], float):
            signature[name] = "fp32"
        elif values[name] == 1:
            consts[name] = 1
            signature[name] = "constexpr"
        else:
            signature[name] = "i32"
            if values[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _resources(kernel) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) from the cubin, via the cuobjdump shipped with Triton."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    fields = dict(tok.split(":", 1) for line in text.splitlines() if "REG:" in line for tok in line.split()
                  if ":" in tok)
    return int(fields.get("REG", -1)), int(fields.get("STACK", -1))


def _attention_configs(quick: bool) -> list[tuple]:
    """``(dtype, num_heads, num_kv_heads, head_dim, max_query_len, num_seqs)`` shapes whose launch configuration
    :func:`kernels.unified_attention.choose_config` picks on a GPU."""
    shapes = [("fp16", 32, 8, 128, 4096, 1), ("fp16", 32, 8, 128, 1, 4)]  # prefill; decode with split-KV
    if not quick:
        shapes += [("fp16", 32, 8, 64, 4096, 1), ("fp16", 9, 3, 64, 512, 4), ("fp16", 9, 3, 64, 1, 256),
                   ("fp16", 6, 2, 80, 512, 2), ("bf16", 32, 8, 128, 4096, 1), ("fp32", 9, 3, 64, 64, 2)]
    return shapes


def _input_jobs(quick: bool) -> list[tuple]:
    """Jobs for the input-preparation kernels (``kernels/input_batch.py``, ``kernels/block_table.py``): a launch's
    pointer types and scalar values (a 4096-token model, 512 blocks per row, a 49152-token vocabulary, 3 drafts);
    ``post_update`` with and without its optional tensors (``None`` pointers compile to a different kernel)."""
    import importlib

    ib = importlib.import_module("kernels.input_batch")
    bt = importlib.import_module("kernels.block_table")
    i32, i64 = "*i32", "*i64"
    jobs: list[tuple] = []
    for ids in ["*i64"] + ([] if quick else ["*i32"]):
        jobs += [
            ("prepare_prefill_inputs", f"input_ids {ids[1:]}", ib._prepare_prefill_inputs_kernel,
             dict(all_token_ids_stride=4096),
             dict(input_ids_ptr=ids, idx_mapping_ptr=i64, query_start_loc_ptr=i32, all_token_ids_ptr=i32,
                  prefill_len_ptr=i32, num_computed_tokens_ptr=i32), dict(BLOCK=ib._BLOCK), 4, 3),
            ("combine_sampled_and_draft_tokens", f"input_ids {ids[1:]}, 3 drafts",
             ib._combine_sampled_and_draft_tokens_kernel, dict(last_sampled_stride=1, draft_tokens_stride=3),
             dict(input_ids_ptr=ids, idx_mapping_ptr=i64, last_sampled_tokens_ptr=i64, query_start_loc_ptr=i32,
                  seq_lens_ptr=i32, prefill_len_ptr=i32, draft_tokens_ptr=i64, cu_num_logits_ptr=i32,
                  logits_indices_ptr=i64), dict(BLOCK=4), 4, 3),
        ]
    jobs += [
        ("prepare_pos_seq_lens", "", ib._prepare_pos_seq_lens_kernel, {},
         dict(positions_ptr=i64, seq_lens_ptr=i32, idx_mapping_ptr=i64, query_start_loc_ptr=i32,
              num_computed_tokens_ptr=i32), dict(BLOCK=ib._BLOCK), 4, 3),
        ("get_num_sampled_and_rejected", "", ib._get_num_sampled_and_rejected_kernel, {},
         dict(num_sampled_ptr=i32, num_rejected_ptr=i32, seq_lens_ptr=i32, cu_num_logits_ptr=i32,
              idx_mapping_ptr=i64, prefill_len_ptr=i32), {}, 4, 3),
    ]
    post_ptrs = dict(idx_mapping_ptr=i64, num_computed_tokens_ptr=i32, last_sampled_tokens_ptr=i64,
                     output_bin_counts_ptr=i32, sampled_tokens_ptr=i64, num_sampled_ptr=i32, num_rejected_ptr=i32,
                     query_start_loc_ptr=i32, all_token_ids_ptr=i32, total_len_ptr=i32, draft_tokens_ptr=i64,
                     draft_tokens_out_ptr=i64)
    post_values = dict(last_sampled_stride=1, output_bin_counts_stride=49152, sampled_tokens_stride=4,
                       all_token_ids_stride=4096, draft_tokens_stride=3, draft_tokens_out_stride=3, num_spec=3)
    optional = ("output_bin_counts_ptr", "query_start_loc_ptr", "draft_tokens_ptr", "draft_tokens_out_ptr")
    jobs.append(("post_update", "k=3, bins, query_start_loc, drafts", ib._post_update_kernel, post_values, post_ptrs,
                 dict(HAS_BIN_COUNTS=True, HAS_QUERY_START_LOC=True, HAS_DRAFTS=True, BLOCK_K=4), 1, 3))
    jobs.append(("post_update", "k=0, none of them", ib._post_update_kernel,
                 dict(post_values, sampled_tokens_stride=1, output_bin_counts_stride=0, draft_tokens_stride=0,
                      draft_tokens_out_stride=0, num_spec=0),
                 {n: t for n, t in post_ptrs.items() if n not in optional},
                 dict(dict.fromkeys(optional), HAS_BIN_COUNTS=False, HAS_QUERY_START_LOC=False, HAS_DRAFTS=False,
                      BLOCK_K=1), 1, 3))
    jobs += [
        ("gather_block_tables", "512 blocks per row", bt._gather_block_tables_kernel,
         dict(block_table_stride=512, out_stride=512, max_blocks=512),
         dict(idx_mapping_ptr=i64, block_table_ptr=i32, num_blocks_ptr=i32, out_ptr=i32), dict(BLOCK=512), 4, 3),
        ("compute_slot_mappings", "block_size 16", bt._compute_slot_mappings_kernel,
         dict(block_table_stride=512, max_num_tokens=8192, pad_id=-1),
         dict(idx_mapping_ptr=i64, query_start_loc_ptr=i32, positions_ptr=i64, block_table_ptr=i32, out_ptr=i64),
         dict(KV_BLOCK_SIZE=16, BLOCK=bt._BLOCK), 4, 3),
    ]
    return jobs


def run(archs: list[int], quick: bool) -> int:
    import importlib

    import torch
    import triton

    # Any: this run swaps the module's _num_sms and hands choose_config a stand-in tensor (_FakeCuda).
    ua: Any = importlib.import_module("kernels.unified_attention")
    rc = importlib.import_module("kernels.reshape_and_cache")
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    failures = 0
    print(f"{'arch':>4}  {'kernel':<34} {'config':<44} {'regs':>4} {'stack':>5} {'smem KB':>7}")
    for arch in archs:
        jobs = []
        for dt, h, hkv, d, max_q, seqs in _attention_configs(quick):
            q = torch.empty(max_q * seqs, h, d, dtype=torch_dtype[dt], device="meta")
            # choose_config reads only shapes; pretend to be on a GPU with 132 SMs (an H100/H200)
            ua._num_sms = lambda device: 132
            cfg = ua.choose_config(_FakeCuda(q), seqs, hkv, 16, max_q, 8192, None, None, None)
            dp = max(16, triton.next_power_of_2(d))
            values = dict(qk_scale=0.1, num_seqs=seqs, num_heads=h, stride_q_tok=h * d, stride_q_head=d,
                          stride_q_dim=1, stride_o_tok=h * d, stride_o_head=d, stride_o_dim=1,
                          stride_kc_blk=16 * hkv * d, stride_kc_slot=hkv * d, stride_kc_head=d, stride_kc_dim=1,
                          stride_vc_blk=16 * hkv * d, stride_vc_slot=hkv * d, stride_vc_head=d, stride_vc_dim=1,
                          stride_bt_seq=513)
            ptrs = {n: "*i32" if n in ("block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr")
                    else "*fp32" if n.startswith("part_") else f"*{dt}"
                    for n in ua._unified_attention_kernel.arg_names if n.endswith("_ptr")}
            consts = dict(NUM_QUERIES_PER_KV=h // hkv, HEAD_DIM=d, HEAD_DIM_PADDED=dp, BLOCK_SIZE=16,
                          BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, TILE_SIZE=cfg.tile_size,
                          NUM_SEGMENTS=cfg.num_segments, DOT_PRECISION="ieee" if dt == "fp32" else "tf32")
            label = (f"{dt} H{h}/{hkv} D{d} M{cfg.block_m} T{cfg.tile_size} S{cfg.num_segments} "
                     f"w{cfg.num_warps}s{cfg.num_stages}")
            jobs.append(("unified_attention", label, ua._unified_attention_kernel, values, ptrs, consts,
                         cfg.num_warps, cfg.num_stages))
            if cfg.num_segments > 1:
                jobs.append(("reduce_segments", f"{dt} D{d} S{cfg.num_segments}", ua._reduce_segments_kernel,
                             dict(num_heads=h, stride_o_tok=h * d, stride_o_head=d, stride_o_dim=1),
                             {n: "*fp32" if n.startswith("part_") else f"*{dt}"
                              for n in ua._reduce_segments_kernel.arg_names if n.endswith("_ptr")},
                             dict(HEAD_DIM=d, HEAD_DIM_PADDED=dp, NUM_SEGMENTS=cfg.num_segments,
                                  SEGMENTS_PADDED=max(2, triton.next_power_of_2(cfg.num_segments))), 4, 3))
        for dt, hkv, d in [("fp16", 8, 128)] + ([] if quick else [("fp32", 3, 64), ("bf16", 2, 80)]):
            strides = dict(stride_k_tok=hkv * d, stride_k_head=d, stride_k_dim=1, stride_v_tok=hkv * d,
                           stride_v_head=d, stride_v_dim=1, stride_kc_blk=16 * hkv * d, stride_kc_slot=hkv * d,
                           stride_kc_head=d, stride_kc_dim=1, stride_vc_blk=16 * hkv * d, stride_vc_slot=hkv * d,
                           stride_vc_head=d, stride_vc_dim=1, num_tokens=1000)
            ptrs = {n: "*i64" if n == "slot_mapping_ptr" else f"*{dt}"
                    for n in rc._reshape_and_cache_kernel.arg_names if n.endswith("_ptr")}
            jobs.append(("reshape_and_cache", f"{dt} Hkv{hkv} D{d}", rc._reshape_and_cache_kernel, strides, ptrs,
                         dict(HEAD_DIM=d, ROW=hkv * d, ROW_PADDED=triton.next_power_of_2(hkv * d), BLOCK_T=4,
                              BLOCK_SIZE=16), 4, 3))
        jobs += _input_jobs(quick)
        for name, label, fn, values, ptrs, consts, warps, stages in jobs:
            try:
                k = _compile(fn, values, ptrs, consts, arch, warps, stages)
            except Exception as e:  # noqa: BLE001 - report every failure, then exit 1
                failures += 1
                print(f"{arch:>4}  {name:<34} {label:<44} FAILED: {type(e).__name__}: {str(e)[:300]}")
                continue
            regs, stack = _resources(k)
            smem = k.metadata.shared
            over = smem > SHARED_LIMIT.get(arch, 99 * 1024)
            failures += over
            print(f"{arch:>4}  {name:<34} {label:<44} {regs:>4} {stack:>5} {smem / 1024:>7.1f}"
                  + ("  too much shared memory" if over else ""), flush=True)
    print("all kernels compiled" if not failures else f"{failures} problem(s)")
    return 1 if failures else 0


class _FakeCuda:
    """Stands in for a CUDA tensor in choose_config (which reads only shape, dtype and device type)."""

    def __init__(self, t):
        self.shape, self.dtype = t.shape, t.dtype
        self.device = type("Device", (), {"type": "cuda"})()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m kernels.compile_check", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability x10, e.g. 90 (repeatable)")
    parser.add_argument("--quick", action="store_true", help="the prefill and decode configurations only")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _reexec_compiled(argv)
    return run(args.arch or [80, 90], args.quick)


if __name__ == "__main__":
    sys.exit(main())
