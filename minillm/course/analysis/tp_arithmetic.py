"""Where tensor parallelism pays, on paper: one decode step of a model on ``tp`` GPUs, from stated device numbers.

A decode step reads every weight once and every cached token's K/V once, and does little arithmetic per byte, so
on one device its time is about ``(weights + K/V read) / memory bandwidth``. Split over ``N`` ranks, each rank reads
``1/N`` of the weights (and the K/V of its heads) in parallel; in exchange, every layer stops twice for an
all-reduce of ``[batch, hidden]`` (chapter 9's ``1 + 2L`` all-reduces), which costs a link latency plus
``2 (N-1)/N`` times the payload over the link, and nothing can overlap it: the next layer needs the sum.

So tensor parallelism pays when the memory time it divides is large against ``(1 + 2L)`` link latencies: a model
whose weights take many milliseconds to read (and often do not fit one device at all), over NVLink's microseconds.
It hardly pays for a small model: three H100s run SmolLM2 about 1.1 times as fast as one, its 61 all-reduces eating
most of what splitting its reads saved. Over a slow link between machines it pays less. :func:`decode_step_estimate`
is that arithmetic; ``bench/tensor_parallel.py`` prints it for Llama-3.1-70B and SmolLM2 beside its CPU
measurements.

The model: time = max(memory time, compute time) + all-reduce time, each rank at its device's peak (a roofline, an
upper bound on speed; real kernels reach perhaps 70-90% of the bandwidth). It leaves out the all-gather of the
logits (one per step, ``[batch, vocab / N]``), kernel launch gaps (CUDA graphs hide them) and any overlap of
communication with compute.
"""
from __future__ import annotations

from dataclasses import dataclass

from minillm.config import LlamaConfig
from minillm.distributed.tensor_parallel import expected_num_all_reduces
from minillm.model.llama_tp import shard_summary


@dataclass(frozen=True)
class Device:
    """What the arithmetic needs of one GPU and its link to the others.

    Attributes:
        name: for tables.
        memory_bytes: device memory.
        memory_bytes_per_s: memory bandwidth.
        flops_per_s: dense bf16 matmul peak.
        link_bytes_per_s: one direction of the link between two GPUs (what a ring all-reduce's step sends at).
        link_latency_s: one all-reduce's fixed cost, whatever its size (launch, synchronisation, hops).
    """

    name: str
    memory_bytes: float
    memory_bytes_per_s: float
    flops_per_s: float
    link_bytes_per_s: float
    link_latency_s: float


# NVIDIA's H100 SXM datasheet: 80 GB of HBM3 at 3.35 TB/s, 989 dense bf16 TFLOP/s, NVLink 4 at 900 GB/s
# (both directions, so 450 GB/s each way). The latency is an assumption: a few microseconds for a small NCCL
# all-reduce inside one machine.
H100_SXM = Device("H100 SXM, NVLink", 80e9, 3.35e12, 989e12, 450e9, 5e-6)
# The same GPUs in different machines, over 400 Gb/s InfiniBand (50 GB/s a direction); latency again assumed.
H100_INFINIBAND = Device("H100 SXM, InfiniBand", 80e9, 3.35e12, 989e12, 50e9, 20e-6)

# Llama-3.1-70B's shape, from its config.json on the Hugging Face Hub (meta-llama/Llama-3.1-70B): a model that needs
# tensor parallelism, since its 141 GB of bf16 weights fit no single GPU.
LLAMA_3_1_70B = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                            num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                            max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
                            eos_token_id=128001)


@dataclass(frozen=True)
class StepEstimate:
    """One decode step of ``batch`` requests of ``context_len`` tokens each, on ``tp`` ranks (see the module text).

    Attributes:
        tp: ranks.
        weight_bytes: weights each rank reads (its shard).
        kv_bytes: K/V each rank reads (the KV heads it caches, every request's context).
        fits: the weights and the batch's KV cache fit in ``memory_utilization`` of the device.
        memory_s, compute_s, all_reduce_s: the parts of the step on each rank.
        step_s: ``max(memory_s, compute_s) + all_reduce_s``.
        tokens_per_s: ``batch / step_s``.
    """

    tp: int
    weight_bytes: int
    kv_bytes: int
    fits: bool
    memory_s: float
    compute_s: float
    all_reduce_s: float

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.all_reduce_s

    def tokens_per_s(self, batch: int) -> float:
        return batch / self.step_s


