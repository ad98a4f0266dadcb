"""A tiny random Llama for chapter 10: the engine core's bookkeeping does not depend on the model, and on this one a
whole engine run takes a fraction of a second.

Its logits have large gaps (embeddings of std 1, a tied head), so greedy tokens do not depend on fp32 rounding: the
synchronous engine and the engine with async scheduling give exactly the same tokens, on any CPU.
"""
from __future__ import annotations

import torch

from minillm.config import LlamaConfig
from minillm.model.llama import LlamaForCausalLM

# 2 layers, vocabulary 211, 512 positions; no EOS, so requests end on max_tokens or a stop token.
TINY_CONFIG = LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                          eos_token_id=None, bos_token_id=None)


def init_large_gaps(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Redraw ``model``'s weights from torch's global generator so its logits have large gaps: matrices of std 0.2,
    embeddings (tied to the head) of std 1. Returns the model."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    return model


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """The tiny model with weights drawn from ``seed``, in eval mode; the global random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return init_large_gaps(LlamaForCausalLM(TINY_CONFIG).eval())
