"""Which dtype this CPU is built for, and why: what ``dtype="auto"`` means on a CPU.

bf16 halves a matmul's bytes and, with bf16 dot-product instructions (AMX-BF16, AVX512-BF16: the ``amx_bf16`` /
``avx512_bf16`` flags of ``/proc/cpuinfo``), computes several times faster; without them it is emulated, slower than
fp32. So ``"auto"`` is bf16 where the CPU has those instructions, fp32 elsewhere; ``serve`` and ``bench`` run at it
and print the choice (:func:`preferred_cpu_dtype`). ``EngineArgs()`` and ``LLM()`` keep fp32, which alone matches
transformers' fp32 model logit for logit.

vLLM counterpart: ``vllm/platforms/cpu.py`` (``CpuPlatform.supported_dtypes``: bf16 first on x86 whatever the
flags) and ``vllm/config/model.py`` (``_resolve_auto_dtype``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# /proc/cpuinfo flag -> the name in the reason, the best first.
NATIVE_BF16_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved dtype and the one-line reason, e.g. for ``bfloat16``: "auto: this CPU has AVX512-BF16; torch CPU
    capability AVX512"."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def cpu_capability() -> str:
    """The instruction set PyTorch's own CPU kernels were dispatched to (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``
    under ``ATEN_CPU_CAPABILITY=default``, ...)."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first CPU's ``flags`` line of ``/proc/cpuinfo``; ``None`` where there is no such file (macOS, Windows)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return None
    return frozenset()


def native_bf16(flags: frozenset[str] | None = None) -> str | None:
    """``"AMX-BF16"`` or ``"AVX512-BF16"`` when the CPU multiplies bf16 natively, else ``None``. Without
    ``/proc/cpuinfo``, PyTorch's own probes answer (the ones vLLM calls)."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        probes = {"amx_bf16": getattr(torch.cpu, "_is_amx_tile_supported", None),
                  "avx512_bf16": getattr(torch.cpu, "_is_avx512_bf16_supported", None)}
        flags = frozenset(flag for flag, probe in probes.items() if probe is not None and probe())
    return next((name for flag, name in NATIVE_BF16_FLAGS.items() if flag in flags), None)


def preferred_cpu_dtype(flags: frozenset[str] | None = None, capability: str | None = None) -> DtypeChoice:
    """What ``dtype="auto"`` resolves to on this CPU: bf16 with AMX-BF16 or AVX512-BF16, else fp32.

    ``flags`` and ``capability`` default to this machine's (:func:`cpu_flags`, :func:`cpu_capability`); tests pass
    other machines'.
    """
    capability = cpu_capability() if capability is None else capability
    native = native_bf16(flags)
    if native is not None:
        return DtypeChoice(torch.bfloat16, f"auto: this CPU has {native}; torch CPU capability {capability}")
    return DtypeChoice(torch.float32, f"auto: this CPU has neither AMX-BF16 nor AVX512-BF16, so bf16 would be "
                                      f"emulated and slower; torch CPU capability {capability}")
