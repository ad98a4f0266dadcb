"""The simplest generation loop: one prompt, a contiguous KV cache, greedy or temperature sampling.

This is the baseline later chapters beat: it serves one request at a time and pays Python overhead per token.
vLLM's equivalent path is ``LLM.generate`` through the whole engine (chapter 6).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from minillm.model.llama import LlamaForCausalLM


@torch.inference_mode()
def generate_tokens(model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int = 32,
                    temperature: float = 0.0, eos_token_id: int | None = None,
                    generator: torch.Generator | None = None) -> Iterator[int]:
    """Yield new token ids one by one: prefill the prompt once, then decode one token per step.

    Args:
        prompt_ids: the prompt's token ids (at least one).
        max_new_tokens: how many tokens at most.
        temperature: 0 is greedy (argmax); above 0 samples from ``softmax(logits / temperature)``.
        eos_token_id: stop after yielding this id (``None``: the model config's EOS).
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; give at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
    cache = model.new_kv_cache(capacity=len(prompt_ids) + max_new_tokens)
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=model.device)
    positions = torch.arange(len(prompt_ids), device=model.device)
    for _ in range(max_new_tokens):
        hidden = model(ids, positions, attn=cache)
        logits = model.compute_logits(hidden[-1:])[0]
        if temperature == 0:
            token = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        yield token
        if token == eos:
            return
        ids = torch.tensor([token], dtype=torch.long, device=model.device)
        positions = torch.tensor([cache.num_tokens], device=model.device)


def generate(model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int = 32, temperature: float = 0.0,
             eos_token_id: int | None = None, generator: torch.Generator | None = None) -> list[int]:
    """All new token ids of :func:`generate_tokens` as a list (EOS included if it was produced)."""
    return list(generate_tokens(model, prompt_ids, max_new_tokens, temperature, eos_token_id, generator))
