"""The block table of the persistent batch: one row of KV block ids per batch slot, kept from step to step.

Row ``i`` holds the blocks of the request in slot ``i`` of the :class:`~minillm.worker.input_batch.InputBatch`, then
0s (the null block), so a slice of the table is the step's ``block_table``. A step appends new blocks to a row::

    row 2 before: [5, 2, 9, 0, 0, 0]   num_blocks_per_row[2] = 3
    append_row([11], 2)
    row 2 after:  [5, 2, 9, 11, 0, 0]  num_blocks_per_row[2] = 4

vLLM counterpart: ``vllm/v1/worker/block_table.py`` (``BlockTable``: ``append_row``, ``add_row``, ``clear_row``,
``move_row``, ``swap_row``), with a pinned CPU and a GPU copy and one table per KV cache group.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTable:
    """Per-slot rows of block ids.

    Args:
        max_num_reqs: rows (batch slots).
        max_num_blocks_per_req: columns: the most blocks one request may hold (``ceil(max_model_len /
            block_size)``).

    Attributes:
        block_table: ``[max_num_reqs, max_num_blocks_per_req]`` int32; past a row's blocks, 0 (the null block).
        num_blocks_per_row: ``[max_num_reqs]`` int32, the blocks each row holds.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int) -> None:
        for name, value in (("max_num_reqs", max_num_reqs), ("max_num_blocks_per_req", max_num_blocks_per_req)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        # np.zeros maps zero pages lazily: rows never used cost no memory.
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def append_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Append ``block_ids`` to row ``row_idx``. ``ValueError`` if the row would exceed its width."""
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row_idx])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"row {row_idx} would hold {end} blocks, more than max_num_blocks_per_req "
                             f"({self.max_num_blocks_per_req} = ceil(max_model_len / block_size)); raise "
                             f"max_model_len")
        self.block_table[row_idx, start:end] = block_ids
        self.num_blocks_per_row[row_idx] = end

    def add_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Make ``block_ids`` the whole of row ``row_idx`` (a request entering the batch)."""
        self.clear_row(row_idx)
        self.append_row(block_ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        """Empty row ``row_idx``: back to all null blocks."""
        self.block_table[row_idx, :self.num_blocks_per_row[row_idx]] = 0
        self.num_blocks_per_row[row_idx] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Row ``src`` becomes row ``tgt`` (whose old content is dropped); ``src`` is left empty."""
        n = int(self.num_blocks_per_row[src])
        self.clear_row(tgt)
        self.block_table[tgt, :n] = self.block_table[src, :n]
        self.num_blocks_per_row[tgt] = n
        self.clear_row(src)

    def swap_row(self, src: int, tgt: int) -> None:
        """Exchange rows ``src`` and ``tgt`` (whole rows: both keep their null padding)."""
        # Fancy indexing on the right makes a copy first, so this is a true swap.
        self.block_table[[src, tgt]] = self.block_table[[tgt, src]]
        self.num_blocks_per_row[[src, tgt]] = self.num_blocks_per_row[[tgt, src]]
