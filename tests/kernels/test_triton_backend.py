"""The real model through a paged KV cache: the Triton kernels give the logits of the PyTorch backend.

Two requests, two steps, the shapes chunked prefill produces: step 1 is the first chunk of prompt A and the whole
prompt B; step 2 is the rest of A (a middle chunk with a cached context) and one decode token of B. Every row of
logits is compared.

Tolerance: 1e-3 absolute on logits of magnitude ~30 (fp32). Both backends compute attention in fp32 but sum in a
different order (tiles and online rescaling vs one softmax); the difference, ~1e-6 per attention output, grows
through 30 layers to ~1e-4 in the logits (measured 7e-5 to 8e-5). The greedy tokens must be identical.
"""
from __future__ import annotations

import pytest
import torch

from minillm.attention.paged import allocate_kv_caches, forward_paged

BLOCK_SIZE = 16


def _two_steps(model, ids_a: list[int], ids_b: list[int], backend: str) -> list[torch.Tensor]:
    caches = allocate_kv_caches(model.config, num_blocks=8, block_size=BLOCK_SIZE)
    blocks = [[3, 6], [5, 1, 7]]  # scattered, and not in request order
    chunk = 9  # A's first chunk: its second chunk then has a context ending inside block 3
    with torch.no_grad():
        h1 = forward_paged(model, caches, [ids_a, ids_b], blocks, [0, 0], [chunk, len(ids_b)], BLOCK_SIZE, backend)
        h2 = forward_paged(model, caches, [ids_a, ids_b + [ids_b[-1]]], blocks, [chunk, len(ids_b)],
                           [len(ids_a) - chunk, 1], BLOCK_SIZE, backend)
        return [model.compute_logits(h1), model.compute_logits(h2)]


@pytest.mark.slow
def test_triton_backend_matches_torch_backend_on_the_real_model(model, tokenizer):
    ids_a = tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    ids_b = tokenizer.encode("Red, green and")
    assert len(ids_a) > 9 and len(ids_b) + 1 <= 3 * BLOCK_SIZE
    want = _two_steps(model, ids_a, ids_b, "torch")
    got = _two_steps(model, ids_a, ids_b, "triton")
    for step, (w, g) in enumerate(zip(want, got), start=1):
        assert g.shape == w.shape
        err = (g - w).abs().max().item()
        assert err <= 1e-3, f"step {step}: logits differ by {err:.2e}"
        assert torch.equal(g.argmax(-1), w.argmax(-1)), f"step {step}: greedy tokens differ"

