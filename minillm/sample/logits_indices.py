"""Which rows of the hidden states reach the LM head.

A step runs many tokens (whole prefill chunks and single decode tokens, flattened into one ``[num_tokens]``
batch), but only the last scheduled token of each request predicts a new token. So the model runner computes
logits only for ``logits_indices = query_start_loc[1:] - 1``: ``[num_reqs]`` rows instead of ``[num_tokens]``.
With draft tokens, the last ``num_draft + 1`` tokens of a request all need logits (to verify each draft and to
get the bonus token).

vLLM counterpart: ``GPUModelRunner._prepare_inputs`` and ``_calc_spec_decode_metadata``
(``vllm/v1/worker/gpu_model_runner.py``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def compute_logits_indices(query_start_loc: torch.Tensor) -> torch.Tensor:
    """The flat index of each request's last scheduled token.

    Args:
        query_start_loc: int ``[num_reqs + 1]``, cumulative scheduled tokens, starting at 0.
    Returns:
        int64 ``[num_reqs]``.
    """
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 2:
        raise ValueError(f"query_start_loc must be 1-D with num_reqs + 1 >= 2 entries, "
                         f"got {tuple(query_start_loc.shape)}")
    lens = query_start_loc[1:] - query_start_loc[:-1]
    if bool((lens < 1).any()):
        raise ValueError(f"every request needs at least one scheduled token, got lengths {lens.tolist()}")
    return (query_start_loc[1:] - 1).to(torch.long)


def compute_spec_decode_logits_indices(query_start_loc: torch.Tensor, num_draft_tokens: Sequence[int]
                                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits rows when request ``i`` was scheduled with ``num_draft_tokens[i]`` draft tokens at its end.

    Returns:
        ``(logits_indices, target_logits_indices, bonus_logits_indices)``: the flat token indices whose logits
        are computed (``[sum(d_i + 1)]``); then, as positions *within those rows*, the rows that score the drafts
        (``[sum(d_i)]``) and the last row of each request, which gives the bonus token (``[num_reqs]``).
    """
    ends = compute_logits_indices(query_start_loc)
    d = torch.as_tensor(list(num_draft_tokens), dtype=torch.long)
    if d.shape[0] != ends.shape[0]:
        raise ValueError(f"num_draft_tokens has {d.shape[0]} entries, the batch has {ends.shape[0]} requests")
    lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.long)
    if bool((d < 0).any()) or bool((d + 1 > lens).any()):
        raise ValueError(f"num_draft_tokens {d.tolist()} must be >= 0 and < the scheduled lengths {lens.tolist()}")
    counts = d + 1
    req = torch.repeat_interleave(torch.arange(len(d)), counts)
    cu = torch.cumsum(counts, 0)
    offset_in_req = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu - counts, counts)
    logits_indices = ends[req] - d[req] + offset_in_req
    bonus = cu - 1
    is_bonus = torch.zeros(int(cu[-1]), dtype=torch.bool)
    is_bonus[bonus] = True
    target = torch.nonzero(~is_bonus).flatten()
    return logits_indices, target, bonus
