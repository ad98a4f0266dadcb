"""What the sampler hands back to the engine each step.

The answer to "what is the shape of ``sampled_token_ids``?" lives here:

* without speculative decoding: ``int32 [num_reqs, 1]``, one row per request in the batch, in the batch order
  (a request still in the middle of its prefill also gets a row; the engine throws that token away);
* with draft tokens: ``int32 [num_reqs, max_num_draft + 1]``; row ``i`` holds the accepted draft tokens, then one
  token from the target model (a correction or the bonus token), then ``PLACEHOLDER_TOKEN_ID`` (-1) up to the end.

vLLM counterpart: ``vllm/v1/outputs.py`` (``SamplerOutput``, ``LogprobsTensors``); ``PLACEHOLDER_TOKEN_ID`` is
defined in ``vllm/v1/sample/rejection_sampler.py``, and the comment on the padding in ``outputs.py`` names it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

# Fills the positions after a rejected draft token: "no token here". Never a valid vocabulary id.
PLACEHOLDER_TOKEN_ID: int = -1


class LogprobsTensors(NamedTuple):
    """Log-probabilities for each sampled token, as tensors (the engine turns them into Python objects later).

    Attributes:
        logprob_token_ids: int32 ``[num_tokens, num_logprobs + 1]``; column 0 is the sampled token, columns
            ``1..num_logprobs`` the most likely tokens in decreasing order.
        logprobs: float32 ``[num_tokens, num_logprobs + 1]``, the matching log-probabilities.
        selected_token_ranks: int32 ``[num_tokens]``, the rank of the sampled token (1 = most likely).
    """

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        return (self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.selected_token_ranks.tolist())


@dataclass
class SamplerOutput:
    """The sampler's result for one step.

    Attributes:
        sampled_token_ids: int32 ``[num_reqs, 1]`` (no drafts) or ``[num_reqs, max_num_draft + 1]`` (with drafts),
            ``PLACEHOLDER_TOKEN_ID`` where a row has no token.
        logprobs_tensors: ``None`` unless some request asked for ``logprobs``.
    """

    sampled_token_ids: torch.Tensor
    logprobs_tensors: LogprobsTensors | None = None

    def to_token_lists(self) -> list[list[int]]:
        """One Python list per request with the placeholders removed: the tokens to append to each request."""
        return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in self.sampled_token_ids.tolist()]
