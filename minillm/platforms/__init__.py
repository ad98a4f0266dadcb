"""What the machine the engine runs on is built for (vLLM: ``vllm/platforms/``, one ``Platform`` per device kind)."""
from minillm.platforms.cpu import DtypeChoice, cpu_capability, cpu_flags, native_bf16, preferred_cpu_dtype

__all__ = ["DtypeChoice", "cpu_capability", "cpu_flags", "native_bf16", "preferred_cpu_dtype"]
