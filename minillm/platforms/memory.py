"""How much memory a worker may give its KV cache: the device's free memory, and the budget when nothing is set.

Both the engine's arguments (``EngineArgs.resolved_num_gpu_blocks``) and each worker's start-up report
(``Worker.determine_available_memory``) read them, so the course's arithmetic and the engine's start-up agree.

vLLM counterpart: ``vllm/v1/worker/cpu_worker.py:CPUWorker.determine_available_memory`` (the cache config's
``kv_cache_memory_bytes``, which ``VLLM_CPU_KVCACHE_SPACE`` sets in GiB,
``vllm/platforms/cpu.py:CpuPlatform.check_and_update_config``; without it, the share of the node's memory
``gpu_memory_utilization`` reserves, less what the worker already uses) and, on a GPU,
``vllm/v1/worker/gpu_worker.py:Worker.determine_available_memory`` (what a profiling run leaves).
"""
from __future__ import annotations

import torch

#: The KV cache's bytes per rank when neither num_gpu_blocks, kv_cache_memory_bytes nor kv_cache_memory_fraction is
#: given (raised to hold one request of max_model_len if that needs more).
DEFAULT_KV_CACHE_BYTES = 512 * 1024 ** 2


def available_memory_bytes(device: str) -> int:
    """Free memory of the device: ``torch.cuda.mem_get_info`` on a GPU, ``MemAvailable`` of ``/proc/meminfo``
    on a CPU (8 GiB if that file is missing, e.g. on macOS)."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024 ** 3


def kv_cache_budget_bytes(bytes_per_block: int, block_size: int, max_model_len: int, device: str,
                          kv_cache_memory_bytes: int | None = None,
                          kv_cache_memory_fraction: float | None = None) -> int:
    """The bytes one rank gives its KV cache: ``kv_cache_memory_bytes`` if set, else ``kv_cache_memory_fraction``
    of the device's free memory, else :data:`DEFAULT_KV_CACHE_BYTES` or, if more, enough for one request of
    ``max_model_len`` tokens plus the null block (``bytes_per_block`` is this rank's block, all layers)."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes
    if kv_cache_memory_fraction is not None:
        return int(available_memory_bytes(device) * kv_cache_memory_fraction)
    need = (-(-max_model_len // block_size) + 1) * bytes_per_block
    return max(DEFAULT_KV_CACHE_BYTES, need)
