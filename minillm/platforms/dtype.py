"""Which dtype the model, its activations and its KV cache run in: the names ``EngineArgs.dtype`` and
``load_model`` accept, the defaults, and ``"auto"``.

Two defaults, on purpose: ``EngineArgs()`` and ``LLM()`` run fp32 on a CPU, the dtype every lesson and oracle test
compares against transformers in; ``python -m minillm serve`` and ``bench`` run :data:`SERVING_DTYPE`, ``"auto"``,
the dtype the machine is built for, and print which and why at start-up (``--dtype float32`` gives them fp32).

vLLM counterpart: ``vllm/config/model.py`` (``_get_and_verify_dtype``, ``_resolve_auto_dtype``).
"""
from __future__ import annotations

import torch

from minillm.platforms.cpu import DtypeChoice, preferred_cpu_dtype

# What ``serve`` and ``bench`` run at unless told otherwise: serving and measuring speed want the machine's dtype.
SERVING_DTYPE = "auto"

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> DtypeChoice:
    """The dtype of weights, activations and KV cache, and why.

    - ``None`` (the default of ``EngineArgs`` and ``LLM``): fp32 on a CPU, the dtype every lesson and test compares
      against transformers in; fp16 on a GPU.
    - ``"auto"`` (the default of ``serve`` and ``bench``, :data:`SERVING_DTYPE`): the dtype the machine is built for
      (vLLM's ``"auto"``): on a CPU bf16 where it has AMX-BF16 or AVX512-BF16, else fp32
      (:func:`minillm.platforms.cpu.preferred_cpu_dtype`); fp16 on a GPU.
    - a name (``"float32"``, ``"bf16"``, ...) or a floating-point ``torch.dtype``: that dtype.

    Raises:
        ValueError: any other value, naming the allowed ones.
    """
    on_cpu = device == "cpu"
    if dtype is None:
        return DtypeChoice(torch.float32, "the default on a CPU: exact against the fp32 oracle") if on_cpu else \
            DtypeChoice(torch.float16, "the default on a GPU")
    if isinstance(dtype, str) and dtype.lower() == "auto":
        return preferred_cpu_dtype() if on_cpu else DtypeChoice(torch.float16, "auto on a GPU")
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return DtypeChoice(dtype, "asked for")
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return DtypeChoice(_DTYPES[dtype.lower()], "asked for")
    raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)} (or None, the default: fp32 on a CPU), "
                     f"got {dtype!r}")


def parse_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """:func:`resolve_dtype` without the reason."""
    return resolve_dtype(dtype, device).dtype
