"""Offline throughput of minillm vs transformers, llama.cpp and the roofline, all at one dtype.

Run from the repository root::

    python bench/throughput.py                       # the issue's workload: 32 requests, prompts 30-400 tokens,
                                                     # at --dtype auto: bf16 where the CPU has AMX-BF16/AVX512-BF16
                                                     # (peers alike), else fp32; it prints which and why
    python bench/throughput.py --dtype float32       # the lessons' dtype, whatever the CPU
    python bench/throughput.py --peers minillm,roofline --num-requests 8
    LLAMA_CPP_BIN=.../build/bin python bench/throughput.py   # adds llama.cpp (minillm/course/benchmarks/llama_cpp.py)

Everything lives in :mod:`minillm.course.benchmarks.throughput` (also ``python -m minillm bench``).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minillm.course.benchmarks.throughput import main  # noqa: E402

if __name__ == "__main__":
    main()
