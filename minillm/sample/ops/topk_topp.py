"""Top-k and top-p (nucleus) masking for a batch with per-row ``k`` and ``p``, in one sort.

vLLM counterpart: ``vllm/v1/sample/ops/topk_topp_sampler.py`` (``apply_top_k_top_p``).
"""
from __future__ import annotations

import torch


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Set to ``-inf`` every logit outside a row's top-k and outside its top-p nucleus.

    Top-k keeps the tokens whose logit is at least the k-th largest (ties at the threshold are kept, so a row may
    keep a few more than ``k``). Top-p is applied after top-k, on the renormalised distribution: it keeps the
    smallest set of most likely tokens whose probability sums to at least ``p`` (always at least one token).

    Args:
        logits: float ``[num_rows, vocab_size]`` (after temperature).
        k: int ``[num_rows]``; ``0`` or ``>= vocab_size`` means no top-k for that row. ``None``: no row uses it.
        p: float ``[num_rows]`` in ``(0, 1]``; ``1`` means no top-p for that row. ``None``: no row uses it.

    Returns:
        New logits, same shape; kept entries unchanged.
    """
    if k is None and p is None:
        return logits
    vocab_size = logits.shape[-1]
    # Ascending sort: the tokens to drop are always a prefix of each sorted row.
    logits_sort, order = logits.sort(dim=-1, descending=False)
    if k is not None:
        k = k.to(torch.long).clamp(min=0)
        k = torch.where((k == 0) | (k > vocab_size), torch.full_like(k, vocab_size), k)
        threshold = logits_sort.gather(1, (vocab_size - k).unsqueeze(1))  # the k-th largest logit
        logits_sort = logits_sort.masked_fill(logits_sort < threshold, float("-inf"))
    if p is not None:
        probs_sort = logits_sort.softmax(dim=-1)
        cum = probs_sort.cumsum(dim=-1)
        # Drop a token when all tokens up to and including it (the least likely ones) hold at most 1 - p.
        drop = cum <= (1.0 - p.to(cum.dtype)).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, logits_sort)
