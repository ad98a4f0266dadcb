"""Verifying draft tokens with the target model: which drafts to keep, and the token that comes after them.

For drafts ``x_1..x_d`` the target scored ``d + 1`` positions. Greedy requests keep ``x_j`` while it equals the
target's argmax and at the first mismatch take the argmax (the *recovered* token); sampling requests keep ``x_j`` with
probability ``min(1, p(x_j) / q(x_j))`` (``q`` one-hot for an n-gram drafter) and on rejection draw from
``max(p - q, 0)`` renormalised, which keeps the output distributed as ``p`` (Leviathan et al. 2023). All drafts
kept: the last row gives a *bonus* token. Output: int32 ``[num_reqs, max_spec_len + 1]``, ``PLACEHOLDER_TOKEN_ID``
after each row's last real token.

vLLM counterpart: ``vllm/v1/sample/rejection_sampler.py`` (``RejectionSampler``); Model Runner V2's
(``vllm/v1/worker/gpu/spec_decode/rejection_sampler.py``) returns int64 rows and a ``num_sampled`` count.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from minillm.outputs import PLACEHOLDER_TOKEN_ID, SamplerOutput
from minillm.sample.metadata import SamplingMetadata
from minillm.sample.ops.random_sample import exponential_noise, random_sample
from minillm.sample.sampler import Sampler
from minillm.sampling_params import SAMPLING_EPS
from minillm.spec_decode.metadata import SpecDecodeMetadata


def assemble_spec_output(draft_token_ids: torch.Tensor, accepted: torch.Tensor, recovered_token_ids: torch.Tensor,
                         bonus_token_ids: torch.Tensor, num_draft_tokens: Sequence[int]) -> torch.Tensor:
    """Build the ``[num_reqs, max_spec_len + 1]`` output from per-draft decisions.

    Row ``i``: the drafts before its first rejection, then the recovered token at that position (or, if no
    draft was rejected, the bonus token), then ``PLACEHOLDER_TOKEN_ID``.

    Args:
        draft_token_ids: int ``[num_draft_total]``, all drafts flattened in request order.
        accepted: bool ``[num_draft_total]``, whether each draft passed its own test (later drafts of a row are
            ignored once one fails).
        recovered_token_ids: int ``[num_draft_total]``, the token to emit if that draft is the first rejected one.
        bonus_token_ids: int ``[num_reqs]``.
        num_draft_tokens: ``d_i`` per request.
    Returns:
        int32 ``[num_reqs, max(d_i) + 1]``.
    """
    num_reqs = len(num_draft_tokens)
    max_len = max(num_draft_tokens, default=0)
    d = torch.as_tensor(list(num_draft_tokens), dtype=torch.long)
    rows = torch.arange(num_reqs)
    col = torch.arange(max_len + 1)
    valid = col.unsqueeze(0) < d.unsqueeze(1)  # [num_reqs, max_len + 1]: where row i has a draft

    def grid(flat: torch.Tensor, fill) -> torch.Tensor:
        # Scatter the flat per-draft values into a padded [num_reqs, max_len + 1] grid.
        g = torch.full((num_reqs, max_len + 1), fill, dtype=flat.dtype)
        g[valid] = flat
        return g

    acc = grid(accepted.to(torch.bool), False)
    drafts = grid(draft_token_ids.to(torch.long), PLACEHOLDER_TOKEN_ID)
    # The token after the kept drafts: the recovered one at the first rejection, or the bonus at column d_i.
    after = grid(recovered_token_ids.to(torch.long), PLACEHOLDER_TOKEN_ID)
    after[rows, d] = bonus_token_ids.to(torch.long)
    # Number of leading accepted drafts: the cumulative product stays 1 until the first rejection.
    num_accepted = acc.to(torch.long).cumprod(dim=1).sum(dim=1)  # [num_reqs], <= d_i
    keep = col.unsqueeze(0) < num_accepted.unsqueeze(1)
    out = torch.where(keep, drafts, torch.full_like(drafts, PLACEHOLDER_TOKEN_ID))
    out[rows, num_accepted] = after[rows, num_accepted]
    return out.to(torch.int32)


class RejectionSampler(nn.Module):
    """Verifies the drafts of a batch against the target model's logits."""

    def forward(self, metadata: SpecDecodeMetadata, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                sampling_metadata: SamplingMetadata) -> SamplerOutput:
        """
        Args:
            metadata: the drafts and the logits rows that score them.
            draft_probs: float ``[num_draft_total, vocab_size]`` from a model drafter, or ``None`` for a drafter
                without probabilities (n-gram): then each draft counts as certain (``q(x) = 1``).
            logits: ``[sum(d_i + 1), vocab_size]``, the target model's logits at ``metadata.logits_indices``.
            sampling_metadata: per request (``num_reqs`` rows), as for :class:`Sampler`.
        Returns:
            :class:`SamplerOutput` with ``sampled_token_ids`` int32 ``[num_reqs, max_spec_len + 1]``.
        """
        num_rows = sum(metadata.num_draft_tokens) + metadata.num_reqs
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise ValueError(f"logits must have sum(num_draft + 1) = {num_rows} rows, got {tuple(logits.shape)}")
        if sampling_metadata.num_reqs != metadata.num_reqs:
            raise ValueError(f"sampling_metadata has {sampling_metadata.num_reqs} rows, "
                             f"the drafts are for {metadata.num_reqs} requests")
        drafts = metadata.draft_lists()
        rows_md = sampling_metadata.expand_for_drafts(drafts)
        logits = Sampler.apply_logits_processors(logits.to(torch.float32), rows_md)
        target_idx, bonus_idx = metadata.target_logits_indices, metadata.bonus_logits_indices
        draft_ids = metadata.draft_token_ids.to(torch.long)
        greedy_rows = rows_md.temperature < SAMPLING_EPS  # [num_rows]

        argmax = logits.argmax(dim=-1)
        accepted = argmax[target_idx] == draft_ids
        recovered = argmax[target_idx].clone()
        bonus = argmax[bonus_idx].clone()

        if not sampling_metadata.all_greedy:
            probs = Sampler.filtered_probs(logits, rows_md)  # [num_rows, vocab]
            rand_accepted, rand_recovered, rand_bonus = self._random_path(
                probs, draft_probs, draft_ids, metadata, sampling_metadata.generators)
            g_target, g_bonus = greedy_rows[target_idx], greedy_rows[bonus_idx]
            accepted = torch.where(g_target, accepted, rand_accepted)
            recovered = torch.where(g_target, recovered, rand_recovered)
            bonus = torch.where(g_bonus, bonus, rand_bonus)

        out = assemble_spec_output(draft_ids, accepted, recovered, bonus, metadata.num_draft_tokens)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)

    @staticmethod
    def _random_path(probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_ids: torch.Tensor,
                     metadata: SpecDecodeMetadata, generators: dict[int, torch.Generator]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accept/recover/bonus for sampling requests. A seeded request draws, from its own generator and in this
        order, its uniforms, its recovery noise and its bonus noise, so its result does not depend on the batch."""
        target_idx, bonus_idx = metadata.target_logits_indices, metadata.bonus_logits_indices
        n_draft, vocab = draft_ids.shape[0], probs.shape[1]
        starts = [0]
        for d in metadata.num_draft_tokens:
            starts.append(starts[-1] + d)
        uniform = torch.rand(n_draft, device=probs.device)
        row_gens: dict[int, torch.Generator] = {}
        for req, gen in generators.items():
            lo, hi = starts[req], starts[req + 1]
            if hi > lo:
                uniform[lo:hi] = torch.rand(hi - lo, generator=gen, device=probs.device)
                row_gens.update({r: gen for r in range(lo, hi)})

        p = probs[target_idx]  # [n_draft, vocab]
        p_x = p.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
        if draft_probs is None:
            q = torch.zeros_like(p).scatter_(1, draft_ids.unsqueeze(1), 1.0)
        else:
            if draft_probs.shape != p.shape:
                raise ValueError(f"draft_probs must be [{n_draft}, {vocab}], got {tuple(draft_probs.shape)}")
            q = draft_probs.to(torch.float32)
        q_x = q.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
        # u < min(1, p/q)  <=>  u * q < p ; a draft the target gives probability 0 is never kept.
        accepted = (q_x > 0) & (p_x > 0) & (uniform * q_x < p_x)
        residual = (p - q).clamp_min_(0.0)
        # Where p <= q everywhere (only possible if the draft is always kept) fall back to p.
        residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p)
        noise = exponential_noise((n_draft, vocab), row_gens, probs.device) if n_draft else \
            torch.empty(0, vocab, device=probs.device)
        recovered = (residual / noise).argmax(dim=-1) if n_draft else draft_ids.clone()
        bonus = random_sample(probs[bonus_idx], dict(generators))
        return accepted, recovered, bonus

    @staticmethod
    def parse_output(output_token_ids: torch.Tensor, vocab_size: int) -> list[list[int]]:
        """One list per request: the tokens to append (placeholders removed)."""
        rows = output_token_ids.tolist()
        return [[t for t in row if t != PLACEHOLDER_TOKEN_ID and 0 <= t < vocab_size] for row in rows]
