"""The sampler: from one row of logits per request to one token per request, the whole batch in one pass.

Stages: (1) log-probabilities of the raw logits, if asked; (2) ``min_tokens`` blocks EOS and stop ids; (3)
penalties; (4) greedy tokens by argmax; (5) temperature, min-p, top-k / top-p; (6) random tokens by the exponential
race, seeded rows from their own generators; (7) each row takes its greedy or random token: int32 ``[num_reqs, 1]``.

vLLM counterpart: ``vllm/v1/sample/sampler.py`` (``Sampler``), the V1 model runner's. Model Runner V2's
``vllm/v1/worker/gpu/sample/sampler.py`` (``Sampler``) draws by Gumbel-max (the same race in log form) and returns
int64 tokens.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minillm.outputs import LogprobsTensors, SamplerOutput
from minillm.sample.logits_processors import apply_min_p, apply_min_tokens
from minillm.sample.metadata import SamplingMetadata
from minillm.sample.ops.penalties import apply_penalties
from minillm.sample.ops.random_sample import random_sample
from minillm.sample.ops.topk_topp import apply_top_k_top_p
from minillm.sampling_params import SAMPLING_EPS


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits / T`` row by row; greedy rows (``T = 0``) are divided by 1 (their random token is discarded)."""
    t = torch.where(temperature < SAMPLING_EPS, torch.ones_like(temperature), temperature)
    return logits / t.to(logits.dtype).unsqueeze(1)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The sampled token's log-probability first, then the ``num_logprobs`` largest, and the sampled token's rank.

    Args:
        logprobs: float ``[num_tokens, vocab_size]``.
        num_logprobs: how many top entries per row.
        token_ids: int ``[num_tokens]``, the sampled tokens.
    Returns:
        :class:`LogprobsTensors` with ``[num_tokens, num_logprobs + 1]`` ids and values and ``[num_tokens]`` ranks.
    """
    token_ids = token_ids.to(torch.long)
    top_vals, top_ids = logprobs.topk(num_logprobs, dim=-1)
    token_lp = logprobs.gather(-1, token_ids.unsqueeze(-1))
    # Rank 1 = the most likely token; ties count against the sampled token, as in vLLM.
    ranks = (logprobs >= token_lp).sum(-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat([token_ids.unsqueeze(-1), top_ids], dim=1).to(torch.int32),
        logprobs=torch.cat([token_lp, top_vals], dim=1).to(torch.float32),
        selected_token_ranks=ranks.to(torch.int32),
    )


class Sampler(nn.Module):
    """Samples one token for each row of ``logits`` with that row's :class:`SamplingParams`.

    Args:
        top_k_top_p: the masking function random rows go through (``EngineParts.top_k_top_p``; default
            :func:`~minillm.sample.ops.topk_topp.apply_top_k_top_p`).
    """

    def __init__(self, top_k_top_p: Callable[..., torch.Tensor] = apply_top_k_top_p) -> None:
        super().__init__()
        self.top_k_top_p = top_k_top_p

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        """
        Args:
            logits: ``[num_reqs, vocab_size]``, one row per request (``logits_indices`` already applied).
            sampling_metadata: the batch's settings, row ``i`` for request ``i``.
        Returns:
            :class:`SamplerOutput` with ``sampled_token_ids`` int32 ``[num_reqs, 1]`` and, if any request asked,
            logprobs of the raw model distribution ``[num_reqs, max_num_logprobs + 1]``.
        """
        if logits.dim() != 2 or logits.shape[0] != sampling_metadata.num_reqs:
            raise ValueError(f"logits must be [num_reqs={sampling_metadata.num_reqs}, vocab_size], "
                             f"got {tuple(logits.shape)}")
        md = sampling_metadata
        logits = logits.to(torch.float32)
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        logits = self.apply_logits_processors(logits, md)
        sampled = self.sample(logits, md)
        logprobs = None
        if raw_logprobs is not None and md.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, md.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1), logprobs_tensors=logprobs)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Stages that change the distribution before the greedy/random split: ``min_tokens``, penalties."""
        logits = apply_min_tokens(logits, md.min_tokens)
        if not md.no_penalties:
            logits = apply_penalties(logits, md.prompt_token_ids, md.output_token_ids, md.presence_penalties,
                                     md.frequency_penalties, md.repetition_penalties)
        return logits

    @staticmethod
    def filtered_probs(logits: torch.Tensor, md: SamplingMetadata,
                       top_k_top_p: Callable[..., torch.Tensor] = apply_top_k_top_p) -> torch.Tensor:
        """The distribution random rows sample from: softmax after temperature, min-p, top-k/top-p.
        float32 ``[num_rows, vocab_size]``."""
        logits = apply_temperature(logits, md.temperature)
        logits = apply_min_p(logits, md.min_p)
        if md.top_k is not None or md.top_p is not None:
            # Exercise 5.1's signature takes both tensors: a row without top-k has k = 0, without top-p p = 1.
            rows = logits.shape[0]
            k = md.top_k if md.top_k is not None else torch.zeros(rows, dtype=torch.long, device=logits.device)
            p = md.top_p if md.top_p is not None else torch.ones(rows, device=logits.device)
            logits = top_k_top_p(logits, k, p)
        return logits.softmax(dim=-1, dtype=torch.float32)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """int64 ``[num_rows]``: argmax for greedy rows, an exponential-race draw for the others."""
        if md.all_greedy:
            return logits.argmax(dim=-1)
        random = random_sample(self.filtered_probs(logits, md, self.top_k_top_p), md.generators)
        if md.all_random:
            return random
        return torch.where(md.temperature < SAMPLING_EPS, logits.argmax(dim=-1), random)
