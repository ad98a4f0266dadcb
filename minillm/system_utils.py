"""Small helpers for the engine's child processes.

vLLM counterpart: ``vllm/utils/system_utils.py`` (process helpers) and the parent-death watch that vLLM's engine-core
and worker processes keep (``vllm/v1/engine/core.py``, ``vllm/v1/executor/multiproc_executor.py:WorkerProc``).
"""
from __future__ import annotations

import os
from typing import Any


def watch_parent(death_pipe: Any) -> None:
    """Exit when the parent goes away: its end of the pipe closes (even on SIGKILL) and ``recv`` fails. Run it on a
    daemon thread of the child."""
    try:
        death_pipe.recv()
    except (EOFError, OSError):
        pass
    os._exit(0)
