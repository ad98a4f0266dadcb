"""The engine core in its own process: IPC cost per step, throughput with and without async scheduling, a timeline.

Run from the repository root::

    python bench/engine_core.py                          # the throughput benchmark's workload (32 requests), fp32
    python bench/engine_core.py --num-requests 8 --json /tmp/core.json --plot /tmp/timeline.png
    python bench/engine_core.py --dtype auto --repeat 2  # the CPU's dtype; best of two interleaved rounds

Everything lives in :mod:`minillm.course.benchmarks.engine_core`. The ``__main__`` guard is required: the engine core's
process is started with ``spawn``, which imports this script again.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minillm.course.benchmarks.engine_core import main  # noqa: E402

if __name__ == "__main__":
    main()
