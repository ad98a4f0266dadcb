"""Several processes working on one prompt: context-parallel prefill over ``torch.distributed`` (chapter 7).

- :mod:`~minillm.distributed.splits`: which positions each rank holds (plain and zigzag splits).
- :mod:`~minillm.distributed.comm`: the K/V exchanges (all-gather, ring) with timeouts and byte counts.
- :mod:`~minillm.distributed.context_parallel`: the attention that exchanges K/V per layer, and one rank's prefill.
- :mod:`~minillm.distributed.jobs`: chapters 7 and 9's executor (:class:`JobExecutor`, the engine's
  ``MultiprocExecutor`` with full models on every rank) and the jobs it runs on the first ``k`` ranks.
- :mod:`~minillm.distributed.context_parallel_executor`: chapter 7's prefill on several ranks, put back together.
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
