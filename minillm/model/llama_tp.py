"""The Llama model split across ``tp_size`` ranks by tensor parallelism (Megatron-style), one rank's view.

Each rank runs every layer on every token with a slice of each weight: attention's ``qkv_proj`` (column-parallel by
heads) and ``o_proj`` (row-parallel), the MLP's ``gate_up_proj`` and ``down_proj`` likewise, each pair finished by
**one all-reduce**; the embedding split by vocabulary (one all-reduce), the LM head too (one all-gather); the norms
replicated. A forward pass of ``n`` tokens costs ``1 + 2 * num_layers`` all-reduces of ``[n, hidden]``.
:func:`simulate_tensor_parallel_forward` runs all ranks' shards in one process, summing their partials itself.
``minillm/model/llama.py`` stays the single-process model, with separate ``q_proj``/``k_proj``/``v_proj``.

vLLM counterpart: ``vllm/model_executor/models/llama.py`` (``LlamaAttention`` with ``qkv_proj`` and ``o_proj``,
``LlamaMLP`` with ``gate_up_proj`` and ``down_proj``), one model for every ``tensor_parallel_size``.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from minillm.attention.backend import AttentionImpl
from minillm.attention.reference import reference_attention
from minillm.config import LlamaConfig
from minillm.distributed.parallel_state import (
    TensorParallelGroup,
    check_tp_rank,
    simulate_all_gather,
    simulate_all_reduce,
)
from minillm.model.layers import RMSNorm, RotaryEmbedding, share_rotary_cache
from minillm.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, check_token_ids
from minillm.model.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_head_split,
    shard_range,
)


def check_tensor_parallel_config(config: LlamaConfig, tp_size: int) -> None:
    """Raise ValueError if ``config`` cannot be split over ``tp_size`` ranks.

    ``tp_size`` must be an int >= 1; the heads must split (:func:`~minillm.model.parallel_layers.check_head_split`:
    SmolLM2's 9 query heads allow 1, 3 or 9 ranks, and 9 only by replicating each of its 3 KV heads on 3 ranks);
    ``intermediate_size`` must be divisible by ``tp_size`` (SmolLM2's 1,536 features rule 9 out: it runs on 1 or 3).
    The vocabulary and hidden size may be anything. The heads' message is vLLM's
    (``vllm/config/model.py:ModelConfig.verify_with_parallel_config``); the MLP's check is minillm's, made early:
    v0.33.0 finds it only inside each worker (``vllm/distributed/utils.py:ensure_divisibility``, an assertion
    "1536 is not divisible by 9").
    """
    check_tp_rank(0, tp_size)
    check_head_split(config.num_attention_heads, config.num_key_value_heads, tp_size)
    if config.intermediate_size % tp_size:
        raise ValueError(f"intermediate_size ({config.intermediate_size}) must be divisible by tensor parallel size "
                         f"({tp_size})")


def _copy_norm(norm: RMSNorm) -> RMSNorm:
    out = RMSNorm(norm.weight.shape[0], norm.eps)
    out.weight = nn.Parameter(norm.weight.detach().clone(), requires_grad=False)
    return out


class TensorParallelAttention(nn.Module):
    """This rank's attention heads: ``qkv_proj`` -> RoPE -> causal attention -> ``o_proj`` (row-parallel).

    :meth:`partial`: normed ``hidden`` ``[n, hidden]`` -> partial output ``[n, hidden]`` (this rank's heads
    only). ``forward``: the same, all-reduced.

    vLLM: ``vllm/model_executor/models/llama.py:LlamaAttention``.
    """

    def __init__(self, attn: LlamaAttention, config: LlamaConfig, tp_rank: int, tp_size: int,
                 group: TensorParallelGroup | None) -> None:
        super().__init__()
        self.layer_idx = attn.layer_idx
        self.qkv_proj = QKVParallelLinear.from_attention(attn, tp_rank, tp_size)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.o_proj = RowParallelLinear(attn.o_proj, tp_rank, tp_size, group, name=f"layer {self.layer_idx} o_proj")
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)

    def partial(self, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionImpl | None = None
                ) -> torch.Tensor:
        """``[n, hidden]`` (after the input norm) -> this rank's partial attention output ``[n, hidden]``.

        ``attn``: where this rank's K/V history lives (the engine's paged cache of its own KV heads); ``None``:
        plain causal attention over these tokens only (one sequence, no cache)."""
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        # Local query head j reads local KV head j // (num_heads / num_kv_heads): the grouping rule of the full
        # model, which QKVParallelLinear checked holds for this rank's heads. Any attention backend sees only these
        # heads, so the paged cache of a rank holds only its KV heads.
        out = reference_attention(q, k, v) if attn is None else attn.forward(self.layer_idx, q, k, v)
        return self.o_proj.partial(out.reshape(n, self.num_heads * self.head_dim))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionImpl | None = None
                ) -> torch.Tensor:
        """``[n, hidden]`` -> the full attention output ``[n, hidden]`` (one all-reduce)."""
        return self.o_proj.reduce(self.partial(positions, hidden, attn))


class TensorParallelMLP(nn.Module):
    """This rank's slice of the SwiGLU MLP: ``down_proj(silu(gate) * up)`` over ``intermediate / tp`` features.

    vLLM: ``vllm/model_executor/models/llama.py:LlamaMLP``.
    """

    def __init__(self, mlp: LlamaMLP, layer_idx: int, tp_rank: int, tp_size: int,
                 group: TensorParallelGroup | None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear([mlp.gate_proj, mlp.up_proj], tp_rank, tp_size)
        self.down_proj = RowParallelLinear(mlp.down_proj, tp_rank, tp_size, group,
                                           name=f"layer {layer_idx} down_proj")

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` (after the post-attention norm) -> this rank's partial output ``[n, hidden]``."""
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        # silu(gate) * up is per intermediate feature, and this rank holds the same features of gate and up.
        return self.down_proj.partial(nn.functional.silu(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> the full MLP output ``[n, hidden]`` (one all-reduce)."""
        return self.down_proj.reduce(self.partial(x))


class TensorParallelDecoderLayer(nn.Module):
    """One decoder layer on one rank: ``h += all_reduce(attn partial)``; ``h += all_reduce(mlp partial)``.

    The residual stream ``h`` ``[n, hidden]`` is whole on every rank (the all-reduces make it so); only the inside
    of attention and of the MLP is split.

    vLLM: ``vllm/model_executor/models/llama.py:LlamaDecoderLayer``.
    """

    def __init__(self, layer: LlamaDecoderLayer, config: LlamaConfig, tp_rank: int, tp_size: int,
                 group: TensorParallelGroup | None) -> None:
        super().__init__()
        self.self_attn = TensorParallelAttention(layer.self_attn, config, tp_rank, tp_size, group)
        self.mlp = TensorParallelMLP(layer.mlp, layer.self_attn.layer_idx, tp_rank, tp_size, group)
        self.input_layernorm = _copy_norm(layer.input_layernorm)
        self.post_attention_layernorm = _copy_norm(layer.post_attention_layernorm)

    def attn_partial(self, positions: torch.Tensor, h: torch.Tensor, attn: AttentionImpl | None = None
                     ) -> torch.Tensor:
        """Residual stream ``[n, hidden]`` -> this rank's partial attention update ``[n, hidden]``."""
        return self.self_attn.partial(positions, self.input_layernorm(h), attn)

    def mlp_partial(self, h: torch.Tensor) -> torch.Tensor:
        """Residual stream ``[n, hidden]`` (after attention) -> this rank's partial MLP update ``[n, hidden]``."""
        return self.mlp.partial(self.post_attention_layernorm(h))

    def forward(self, positions: torch.Tensor, h: torch.Tensor, attn: AttentionImpl | None = None) -> torch.Tensor:
        """``[n, hidden]`` in and out; two all-reduces."""
        h = h + self.self_attn.o_proj.reduce(self.attn_partial(positions, h, attn))
        return h + self.mlp.down_proj.reduce(self.mlp_partial(h))


class _TensorParallelLlamaModel(nn.Module):
    def __init__(self, model: LlamaForCausalLM, tp_rank: int, tp_size: int, group: TensorParallelGroup | None
                 ) -> None:
        super().__init__()
        config = model.config
        self.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, tp_rank, tp_size, group)
        full_layers = cast(Iterable[LlamaDecoderLayer], model.model.layers)
        self.layers = nn.ModuleList(TensorParallelDecoderLayer(layer, config, tp_rank, tp_size, group)
                                    for layer in full_layers)
        self.norm = _copy_norm(model.model.norm)

    def layer(self, i: int) -> TensorParallelDecoderLayer:
        return cast(TensorParallelDecoderLayer, self.layers[i])


class TensorParallelLlamaForCausalLM(nn.Module):
    """Rank ``tp_rank`` of a :class:`~minillm.model.llama.LlamaForCausalLM` split over ``tp_size`` ranks.

    Args:
        model: the full model; this rank copies its shards out of it (the full model may be dropped afterwards).
        group: the tensor-parallel group; ``tp_rank`` and ``tp_size`` are its rank and world size.
        tp_rank, tp_size: without a group, the shard to build (``forward`` then works only for ``tp_size == 1``;
            run shards of several ranks with :func:`simulate_tensor_parallel_forward`). With a group they may be
            given only if they agree with it.

    Raises:
        ValueError: the model cannot be split over ``tp_size`` ranks (:func:`check_tensor_parallel_config`).

    Module names follow vLLM's Llama (``model.layers[i].self_attn.qkv_proj``, ``mlp.gate_up_proj``, ...).

    vLLM: ``vllm/model_executor/models/llama.py:LlamaForCausalLM`` (built with ``tensor_parallel_size > 1``).
    """

    def __init__(self, model: LlamaForCausalLM, group: TensorParallelGroup | None = None, *,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        if group is not None:
            if (tp_rank is not None and tp_rank != group.rank) or (tp_size is not None and tp_size != group.world_size):
                raise ValueError(f"tp_rank={tp_rank}, tp_size={tp_size} disagree with the group (rank {group.rank} "
                                 f"of {group.world_size})")
            tp_rank, tp_size = group.rank, group.world_size
        else:
            tp_rank = 0 if tp_rank is None else tp_rank
            tp_size = 1 if tp_size is None else tp_size
        self.tp_rank, self.tp_size = check_tp_rank(tp_rank, tp_size)
        check_tensor_parallel_config(model.config, self.tp_size)
        self.config = model.config
        self.group = group
        self.model = _TensorParallelLlamaModel(model, self.tp_rank, self.tp_size, group)
        # Tied like the full model: the LM head shares the embedding's vocabulary shard.
        lm_head_src = self.model.embed_tokens if model.config.tie_word_embeddings else model.lm_head
        self.lm_head = ParallelLMHead(lm_head_src, self.tp_rank, self.tp_size, group)

    def _check_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D [num_tokens], got shape {tuple(input_ids.shape)}")
        check_token_ids(input_ids, self.config.vocab_size)
        if positions is None:
            return torch.arange(input_ids.shape[0], device=input_ids.device)
        if tuple(positions.shape) != tuple(input_ids.shape):
            raise ValueError(f"positions must have the shape of input_ids {tuple(input_ids.shape)}, got "
                             f"{tuple(positions.shape)}")
        return positions

    def embed_partial(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` ids -> this rank's partial embedding ``[n, hidden]`` (zeros for ids outside its vocab slice)."""
        return self.model.embed_tokens.partial(input_ids)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this rank holds, in every layer: what its share of the paged KV cache stores."""
        return self.model.layer(0).self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn: AttentionImpl | None = None) -> torch.Tensor:
        """Run the decoder over a flat run of tokens, this rank's heads and features only.

        Args:
            input_ids: ``[num_tokens]`` token ids (the same on every rank).
            positions: ``[num_tokens]``; default ``0 ... num_tokens-1``.
            attn: where this rank's K/V history lives (the engine's paged cache, ``[num_blocks, block_size,
                num_kv_heads, head_dim]`` per layer with this rank's ``num_kv_heads``); ``None``: plain causal
                prefill of one sequence (no KV cache).

        Returns:
            Final normed hidden states ``[num_tokens, hidden]``, the same on every rank. Costs ``1 + 2 *
            num_layers`` all-reduces of ``[num_tokens, hidden]``.
        """
        positions = self._check_inputs(input_ids, positions)
        h = self.model.embed_tokens(input_ids)
        with share_rotary_cache(positions):
            for layer in self.model.layers:
                h = layer(positions, h, attn)
        return self.model.norm(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> logits ``[n, vocab]`` (fp32), the same on every rank (one all-gather)."""
        return self.lm_head(hidden_states)

    def param_bytes(self) -> int:
        """Bytes of the weights this rank holds (a tied weight counted once; padding rows included)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())  # parameters() skips shared ones


def simulate_tensor_parallel_forward(shards: list[TensorParallelLlamaForCausalLM], input_ids: torch.Tensor,
                                     positions: torch.Tensor | None = None) -> torch.Tensor:
    """Run the shards of ranks ``0 ... tp_size-1`` in one process, layer by layer, as the real ranks would.

    Every place the real ranks all-reduce, this sums their ``partial`` outputs
    (:func:`~minillm.distributed.parallel_state.simulate_all_reduce`) and hands the sum to every rank: one
    residual stream serves them all, since after a real all-reduce every rank holds the same one.

    Args:
        shards: ``[TensorParallelLlamaForCausalLM(model, tp_rank=r, tp_size=k) for r in range(k)]``.
        input_ids, positions: ``[num_tokens]``, as for the full model.

    Returns:
        Final normed hidden states ``[num_tokens, hidden]``, equal to the full model's up to fp32 rounding.
    """
    _check_shards(shards)
    positions = shards[0]._check_inputs(input_ids, positions)
    h = simulate_all_reduce([s.embed_partial(input_ids) for s in shards])
    with share_rotary_cache(positions):
        for i in range(len(shards[0].model.layers)):
            h = h + simulate_all_reduce([s.model.layer(i).attn_partial(positions, h) for s in shards])
            h = h + simulate_all_reduce([s.model.layer(i).mlp_partial(h) for s in shards])
    return shards[0].model.norm(h)


def simulate_tensor_parallel_logits(shards: list[TensorParallelLlamaForCausalLM], hidden_states: torch.Tensor
                                    ) -> torch.Tensor:
    """``[n, hidden]`` -> full logits ``[n, vocab]`` (fp32): each shard's vocabulary slice, concatenated in rank order
    (:func:`~minillm.distributed.parallel_state.simulate_all_gather`), padding dropped."""
    _check_shards(shards)
    full = simulate_all_gather([s.lm_head.partial(hidden_states) for s in shards], dim=-1)
    return full[:, : shards[0].config.vocab_size]


def _check_shards(shards: list[TensorParallelLlamaForCausalLM]) -> None:
    if not shards:
        raise ValueError("give one shard per rank, got none")
    sizes = {s.tp_size for s in shards}
    if sizes != {len(shards)} or [s.tp_rank for s in shards] != list(range(len(shards))):
        raise ValueError(f"give the shards of ranks 0 ... tp_size-1 in order, one each; got ranks "
                         f"{[s.tp_rank for s in shards]} of tp_size {sorted(sizes)}")


@dataclass
class RankShard:
    """What one rank holds when a model is split over ``tp_size`` ranks (from the config alone; no weights).

    Attributes:
        rank, tp_size: which rank, of how many.
        query_heads: global indices of the query heads it computes (every layer).
        kv_heads: global indices of the KV heads it holds; with ``num_kv_head_replicas > 1`` other ranks hold the
            same ones.
        num_kv_head_replicas: how many ranks hold each KV head (1 when KV heads are split, not replicated).
        intermediate_range: ``(start, end)`` of the MLP's intermediate features it holds.
        vocab_range: ``(start, end)`` of the token ids whose embedding rows (and logits) it holds.
        weights: name -> shape of its shard (layer 0 stands for every layer; ``lm_head`` is absent when tied).
        param_bytes: bytes of all its weights (all layers, norms, vocab padding rows; the tied head counted once).
        full_param_bytes: the same for the unsplit model.
        kv_cache_bytes_per_token: bytes of K and V it caches per token (all layers, its KV heads). It stops
            shrinking once ranks outnumber KV heads: replicas cache the same heads.
    """

    rank: int
    tp_size: int
    query_heads: list[int]
    kv_heads: list[int]
    num_kv_head_replicas: int
    intermediate_range: tuple[int, int]
    vocab_range: tuple[int, int]
    weights: dict[str, tuple[int, ...]]
    param_bytes: int
    full_param_bytes: int
    kv_cache_bytes_per_token: int


def _param_count(config: LlamaConfig, num_heads: int, num_kv_heads: int, intermediate: int, vocab_rows: int) -> int:
    h, d = config.hidden_size, config.head_dim
    layer = (num_heads + 2 * num_kv_heads) * d * h + h * num_heads * d + 3 * intermediate * h + 2 * h
    embed = vocab_rows * h * (1 if config.tie_word_embeddings else 2)
    return embed + config.num_hidden_layers * layer + h


def shard_summary(config: LlamaConfig, tp_size: int, dtype_bytes: int = 4) -> list[RankShard]:
    """Which heads, features, vocabulary rows and bytes each of ``tp_size`` ranks holds; one :class:`RankShard` per
    rank, in rank order, computed from the config (for tables and figures; it agrees with the shapes and bytes of
    :class:`TensorParallelLlamaForCausalLM`, which tests check).

    Raises:
        ValueError: the model cannot be split over ``tp_size`` ranks.
    """
    check_tensor_parallel_config(config, tp_size)
    h, d, v = config.hidden_size, config.head_dim, config.vocab_size
    nh, nkv = config.num_attention_heads // tp_size, max(1, config.num_key_value_heads // tp_size)
    replicas = max(1, tp_size // config.num_key_value_heads)
    inter = config.intermediate_size // tp_size
    rows = -(-v // tp_size)
    full = _param_count(config, config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, v)
    out = []
    for r in range(tp_size):
        kv_shard = r // replicas
        weights = {"model.embed_tokens": (rows, h),
                   "model.layers.0.self_attn.qkv_proj": ((nh + 2 * nkv) * d, h),
                   "model.layers.0.self_attn.o_proj": (h, nh * d),
                   "model.layers.0.mlp.gate_up_proj": (2 * inter, h),
                   "model.layers.0.mlp.down_proj": (h, inter),
                   "model.layers.0.input_layernorm": (h,),
                   "model.layers.0.post_attention_layernorm": (h,),
                   "model.norm": (h,)}
        if not config.tie_word_embeddings:
            weights["lm_head"] = (rows, h)
        out.append(RankShard(
            rank=r, tp_size=tp_size, query_heads=list(range(r * nh, (r + 1) * nh)),
            kv_heads=list(range(kv_shard * nkv, (kv_shard + 1) * nkv)), num_kv_head_replicas=replicas,
            intermediate_range=shard_range(config.intermediate_size, r, tp_size, "intermediate_size"),
            vocab_range=(min(r * rows, v), min((r + 1) * rows, v)), weights=weights,
            param_bytes=_param_count(config, nh, nkv, inter, rows) * dtype_bytes,
            full_param_bytes=full * dtype_bytes,
            kv_cache_bytes_per_token=2 * config.num_hidden_layers * nkv * d * dtype_bytes))
    return out
