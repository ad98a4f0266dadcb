"""Tensor parallelism inside the engine: all-reduce bytes per rank against the formula, the plan's broadcast, step
time and throughput at each tensor_parallel_size, same tokens.

Run from the repository root::

    python bench/tensor_parallel.py                       # tp = 1 and 3 on SmolLM2, 8 requests, 2 threads
    python bench/tensor_parallel.py --tp 1 3 9 --json /tmp/tp.json

Everything lives in :mod:`minillm.course.benchmarks.tensor_parallel`. The ``__main__`` guard is required: the ranks
are started with ``spawn``, which imports this script again.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minillm.course.benchmarks.tensor_parallel import main  # noqa: E402

if __name__ == "__main__":
    main()
