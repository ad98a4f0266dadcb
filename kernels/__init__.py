"""Triton kernels of the course: attention over a paged KV cache and writing K/V into it (chapter 3).

Without a GPU the kernels run in Triton's interpreter, which must be switched on before any ``@triton.jit``
function is defined, so this package sets ``TRITON_INTERPRET=1`` on import when no CUDA device is present.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
