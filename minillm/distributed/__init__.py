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
