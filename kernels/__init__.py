"""Triton kernels: attention over a paged KV cache and writing K/V into it.

Without a GPU the kernels run in Triton's interpreter, which must be switched on before any ``@triton.jit``
function is defined, so this package sets ``TRITON_INTERPRET=1`` on import when no CUDA device is present.

- :func:`reshape_and_cache` writes a step's new K/V into the paged cache at ``slot_mapping``.
- :func:`unified_attention` attends a varlen batch of query chunks (prefills, chunks, decodes) over the cache.
- :mod:`kernels.input_batch` and :mod:`kernels.block_table` prepare a step's inputs from per-slot request state
  (input ids, positions, logits rows, block table, slot mapping) and fold the sampled tokens back in, each kernel
  beside the PyTorch reference a CPU runs.

vLLM counterpart: ``vllm/v1/attention/ops/``; for the input preparation, ``vllm/v1/worker/gpu/``.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

from kernels.reshape_and_cache import reshape_and_cache  # noqa: E402  (after the interpreter switch)
from kernels.unified_attention import unified_attention  # noqa: E402

__all__ = ["INTERPRETED", "reshape_and_cache", "unified_attention"]