def decode_step_estimate(config: LlamaConfig, tp: int, device: Device, batch: int, context_len: int,
                         dtype_bytes: int = 2, memory_utilization: float = 0.9) -> StepEstimate:
    """The roofline of one decode step on each of ``tp`` ranks (see the module docstring).

    Args:
        config: the model.
        tp: tensor-parallel ranks (the model must split over them: vLLM's rule).
        device: one rank's GPU and link.
        batch: requests, one new token each.
        context_len: tokens each request has cached.
        dtype_bytes: of the weights, the KV cache and the all-reduced activations (2: bf16).
        memory_utilization: the share of device memory the weights and KV cache may take (vLLM's
            ``gpu_memory_utilization`` default, 0.9).
    """
    if batch < 1 or context_len < 0:
        raise ValueError(f"batch must be >= 1 and context_len >= 0, got batch={batch}, context_len={context_len}")
    shard = shard_summary(config, tp, dtype_bytes)[0]
    kv_bytes = batch * context_len * shard.kv_cache_bytes_per_token
    weight_bytes = shard.param_bytes
    # A matmul does 2 FLOPs per weight per token; attention's QK^T and PV add 4 per cached K/V element a query reads.
    kv_elements = kv_bytes // dtype_bytes
    flops = 2 * batch * weight_bytes // dtype_bytes + 4 * kv_elements * config.num_queries_per_kv
    payload = batch * config.hidden_size * dtype_bytes  # one all-reduce: [batch, hidden]
    rounds = expected_num_all_reduces(config, tp)
    all_reduce_s = rounds * (device.link_latency_s + 2 * (tp - 1) / tp * payload / device.link_bytes_per_s)
    fits = weight_bytes + kv_bytes <= memory_utilization * device.memory_bytes
    return StepEstimate(tp, weight_bytes, kv_bytes, fits, (weight_bytes + kv_bytes) / device.memory_bytes_per_s,
                        flops / device.flops_per_s, all_reduce_s)


def where_tp_pays(out=print) -> dict[str, dict[int, StepEstimate]]:
    """Print, and return, the estimates ``bench/tensor_parallel.py`` shows: Llama-3.1-70B on 1-8 H100s (NVLink and
    InfiniBand), and SmolLM2 on 1 and 3, batch 32 at 2,048 tokens of context, bf16."""
    batch, context = 32, 2048
    cases = {"Llama-3.1-70B": (LLAMA_3_1_70B, (1, 2, 4, 8)), "SmolLM2-135M": (LlamaConfig(), (1, 3))}
    results: dict[str, dict[int, StepEstimate]] = {}
    out(f"On paper: one decode step, batch {batch}, {context} tokens of context each, bf16 (a roofline; "
        f"minillm/course/analysis/tp_arithmetic.py)")
    out(f"{'model':<14} {'device':<21} {'tp':>2} {'weights/rank':>12} {'KV/rank':>8} {'fits':>4} {'memory':>8} "
        f"{'all-reduce':>10} {'step':>8} {'tokens/s':>9} {'vs tp=1':>7}")
    for name, (config, sizes) in cases.items():
        for device in (H100_SXM, H100_INFINIBAND) if name.startswith("Llama") else (H100_SXM,):
            for tp in sizes:
                if tp == 1 and device is H100_INFINIBAND:
                    continue  # one GPU uses no link
                e = decode_step_estimate(config, tp, device, batch, context)
                results.setdefault(f"{name} / {device.name}", {})[tp] = e
                one = decode_step_estimate(config, 1, device, batch, context)  # on paper even when it cannot fit
                out(f"{name:<14} {device.name:<21} {tp:>2} {e.weight_bytes / 1e9:>9.2f} GB {e.kv_bytes / 1e9:>5.2f} GB "
                    f"{'yes' if e.fits else 'no':>4} {e.memory_s * 1e3:>5.2f} ms {e.all_reduce_s * 1e3:>7.2f} ms "
                    f"{e.step_s * 1e3:>5.2f} ms {e.tokens_per_s(batch):>9,.0f} {one.step_s / e.step_s:>6.2f}x")
    return results
