"""Several processes on one model: context-parallel prefill, tensor parallelism and moving K/V between engines.

- :mod:`~minillm.distributed.splits`, :mod:`~minillm.distributed.comm`, :mod:`~minillm.distributed.context_parallel`:
  which positions each rank holds, the K/V exchanges, the attention that uses them.
- :mod:`~minillm.distributed.jobs`: an executor with full models on every rank, and the jobs it runs.
- :mod:`~minillm.distributed.parallel_state`, :mod:`~minillm.distributed.tensor_parallel`: tensor parallelism.
- :mod:`~minillm.distributed.kv_transfer`, :mod:`~minillm.distributed.disaggregation`: disaggregated prefill.

vLLM counterpart: ``vllm/distributed/``.
"""
from minillm.distributed.comm import CollectiveError, CommStats, expected_bytes_per_layer
from minillm.distributed.context_parallel import (
    STRATEGIES,
    ContextParallelAttention,
    RankPrefillOutput,
    context_parallel_forward,
)
from minillm.distributed.splits import SPLIT_KINDS, ContextSplit, Piece, make_split

__all__ = ["SPLIT_KINDS", "STRATEGIES", "CollectiveError", "CommStats", "ContextParallelAttention",
           "ContextParallelError", "ContextParallelExecutor", "ContextParallelResult", "ContextSplit", "Piece",
           "JobExecutor", "JobWorker", "RankPrefillOutput", "WorkerContext", "WorkerError", "context_parallel_forward",
           "expected_bytes_per_layer", "make_split"]

# Tensor parallelism (chapter 9): the group and its collectives, the rank's job, the parent's helper, the formulas.
from minillm.distributed.parallel_state import TensorParallelGroup, simulate_all_gather, simulate_all_reduce  # noqa: E402
from minillm.distributed.tensor_parallel import (  # noqa: E402
    TensorParallelResult,
    expected_all_gather_bytes,
    expected_all_reduce_bytes,
    expected_num_all_reduces,
    run_tensor_parallel,
    tp_prefill,
)

__all__ += ["TensorParallelGroup", "TensorParallelResult", "expected_all_gather_bytes", "expected_all_reduce_bytes",
            "expected_num_all_reduces", "run_tensor_parallel", "simulate_all_gather", "simulate_all_reduce",
            "tp_prefill"]

# The executors build on minillm.executor, whose workers import the tensor-parallel model, which imports this
# package: imported on first use, they close no import cycle.
_LAZY = {"ContextParallelError": "context_parallel_executor", "ContextParallelExecutor": "context_parallel_executor",
         "ContextParallelResult": "context_parallel_executor", "JobExecutor": "jobs", "JobWorker": "jobs",
         "WorkerContext": "jobs", "WorkerError": "jobs"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"minillm.distributed.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'minillm.distributed' has no attribute {name!r}")
