"""A Llama-architecture decoder in plain PyTorch, with attention delegated to an :class:`AttentionImpl`.

Tokens are laid out flat, as in vLLM: ``input_ids`` and ``positions`` are ``[num_tokens]`` with no batch
dimension, so one forward pass can carry a chunk of one prompt or (from chapter 6) the tokens of many requests.

vLLM counterpart: ``vllm/model_executor/models/llama.py`` (``LlamaForCausalLM``, ``LlamaModel``,
``LlamaDecoderLayer``, ``LlamaAttention``, ``LlamaMLP``). vLLM fuses q/k/v into one ``qkv_proj`` and gate/up into
one ``gate_up_proj`` and shards them for tensor parallelism; here they stay separate so each is easy to read.
"""
from __future__ import annotations

import torch
from torch import nn

from minillm.attention.backend import AttentionImpl
from minillm.attention.contiguous import ContiguousKVCache
from minillm.config import LlamaConfig
from minillm.model.layers import RMSNorm, RotaryEmbedding, share_rotary_cache


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse ``input_ids`` that are not integer token ids in ``[0, vocab_size)``, naming the bad ones, before an
    embedding lookup fails on them deep inside the model."""
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab_size)]
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {bad[:8].tolist()}"
                         f"{' ...' if bad.numel() > 8 else ''}")


class LlamaAttention(nn.Module):
    """Project to q, k, v; rotate q and k; attend through ``attn``; project back.

    Grouped-query attention: ``num_attention_heads`` query heads share ``num_key_value_heads`` K/V heads.
    """

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.rope_theta)

    def qkv(self, positions: torch.Tensor, hidden_states: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden_states`` ``[num_tokens, hidden]`` -> rotated ``q`` ``[num_tokens, num_heads, head_dim]``,
        rotated ``k`` and ``v`` ``[num_tokens, num_kv_heads, head_dim]``. These k, v are what the KV cache stores."""
        n = hidden_states.shape[0]
        q = self.q_proj(hidden_states).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, attn: AttentionImpl) -> torch.Tensor:
        """``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``."""
        q, k, v = self.qkv(positions, hidden_states)
        out = attn.forward(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(hidden_states.shape[0], self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # vLLM fuses gate/up into one matmul and applies SiluAndMul to the [num_tokens, 2 * intermediate] result;
        # with two separate projections, multiplying the halves directly avoids building that copy (~20% of a
        # prefill layer on a CPU).
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x))``; ``out = h + mlp(norm(h))``."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, attn: AttentionImpl) -> torch.Tensor:
        """The residual stream in and out: ``[num_tokens, hidden]``."""
        h = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states), attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, the decoder layers, and the final norm."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionImpl,
                hidden_states_out: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``[num_tokens]`` ids and positions -> final normed hidden states ``[num_tokens, hidden]``.

        If ``hidden_states_out`` is a list, the residual stream entering each layer is appended to it
        (``num_layers`` tensors ``[num_tokens, hidden]``), for experiments that look inside the model.
        """
        h = self.embed_tokens(input_ids)
        with share_rotary_cache(positions):  # the angles are computed once, not once per layer
            for layer in self.layers:
                if hidden_states_out is not None:
                    hidden_states_out.append(h)
                h = layer(positions, h, attn)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """The whole model: ``forward`` gives hidden states, ``compute_logits`` turns the rows you need into logits.

    Splitting the two, as vLLM does, lets the engine run the LM head only at ``logits_indices`` (the last token of
    each request), not at every prompt token.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_kv_cache(self, capacity: int = 256) -> ContiguousKVCache:
        """An empty contiguous KV cache for one sequence of this model."""
        return ContiguousKVCache.for_model(self, capacity)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn: AttentionImpl | None = None,
                hidden_states_out: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Run the decoder over a flat run of tokens.

        Args:
            input_ids: ``[num_tokens]`` token ids.
            positions: ``[num_tokens]`` absolute positions; default ``0 ... num_tokens-1`` (a fresh prompt).
            attn: where K/V history lives and how attention is computed. ``None``: a throw-away contiguous cache,
                i.e. plain causal attention over these tokens only.
            hidden_states_out: optional list that receives the residual stream entering each layer.

        Returns:
            Final normed hidden states ``[num_tokens, hidden_size]``.
        """
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D [num_tokens] (tokens are laid out flat), got shape "
                             f"{tuple(input_ids.shape)}")
        if positions is not None and tuple(positions.shape) != tuple(input_ids.shape):
            raise ValueError(f"positions must have the shape of input_ids {tuple(input_ids.shape)} (one position per "
                             f"token), got {tuple(positions.shape)}")
        check_token_ids(input_ids, self.config.vocab_size)
        if positions is None:
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        if attn is None:
            attn = self.new_kv_cache(capacity=max(1, input_ids.shape[0]))
        return self.model(input_ids, positions, attn, hidden_states_out)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> logits ``[n, vocab_size]`` (fp32)."""
        return self.lm_head(hidden_states).float()
