"""One step's batch: built fresh each step from the runner's slots, by index.

The scheduler names the requests of a step; the runner turns them into batch rows and maps each row to the slot
that holds its state (``idx_mapping``). Everything else of the step is computed from the slots through that mapping
by the input kernels (``kernels/input_batch.py``): the prompt chunks and last sampled tokens that become
``input_ids``, the ``positions``, the ``seq_lens``, the rows to take logits at. Nothing is kept from step to step
here: the state lives in the slots (:class:`~minillm.worker.states.RequestState`).

vLLM counterpart: ``vllm/v1/worker/gpu/input_batch.py:InputBatch``, Model Runner V2, whose tensors are views of
fixed buffers (``InputBuffers``, for its CUDA graphs); minillm's are each step's own, so a batch kept for inspection
stays as it was.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minillm.attention.metadata import AttentionMetadata


@dataclass
class InputBatch:
    """One step's batch (tensors on the runner's device unless they end in ``_np``).

    Attributes:
        req_ids: batch row -> request id (decodes and verifications first, then by tokens: see
            :func:`~minillm.worker.model_runner.sort_batch_req_ids`).
        num_reqs: rows.
        idx_mapping: ``[num_reqs]`` int64, batch row -> slot; ``idx_mapping_np`` its host copy.
        num_scheduled_tokens: ``[num_reqs]`` int32 (host), tokens per row.
        num_tokens: ``sum(num_scheduled_tokens)``.
        num_draft_tokens: drafts in the batch (the last tokens of their rows).
        num_draft_tokens_per_req: ``[num_reqs]`` int32 (host), or ``None`` without drafts.
        query_start_loc: ``[num_reqs + 1]`` int32; ``query_start_loc_np`` its host copy.
        seq_lens: ``[num_reqs]`` int32, tokens each row's request holds once this step is computed.
        seq_lens_np: ``[num_reqs]`` int32 (host), the same, from the scheduler's numbers.
        is_prefilling_np: ``[num_reqs]`` bool (host): the row's request is still feeding its prefill tokens.
        input_ids: ``[num_tokens]`` int64.
        positions: ``[num_tokens]`` int64.
        logits_indices: ``[num_logits]`` int64, the rows of the hidden states to compute logits for: each row's last
            ``1 + its drafts`` tokens.
        cu_num_logits: ``[num_reqs + 1]`` int32, cumulative logits per row; ``cu_num_logits_np`` its host copy.
        discard_request_mask: ``[num_reqs]`` bool (host): rows mid-prefill (``seq_lens < num_tokens`` of the
            request), whose sampled token is thrown away.
        attn_metadata: what attention reads (``query_start_loc``, ``seq_lens``, the gathered ``block_table``,
            ``slot_mapping``).
        draft_token_ids: per row, the drafts it verifies (``[]`` for most rows).
    """

    req_ids: list[str]
    num_reqs: int
    idx_mapping: torch.Tensor
    idx_mapping_np: np.ndarray
    num_scheduled_tokens: np.ndarray
    num_tokens: int
    num_draft_tokens: int
    num_draft_tokens_per_req: np.ndarray | None
    query_start_loc: torch.Tensor
    query_start_loc_np: np.ndarray
    seq_lens: torch.Tensor
    seq_lens_np: np.ndarray
    is_prefilling_np: np.ndarray
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    cu_num_logits: torch.Tensor
    cu_num_logits_np: np.ndarray
    discard_request_mask: np.ndarray
    attn_metadata: AttentionMetadata
    draft_token_ids: list[list[int]]

    @property
    def block_table(self) -> torch.Tensor:
        return self.attn_metadata.block_table

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.attn_metadata.slot_mapping
