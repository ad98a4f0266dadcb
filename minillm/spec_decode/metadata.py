"""Where the draft tokens of a step are, and which logits rows score them.

vLLM counterpart: ``vllm/v1/spec_decode/metadata.py`` (``SpecDecodeMetadata``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minillm.sample.logits_indices import compute_spec_decode_logits_indices


@dataclass
class SpecDecodeMetadata:
    """The drafts of one step.

    Attributes:
        draft_token_ids: int64 ``[num_draft_tokens_total]``, all requests' drafts one after another.
        num_draft_tokens: ``d_i`` per request (0 for a request without drafts).
        cu_num_draft_tokens: int64 ``[num_reqs]``, inclusive cumulative sum of ``num_draft_tokens``.
        logits_indices: int64 ``[sum(d_i + 1)]``, flat token positions whose logits are computed.
        target_logits_indices: int64 ``[sum(d_i)]``, rows (of those logits) that score the drafts.
        bonus_logits_indices: int64 ``[num_reqs]``, the last row of each request.
    """

    draft_token_ids: torch.Tensor
    num_draft_tokens: list[int]
    cu_num_draft_tokens: torch.Tensor
    logits_indices: torch.Tensor
    target_logits_indices: torch.Tensor
    bonus_logits_indices: torch.Tensor

    @property
    def max_spec_len(self) -> int:
        return max(self.num_draft_tokens, default=0)

    @property
    def num_reqs(self) -> int:
        return len(self.num_draft_tokens)

    def draft_lists(self) -> list[list[int]]:
        """The drafts as one Python list per request."""
        flat = self.draft_token_ids.tolist()
        out, start = [], 0
        for d in self.num_draft_tokens:
            out.append(flat[start:start + d])
            start += d
        return out

    @classmethod
    def make(cls, draft_token_ids: Sequence[Sequence[int]], query_start_loc: torch.Tensor | None = None
             ) -> SpecDecodeMetadata:
        """From the drafts of each request and the step's ``query_start_loc`` (default: each request scheduled
        exactly its last sampled token plus its drafts, as in a pure decode step)."""
        num = [len(d) for d in draft_token_ids]
        if query_start_loc is None:
            query_start_loc = torch.tensor([0] + [d + 1 for d in num], dtype=torch.long).cumsum(0)
        logits_indices, target, bonus = compute_spec_decode_logits_indices(query_start_loc, num)
        flat = [t for d in draft_token_ids for t in d]
        return cls(draft_token_ids=torch.tensor(flat, dtype=torch.long), num_draft_tokens=num,
                   cu_num_draft_tokens=torch.tensor(num, dtype=torch.long).cumsum(0),
                   logits_indices=logits_indices, target_logits_indices=target, bonus_logits_indices=bonus)
