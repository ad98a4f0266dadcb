"""Models in another dtype for the tests, made from the session's fp32 ones in a blink instead of a 10 s load."""
from __future__ import annotations

import copy

import torch


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in bf16, its RoPE ``inv_freq`` buffers kept in fp32 (as both loaders do for ``dtype=bf16``)."""
    freqs = {name: buf for name, buf in model.named_buffers() if name.rpartition(".")[2].endswith("inv_freq")}
    out = copy.deepcopy(model).to(torch.bfloat16)
    for name, buf in freqs.items():
        owner, _, attr = name.rpartition(".")
        setattr(out.get_submodule(owner), attr, buf.clone())
    return out.eval()
