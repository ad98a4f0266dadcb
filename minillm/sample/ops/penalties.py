"""Repetition, frequency and presence penalties for a batch, each row with its own values.

vLLM counterpart: ``vllm/v1/sample/ops/penalties.py`` (``apply_all_penalties``) and
``vllm/model_executor/layers/utils.py`` (``apply_penalties``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str = "cpu"
                 ) -> torch.Tensor:
    """How often each vocabulary id occurs in each row: int64 ``[num_rows, vocab_size]``.

    Rows are padded with the id ``vocab_size`` (one past the vocabulary) and that extra column is dropped, so
    rows of different lengths count in one ``scatter_add``.
    """
    rows = len(token_ids)
    width = max((len(t) for t in token_ids), default=0)
    padded = torch.full((rows, max(width, 1)), vocab_size, dtype=torch.long, device=device)
    for r, t in enumerate(token_ids):
        if len(t):
            padded[r, :len(t)] = torch.as_tensor(list(t), dtype=torch.long, device=device)
    if bool((padded < 0).any()) or bool((padded > vocab_size).any()):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {padded.min().item()}..{padded.max().item()}")
    counts = torch.zeros(rows, vocab_size + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]], presence_penalties: torch.Tensor,
                    frequency_penalties: torch.Tensor, repetition_penalties: torch.Tensor) -> torch.Tensor:
    """Penalise tokens a row has already seen. Returns new logits ``[num_rows, vocab_size]``.

    * repetition (multiplicative, prompt and output tokens): a seen token's logit ``l`` becomes ``l / r`` if
      ``l > 0`` else ``l * r`` -- with ``r > 1`` both push the token down;
    * frequency (output tokens only): ``l -= f * count``;
    * presence (output tokens only): ``l -= p * [count > 0]``.

    Args:
        logits: float ``[num_rows, vocab_size]``.
        prompt_token_ids / output_token_ids: per row.
        presence_penalties / frequency_penalties / repetition_penalties: float ``[num_rows]``.
    """
    num_rows, vocab_size = logits.shape
    out_counts = token_counts(output_token_ids, vocab_size, logits.device)
    seen = (token_counts(prompt_token_ids, vocab_size, logits.device) > 0) | (out_counts > 0)
    rep = repetition_penalties.to(logits.dtype).unsqueeze(1)
    scale = torch.where(seen, rep, torch.ones_like(rep))
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits = logits - frequency_penalties.to(logits.dtype).unsqueeze(1) * out_counts.to(logits.dtype)
    logits = logits - presence_penalties.to(logits.dtype).unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits
