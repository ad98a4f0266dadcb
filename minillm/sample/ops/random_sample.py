"""Drawing one token per row from a batch of distributions: the exponential race.

For independent ``E_i ~ Exp(1)``, ``E_i / p_i ~ Exp(rate p_i)``, and the smallest of independent exponentials is
number ``i`` with probability ``p_i / sum_j p_j``. So ``argmax_i p_i / E_i`` is a draw from ``p``: one elementwise
division and one ``argmax`` for the whole batch, no cumulative sum or search, and each row can take its noise from
its own generator.

vLLM counterpart: ``vllm/v1/sample/ops/topk_topp_sampler.py`` (``random_sample``), the V1 model runner's. Model
Runner V2, the default in v0.33.0, runs the same race in log form (Gumbel-max, ``argmax_i log p_i - log E_i``), with
noise hashed from the request's seed and the position: ``vllm/v1/worker/gpu/sample/gumbel.py`` (``gumbel_sample``).
"""
from __future__ import annotations

import torch


def exponential_noise(shape: tuple[int, int], generators: dict[int, torch.Generator],
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """``Exp(1)`` noise ``[num_rows, vocab_size]``; rows in ``generators`` draw from their own generator."""
    q = torch.empty(shape, dtype=torch.float32, device=device)
    if len(generators) != shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # exponential_ can return exactly 0 (u == 0); p / 0 would be inf or NaN and win the argmax.
    return q.clamp_min_(torch.finfo(torch.float32).tiny)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token id per row, drawn from ``probs`` (float ``[num_rows, vocab_size]``, rows sum to 1).

    Returns:
        int64 ``[num_rows]``. Tokens with probability 0 are never chosen.
    """
    num_rows, vocab_size = probs.shape
    q = exponential_noise((num_rows, vocab_size), generators, probs.device)
    return (probs / q).argmax(dim=-1)
