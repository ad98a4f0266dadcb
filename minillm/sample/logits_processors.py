"""Built-in logits processors: min-p filtering and the ``min_tokens`` block on stop tokens.

vLLM counterpart: ``vllm/v1/sample/logits_processor/builtin.py`` (``MinPLogitsProcessor``,
``MinTokensLogitsProcessor``).
"""
from __future__ import annotations

import torch


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Drop (set to ``-inf``) tokens whose probability is below ``min_p`` times the row's largest probability.

    Args:
        logits: float ``[num_rows, vocab_size]`` after temperature.
        min_p: float ``[num_rows]`` in ``[0, 1]`` (0 = off), or ``None`` when no row uses it.
    """
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p.to(probs.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_min_tokens(logits: torch.Tensor, min_tokens: dict[int, tuple[int, set[int]]]) -> torch.Tensor:
    """Block EOS and stop token ids for rows that have not generated ``min_tokens`` tokens yet.

    Masking the logits (rather than ignoring EOS after sampling) means the request really produces ``min_tokens``
    non-stop tokens drawn from the renormalised rest of the distribution.

    Args:
        logits: float ``[num_rows, vocab_size]``.
        min_tokens: row -> ``(min_tokens, token ids to block)``, only rows still under their minimum.
    """
    if not min_tokens:
        return logits
    logits = logits.clone()
    for row, (_, block) in min_tokens.items():
        ids = [t for t in block if 0 <= t < logits.shape[1]]
        if ids:
            logits[row, ids] = float("-inf")
    return logits
