"""Several processes working on one prompt: context-parallel prefill over ``torch.distributed`` (chapter 7).

- :mod:`~minillm.distributed.splits`: which positions each rank holds (plain and zigzag splits).
- :mod:`~minillm.distributed.comm`: the K/V exchanges (all-gather, ring) with timeouts and byte counts.
- :mod:`~minillm.distributed.context_parallel`: the attention that exchanges K/V per layer, and one rank's prefill.
- :mod:`~minillm.distributed.launcher`: worker processes, jobs (``collective_rpc``), and failing fast when a rank
  fails.
"""
from minillm.distributed.comm import CollectiveError, CommStats, expected_bytes_per_layer
from minillm.distributed.context_parallel import (STRATEGIES, ContextParallelAttention, RankPrefillOutput,
                                                  context_parallel_forward)
from minillm.distributed.launcher import (ContextParallelError, ContextParallelExecutor, ContextParallelResult,
                                          MultiprocExecutor, WorkerContext, WorkerError)
from minillm.distributed.splits import SPLIT_KINDS, ContextSplit, Piece, make_split

__all__ = ["SPLIT_KINDS", "STRATEGIES", "CollectiveError", "CommStats", "ContextParallelAttention",
           "ContextParallelError", "ContextParallelExecutor", "ContextParallelResult", "ContextSplit", "Piece",
           "MultiprocExecutor", "RankPrefillOutput", "WorkerContext", "WorkerError", "context_parallel_forward",
           "expected_bytes_per_layer", "make_split"]

# Tensor parallelism (chapter 9): the group and its collectives, the rank's job, the parent's helper, the formulas.
from minillm.distributed.parallel_state import (TensorParallelGroup, simulate_all_gather,  # noqa: E402
                                                simulate_all_reduce)
from minillm.distributed.tensor_parallel import (TensorParallelResult, expected_all_gather_bytes,  # noqa: E402
                                                 expected_all_reduce_bytes, expected_num_all_reduces,
                                                 run_tensor_parallel, tp_prefill)

__all__ += ["TensorParallelGroup", "TensorParallelResult", "expected_all_gather_bytes", "expected_all_reduce_bytes",
            "expected_num_all_reduces", "run_tensor_parallel", "simulate_all_gather", "simulate_all_reduce",
            "tp_prefill"]
