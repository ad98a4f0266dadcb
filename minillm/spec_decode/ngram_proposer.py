"""Prompt-lookup drafting: guess the next tokens by finding the current suffix earlier in the sequence.

If the last ``n`` tokens already occurred earlier (in the prompt or the output), the tokens that followed that
occurrence are a cheap guess for what comes next -- often right when the model copies from its context (code
edits, quoting, summaries). No draft model, no probabilities: the rejection sampler treats each draft as certain.

vLLM counterpart: ``vllm/v1/spec_decode/ngram_proposer.py`` (``NgramProposer``).
"""
from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` drafts from an earlier match of the sequence's suffix.

    Args:
        prompt_lookup_min: shortest suffix (n-gram) to look for, ``>= 1``.
        prompt_lookup_max: longest suffix to look for, ``>= prompt_lookup_min``; longer matches are tried first.
        num_speculative_tokens: the most drafts to propose, ``>= 1``.
    """

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3, num_speculative_tokens: int = 3
                 ) -> None:
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({prompt_lookup_max}) must be >= prompt_lookup_min "
                             f"({prompt_lookup_min})")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """Drafts for a sequence (prompt + outputs so far); ``[]`` when no suffix of length ``min_n..max_n``
        occurs earlier. Among matches of the longest suffix, the earliest occurrence is used (as vLLM does)."""
        tokens = list(token_ids)
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n:]
            # Start positions whose n-gram is followed by at least one token (so the match is not the suffix).
            for start in range(0, total - n):
                if tokens[start:start + n] == suffix:
                    follow = tokens[start + n:start + n + self.k]
                    return follow
        return []
