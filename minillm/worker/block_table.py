"""The block tables of the runner's slots, and the step's block table and slot mapping gathered from them.

Row ``s`` holds the KV block ids of the request in slot ``s`` of the :class:`~minillm.worker.states.RequestState`,
in token order; a step appends the blocks its scheduler allocated. Each step then gathers the rows of the requests
it runs, in batch order, and maps each of its tokens to the cache slot its K/V goes to::

    slot rows        0: [5, 2, 9]   1: [7]   2: [4, 8]
    idx_mapping      [2, 0]                                  (batch row 0 is slot 2, row 1 is slot 0)
    block table      [[4, 8, 0], [5, 2, 9]]                  (0: the null block pads short rows)
    slot mapping     token at position p of batch row b -> table[b][p // block_size] * block_size + p % block_size

vLLM counterpart: ``vllm/v1/worker/gpu/block_table.py:BlockTables`` (``append_block_ids``,
``gather_block_tables``, ``compute_slot_mappings``), with one table per KV cache group; the gathers are the Triton
kernels of ``kernels/block_table.py``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels.block_table import compute_slot_mappings, gather_block_tables
from minillm.worker.states import HostDeviceTensor


class BlockTables:
    """Per-slot rows of KV block ids.

    Args:
        block_size: tokens per KV block.
        max_num_reqs: rows (slots).
        max_num_blocks_per_req: columns: the most blocks one request may hold (``ceil(max_model_len /
            block_size)``).
        device: where the tables live.

    Attributes:
        block_table: ``[max_num_reqs, max_num_blocks_per_req]`` int32 (:class:`HostDeviceTensor`).
        num_blocks: ``[max_num_reqs]`` int32 (:class:`HostDeviceTensor`), the blocks each row holds.
    """

    def __init__(self, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("block_size", block_size), ("max_num_reqs", max_num_reqs),
                            ("max_num_blocks_per_req", max_num_blocks_per_req)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.device = device = torch.device(device)
        self.block_table = HostDeviceTensor((max_num_reqs, max_num_blocks_per_req), np.int32, device)
        self.num_blocks = HostDeviceTensor(max_num_reqs, np.int32, device)

    def append_block_ids(self, req_index: int, new_block_ids: Sequence[int], overwrite: bool) -> None:
        """Append ``new_block_ids`` to row ``req_index``, or make them the whole row (``overwrite``: a request that
        arrives, or comes back after preemption with a new block list).

        Raises:
            ValueError: the row would hold more than ``max_num_blocks_per_req`` blocks. Then nothing changed.
        """
        start = 0 if overwrite else int(self.num_blocks.np[req_index])
        end = start + len(new_block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"slot {req_index} would hold {end} blocks, more than a block-table row holds "
                             f"({self.max_num_blocks_per_req} = ceil(max_model_len / block_size)); raise "
                             f"max_model_len")
        self.block_table.np[req_index, start:end] = new_block_ids
        self.num_blocks.np[req_index] = end
        if self.device.type != "cpu":
            self.block_table.gpu[req_index, start:end] = torch.as_tensor(
                np.asarray(new_block_ids, dtype=np.int32), device=self.device)
            self.num_blocks.gpu[req_index] = end

    def gather_block_tables(self, idx_mapping: torch.Tensor, num_blocks_cols: int | None = None) -> torch.Tensor:
        """The step's block table: the rows of ``idx_mapping``'s slots, in batch order, 0s past each row's blocks.

        Args:
            idx_mapping: ``[num_reqs]`` int64, batch row -> slot.
            num_blocks_cols: keep only the first columns (the most blocks any scheduled request holds); ``None``:
                all of them.

        Returns:
            ``[num_reqs, num_blocks_cols]`` int32, the step's own tensor (vLLM gathers into a fixed buffer).
        """
        out = torch.empty(idx_mapping.shape[0], self.max_num_blocks_per_req, dtype=torch.int32, device=self.device)
        rows = gather_block_tables(idx_mapping, self.block_table.gpu, self.num_blocks.gpu, out)
        return rows if num_blocks_cols is None else rows[:, :num_blocks_cols].contiguous()

    def compute_slot_mappings(self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                              positions: torch.Tensor) -> torch.Tensor:
        """Each of the step's tokens' cache slot, ``[num_tokens]`` int64 (the step's own tensor)."""
        num_tokens = int(query_start_loc[idx_mapping.shape[0]])
        out = torch.empty(num_tokens, dtype=torch.int64, device=self.device)
        return compute_slot_mappings(idx_mapping, query_start_loc, positions, self.block_table.gpu, self.block_size,
                                     out)
