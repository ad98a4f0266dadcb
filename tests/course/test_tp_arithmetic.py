"""The on-paper decode-step arithmetic of ``bench/tensor_parallel.py`` (where tensor parallelism pays on GPUs)."""
from __future__ import annotations

import pytest

from minillm.config import LlamaConfig
from minillm.course.analysis.tp_arithmetic import (H100_INFINIBAND, H100_SXM, LLAMA_3_1_70B, decode_step_estimate,
                                                   where_tp_pays)
from minillm.model.llama_tp import shard_summary


def test_smollm2_on_one_gpu_is_its_bytes_over_the_bandwidth():
    e = decode_step_estimate(LlamaConfig(), 1, H100_SXM, batch=32, context_len=2048)
    weights = 134_515_008 * 2                       # SmolLM2-135M's parameters, bf16 (the tied head counted once)
    kv = 32 * 2048 * (2 * 30 * 3 * 64 * 2)          # K and V, 30 layers, 3 KV heads of 64, bf16
    assert (e.weight_bytes, e.kv_bytes, e.all_reduce_s) == (weights, kv, 0.0)
    assert e.memory_s == pytest.approx((weights + kv) / 3.35e12, rel=1e-12)
    assert e.compute_s < e.memory_s / 10            # decode is memory-bound: far below the FLOP roofline
    assert e.step_s == e.memory_s and e.tokens_per_s(32) == pytest.approx(32 / e.memory_s)


def test_llama_70b_needs_tensor_parallelism_and_pays_over_nvlink():
    by_tp = {tp: decode_step_estimate(LLAMA_3_1_70B, tp, H100_SXM, 32, 2048) for tp in (1, 2, 4, 8)}
    assert by_tp[1].weight_bytes == shard_summary(LLAMA_3_1_70B, 1, 2)[0].param_bytes
    assert 141.0e9 < by_tp[1].weight_bytes < 141.2e9    # 70.6 B parameters in bf16
    assert [by_tp[tp].fits for tp in (1, 2, 4, 8)] == [False, False, True, True]
    for tp in (2, 4, 8):                            # 8 KV heads: up to 8 ranks, every byte is read by one rank only
        assert by_tp[tp].kv_bytes * tp == by_tp[1].kv_bytes
        assert by_tp[tp].memory_s == pytest.approx(by_tp[1].memory_s / tp, rel=2e-3)  # the vocab rows pad a little
    # 161 all-reduces of [32, 8192] bf16 a step: latency plus 2 (N-1)/N of the payload over 450 GB/s.
    payload = 32 * 8192 * 2
    assert by_tp[8].all_reduce_s == pytest.approx(161 * (5e-6 + 2 * 7 / 8 * payload / 450e9))
    assert by_tp[1].step_s / by_tp[8].step_s > 6    # 8 GPUs: over 6x one (which could not hold the model anyway)
    ib = decode_step_estimate(LLAMA_3_1_70B, 8, H100_INFINIBAND, 32, 2048)
    assert ib.all_reduce_s > 5 * by_tp[8].all_reduce_s and ib.step_s > 1.5 * by_tp[8].step_s


def test_a_small_model_hardly_gains_from_three_gpus():
    one, three = (decode_step_estimate(LlamaConfig(), tp, H100_SXM, 32, 2048) for tp in (1, 3))
    assert three.all_reduce_s > three.memory_s      # the 61 all-reduces cost more than the reads they split
    assert 1.0 < one.step_s / three.step_s < 1.2


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="batch must be >= 1"):
        decode_step_estimate(LlamaConfig(), 1, H100_SXM, 0, 10)
    with pytest.raises(ValueError, match=r"attention heads \(9\) must be divisible by tensor parallel size \(2\)"):
        decode_step_estimate(LlamaConfig(), 2, H100_SXM, 1, 10)


def test_the_printed_table_has_every_case():
    lines: list[str] = []
    results = where_tp_pays(lines.append)
    assert sorted(results) == ["Llama-3.1-70B / H100 SXM, InfiniBand", "Llama-3.1-70B / H100 SXM, NVLink",
                               "SmolLM2-135M / H100 SXM, NVLink"]
    assert len(lines) == 2 + 4 + 3 + 2
    smol = results["SmolLM2-135M / H100 SXM, NVLink"]
    assert lines[-1].split()[-1] == f"{smol[1].step_s / smol[3].step_s:.2f}x"
