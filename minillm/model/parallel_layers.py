"""Megatron-style tensor-parallel layers: each rank holds one shard of a full layer's weight.

A **column-parallel** layer (:class:`ColumnParallelLinear`) splits ``W [out, in]`` by output features: each rank
computes its slice of ``y`` from the full ``x``, no communication. A **row-parallel** one (:class:`RowParallelLinear`)
splits the input features: each rank computes a *partial* ``y`` from its slice of ``x``, and one all-reduce sums
them. Column then row costs one all-reduce per pair. :class:`VocabParallelEmbedding` and :class:`ParallelLMHead`
split the vocabulary. Each layer copies its shard out of the full layer; ``partial`` is its computation without
the communication, which a one-process simulation sums itself.

vLLM counterparts: ``vllm/model_executor/layers/linear.py`` (``ColumnParallelLinear``, ``MergedColumnParallelLinear``,
``QKVParallelLinear``, ``RowParallelLinear``) and ``vllm/model_executor/layers/vocab_parallel_embedding.py``
(``VocabParallelEmbedding``, ``ParallelLMHead``), which fill empty shards while loading (``weight_loader``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from minillm.distributed.parallel_state import TensorParallelGroup, check_tp_rank

if TYPE_CHECKING:
    from minillm.model.llama import LlamaAttention


def _weight(full: nn.Module | torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``[out, in]`` weight (and bias or ``None``) of an ``nn.Linear``/``nn.Embedding`` or a bare tensor."""
    if isinstance(full, torch.Tensor):
        weight, bias = full, None
    elif isinstance(full, (nn.Linear, nn.Embedding)):
        weight, bias = full.weight, getattr(full, "bias", None)
    else:
        raise TypeError(f"{kind} is built from an nn.Linear, an nn.Embedding or a weight tensor, got "
                        f"{type(full).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"{kind} needs a 2-D weight [out_features, in_features], got shape {tuple(weight.shape)}")
    return weight.detach(), None if bias is None else bias.detach()


def shard_range(size: int, tp_rank: int, tp_size: int, what: str) -> tuple[int, int]:
    """``[start, end)`` of rank ``tp_rank``'s equal slice of ``size`` features.

    Raises:
        ValueError: ``size`` is not divisible by ``tp_size`` (an uneven split would leave ranks with shards of
            different shapes, which the collectives cannot combine; vLLM refuses it too, in
            ``vllm/distributed/utils.py:divide``).
    """
    tp_rank, tp_size = check_tp_rank(tp_rank, tp_size)
    if size % tp_size:
        raise ValueError(f"{what} ({size}) must be divisible by tensor parallel size ({tp_size})")
    per = size // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def _check_group(group: TensorParallelGroup | None, tp_rank: int, tp_size: int, kind: str) -> None:
    if group is not None and (group.rank, group.world_size) != (tp_rank, tp_size):
        raise ValueError(f"{kind} was built for tp_rank={tp_rank}, tp_size={tp_size} but its group is rank "
                         f"{group.rank} of {group.world_size}")


def _reduce(group: TensorParallelGroup | None, tp_size: int, t: torch.Tensor, what: str) -> torch.Tensor:
    if tp_size == 1:
        return t  # one rank holds the whole layer: its "partial" is already the full output
    if group is None:
        raise RuntimeError(f"{what}: this shard has no TensorParallelGroup to all-reduce with; pass one, or sum the "
                           f"ranks' partial() outputs yourself (simulate_all_reduce)")
    return group.all_reduce(t, what=what)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with the output features split: this rank computes ``y[:, start:end]``.

    Args:
        full: the full layer (``nn.Linear``) or its weight ``[out_features, in_features]``.
        tp_rank, tp_size: this rank and the number of ranks; ``out_features % tp_size == 0``.

    Attributes:
        weight: ``[out_features / tp_size, in_features]``, rows ``start ... end-1`` of the full weight.
        start, end: the output features this rank computes.

    ``forward``: ``x`` ``[n, in_features]`` (the full input, the same on every rank) -> ``[n, out_features /
    tp_size]``. No communication.

    vLLM: ``vllm/model_executor/layers/linear.py:ColumnParallelLinear`` (with ``gather_output=False``, as every
    Llama layer uses it).
    """

    def __init__(self, full: nn.Linear | torch.Tensor, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        weight, bias = _weight(full, type(self).__name__)
        self.tp_rank, self.tp_size = check_tp_rank(tp_rank, tp_size)
        self.output_size, self.input_size = weight.shape
        self.start, self.end = shard_range(self.output_size, tp_rank, tp_size, "out_features")
        self.output_size_per_partition = self.end - self.start
        self.weight = nn.Parameter(weight[self.start:self.end].clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias[self.start:self.end].clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, in_features]`` -> this rank's slice ``[n, out_features / tp_size]``."""
        return nn.functional.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel layers with the same input fused into one matmul (``gate_proj`` and ``up_proj``).

    Each full layer is split by its own output features and the shards are stacked: rank ``r`` holds ``[gate
    shard; up shard]``, so the ``silu(gate) * up`` that follows pairs each rank's gate features with the same
    features of ``up``, which it also holds. (Splitting the concatenated ``[gate; up]`` weight in one piece would
    give rank 0 only gate rows and the last rank only up rows.)

    Args:
        fulls: the full layers (``nn.Linear``) or weights ``[out_i, in_features]``, one input size for all.
        tp_rank, tp_size: every ``out_i % tp_size == 0``.

    ``forward``: ``x`` ``[n, in_features]`` -> ``[n, sum(out_i) / tp_size]``, the slices in the order of
    ``fulls``; :meth:`split` cuts it back into them.

    vLLM: ``vllm/model_executor/layers/linear.py:MergedColumnParallelLinear`` (Llama's ``gate_up_proj``).
    """

    def __init__(self, fulls: list[nn.Linear | torch.Tensor] | tuple[nn.Linear | torch.Tensor, ...], tp_rank: int,
                 tp_size: int) -> None:
        super().__init__()
        if not fulls:
            raise ValueError("MergedColumnParallelLinear needs at least one layer")
        shards = [ColumnParallelLinear(f, tp_rank, tp_size) for f in fulls]
        if len({s.input_size for s in shards}) != 1:
            raise ValueError(f"the merged layers must share one input size, got {[s.input_size for s in shards]}")
        if len({s.bias is None for s in shards}) != 1:
            raise ValueError("either every merged layer has a bias or none has")
        self.tp_rank, self.tp_size = shards[0].tp_rank, shards[0].tp_size
        self.input_size = shards[0].input_size
        self.output_sizes = [s.output_size for s in shards]
        self.output_sizes_per_partition = [s.output_size_per_partition for s in shards]
        self.weight = nn.Parameter(torch.cat([s.weight for s in shards]), requires_grad=False)
        biases: list[torch.Tensor] = [s.bias for s in shards if s.bias is not None]  # all or none, checked above
        self.bias = nn.Parameter(torch.cat(biases), requires_grad=False) if biases else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, in_features]`` -> ``[n, sum(out_i) / tp_size]`` (this rank's slice of each layer, side by side)."""
        return nn.functional.linear(x, self.weight, self.bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Cut :meth:`forward`'s output into one ``[n, out_i / tp_size]`` view per merged layer."""
        return tuple(torch.split(y, self.output_sizes_per_partition, dim=-1))


def check_head_split(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Refuse a split of attention heads that tensor parallelism cannot do, as vLLM does.

    - ``num_heads % tp_size`` must be 0: every rank gets the same number of whole query heads. vLLM checks this in
      ``vllm/config/model.py:ModelConfig.verify_with_parallel_config``, with the message "Total number of attention
      heads (9) must be divisible by tensor parallel size (2)." (SmolLM2 on 2 ranks).
    - ``tp_size <= num_kv_heads``: KV heads are split, so ``num_kv_heads % tp_size`` must be 0.
    - ``tp_size > num_kv_heads``: each KV head is *replicated* on ``tp_size / num_kv_heads`` ranks, so ``tp_size %
      num_kv_heads`` must be 0 (``QKVParallelLinear`` in ``vllm/model_executor/layers/linear.py`` asserts the same
      through ``divide``).
    """
    _, tp_size = check_tp_rank(0, tp_size)
    if num_heads % tp_size:
        raise ValueError(f"Total number of attention heads ({num_heads}) must be divisible by tensor parallel size "
                         f"({tp_size}).")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if tp_size <= num_kv_heads and num_kv_heads % tp_size:
        raise ValueError(f"Total number of KV heads ({num_kv_heads}) must be divisible by tensor parallel size "
                         f"({tp_size}) when there are at least as many KV heads as ranks.")
    if tp_size > num_kv_heads and tp_size % num_kv_heads:
        raise ValueError(f"Tensor parallel size ({tp_size}) must be a multiple of the number of KV heads "
                         f"({num_kv_heads}) when ranks outnumber KV heads (each KV head is replicated on the same "
                         f"number of ranks).")


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """The KV heads each of ``tp_size`` ranks holds (and caches): split when there are enough, else one, replicated.

    vLLM v0.33.0 computes the same in ``vllm/config/model.py:ModelConfig.get_num_kv_heads``: the total KV heads
    divided by the tensor-parallel size, at least 1.
    """
    return max(1, num_kv_heads // tp_size)


class QKVParallelLinear(nn.Module):
    """The q, k and v projections split by attention heads, fused into one matmul.

    Rank ``r`` holds query heads ``r*H/tp ... (r+1)*H/tp - 1`` (``H = num_heads``). K/V heads:

    - ``tp_size <= num_kv_heads``: split the same way, ``num_kv_heads / tp_size`` heads per rank;
    - ``tp_size > num_kv_heads``: too few to split, so each rank holds one KV head, *replicated*:
      ``num_kv_head_replicas = tp_size / num_kv_heads`` ranks hold the same one, rank ``r`` holding KV head ``r //
      num_kv_head_replicas``.

    Either way grouped-query attention survives: query head ``h`` uses KV head ``h // (H / num_kv_heads)``, and
    that head is on the rank that holds ``h`` (:attr:`kv_head_of_local_query` maps each local query head to the
    local KV head it reads).

    Args:
        q, k, v: the full projections (``nn.Linear``) or weights: ``[num_heads*head_dim, hidden]`` and
            ``[num_kv_heads*head_dim, hidden]`` twice.
        num_heads, num_kv_heads, head_dim: the full model's.
        tp_rank, tp_size: see :func:`check_head_split` for what is allowed.

    ``forward``: ``x`` ``[n, hidden]`` -> ``(q [n, num_heads/tp * head_dim], k [n, local_kv * head_dim], v
    [n, local_kv * head_dim])``.

    vLLM: ``vllm/model_executor/layers/linear.py:QKVParallelLinear`` (``num_kv_head_replicas``; the rank picks its KV
    shard as ``tp_rank // num_kv_head_replicas`` in ``QKVParallelLinear.weight_loader``).
    """

    def __init__(self, q: nn.Linear | torch.Tensor, k: nn.Linear | torch.Tensor, v: nn.Linear | torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = check_tp_rank(tp_rank, tp_size)
        check_head_split(num_heads, num_kv_heads, tp_size)
        (wq, bq), (wk, bk), (wv, bv) = (_weight(t, type(self).__name__) for t in (q, k, v))
        if wq.shape[0] != num_heads * head_dim or wk.shape[0] != num_kv_heads * head_dim or wv.shape != wk.shape:
            raise ValueError(f"q/k/v weights {tuple(wq.shape)}, {tuple(wk.shape)}, {tuple(wv.shape)} do not match "
                             f"num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}")
        self.total_num_heads, self.total_num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_heads = num_heads // tp_size
        if tp_size >= num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // num_kv_heads
        else:
            self.num_kv_heads = num_kv_heads // tp_size
            self.num_kv_head_replicas = 1
        kv_shard = tp_rank // self.num_kv_head_replicas  # which block of num_kv_heads KV heads this rank holds
        self.query_heads = list(range(tp_rank * self.num_heads, (tp_rank + 1) * self.num_heads))
        self.kv_heads = list(range(kv_shard * self.num_kv_heads, (kv_shard + 1) * self.num_kv_heads))
        group = num_heads // num_kv_heads
        # Local query head j reads local KV head kv_head_of_local_query[j]; checked rather than assumed, because a
        # wrong split would silently pair a query head with another group's keys.
        self.kv_head_of_local_query = [self.kv_heads.index(h // group) if h // group in self.kv_heads else -1
                                       for h in self.query_heads]
        if -1 in self.kv_head_of_local_query:
            raise AssertionError(f"rank {tp_rank}: query heads {self.query_heads} need KV heads "
                                 f"{sorted({h // group for h in self.query_heads})}, the rank holds {self.kv_heads}")
        d = head_dim
        qs, qe = self.query_heads[0] * d, (self.query_heads[-1] + 1) * d
        ks, ke = self.kv_heads[0] * d, (self.kv_heads[-1] + 1) * d
        self.output_sizes_per_partition = [qe - qs, ke - ks, ke - ks]
        self.weight = nn.Parameter(torch.cat([wq[qs:qe], wk[ks:ke], wv[ks:ke]]).clone(), requires_grad=False)
        biases = (bq, bk, bv)
        if len({b is None for b in biases}) != 1:
            raise ValueError("either all of q, k, v have a bias or none has")
        self.bias = (nn.Parameter(torch.cat([bq[qs:qe], bk[ks:ke], bv[ks:ke]]).clone(), requires_grad=False)
                     if bq is not None and bk is not None and bv is not None else None)  # all or none: checked

    @classmethod
    def from_attention(cls, attn: LlamaAttention, tp_rank: int, tp_size: int) -> QKVParallelLinear:
        """This rank's shard of a :class:`~minillm.model.llama.LlamaAttention`'s ``q_proj``, ``k_proj``, ``v_proj``."""
        return cls(attn.q_proj, attn.k_proj, attn.v_proj, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                   tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[n, hidden]`` -> ``q`` ``[n, num_heads*head_dim]``, ``k`` and ``v`` ``[n, num_kv_heads*head_dim]``
        (this rank's heads; ``num_heads`` and ``num_kv_heads`` are the local counts)."""
        qkv = nn.functional.linear(x, self.weight, self.bias)
        q, k, v = torch.split(qkv, self.output_sizes_per_partition, dim=-1)
        return q, k, v


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with the input features split: a partial ``y`` per rank, then one all-reduce.

    Args:
        full: the full layer (``nn.Linear``) or its weight ``[out_features, in_features]``.
        tp_rank, tp_size: ``in_features % tp_size == 0``.
        group: the group to all-reduce over (``None``: only :meth:`partial` may be used, unless ``tp_size == 1``).

    Attributes:
        weight: ``[out_features, in_features / tp_size]``, columns ``start ... end-1`` of the full weight.

    :meth:`partial`: ``x_local`` ``[n, in_features / tp_size]`` (this rank's slice of the input, which is what the
    column-parallel layer before it produced) -> partial ``[n, out_features]``; ``sum over ranks = x W^T + b``.
    ``forward``: the same, all-reduced: ``[n, out_features]``, the full output, on every rank.

    The bias is added by rank 0 only, so the sum counts it once (as vLLM does).

    vLLM: ``vllm/model_executor/layers/linear.py:RowParallelLinear`` (``input_is_parallel=True``,
    ``reduce_results=True``).
    """

    def __init__(self, full: nn.Linear | torch.Tensor, tp_rank: int, tp_size: int,
                 group: TensorParallelGroup | None = None, name: str = "row_parallel") -> None:
        super().__init__()
        weight, bias = _weight(full, type(self).__name__)
        self.tp_rank, self.tp_size = check_tp_rank(tp_rank, tp_size)
        _check_group(group, self.tp_rank, self.tp_size, type(self).__name__)
        self.group, self.name = group, name
        self.output_size, self.input_size = weight.shape
        self.start, self.end = shard_range(self.input_size, tp_rank, tp_size, "in_features")
        self.input_size_per_partition = self.end - self.start
        # A copy, contiguous: a column slice of the full weight is a strided view that would keep the whole
        # matrix alive.
        self.weight = nn.Parameter(weight[:, self.start:self.end].contiguous().clone(), requires_grad=False)
        self.bias = None if bias is None or self.tp_rank else nn.Parameter(bias.clone(), requires_grad=False)

    def partial(self, x_local: torch.Tensor) -> torch.Tensor:
        """``[n, in_features / tp_size]`` -> this rank's partial output ``[n, out_features]`` (no communication)."""
        if x_local.shape[-1] != self.input_size_per_partition:
            raise ValueError(f"{self.name}: expected this rank's input slice of {self.input_size_per_partition} "
                             f"features, got {x_local.shape[-1]} (pass x[..., {self.start}:{self.end}], not the full "
                             f"input)")
        return nn.functional.linear(x_local, self.weight, self.bias)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """All-reduce a partial output of this layer (``[n, out_features]``): the full output, on every rank."""
        return _reduce(self.group, self.tp_size, partial, self.name)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        """``[n, in_features / tp_size]`` -> the full output ``[n, out_features]`` (one all-reduce)."""
        return self.reduce(self.partial(x_local))


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by vocabulary: rank ``r`` holds the rows of token ids ``start ... end-1``.

    Each rank looks up the ids in its range and writes zeros for the others; the sum over ranks (one all-reduce) is
    the full lookup, since exactly one rank holds each id.

    The vocabulary need not be divisible by ``tp_size``: every rank gets ``ceil(vocab / tp_size)`` rows and the
    last rank's extra rows are zeros that no id reaches (vLLM pads the vocabulary too, to a multiple of 64 per
    ``pad_vocab_size``, before dividing it).

    Args:
        full: the full ``nn.Embedding`` or its weight ``[vocab, hidden]``.
        tp_rank, tp_size: this rank and the number of ranks.
        group: the group to all-reduce over (``None``: only :meth:`partial`, unless ``tp_size == 1``).

    Attributes:
        weight: ``[ceil(vocab / tp_size), hidden]``.
        start, end: the token ids this rank holds (``end - start`` may be less than the rows, on the last rank).

    vLLM: ``vllm/model_executor/layers/vocab_parallel_embedding.py:VocabParallelEmbedding`` (the masking is
    ``get_masked_input_and_mask``).
    """

    def __init__(self, full: nn.Embedding | nn.Linear | torch.Tensor, tp_rank: int, tp_size: int,
                 group: TensorParallelGroup | None = None, name: str = "embed_tokens") -> None:
        super().__init__()
        weight, _ = _weight(full, type(self).__name__)
        self.tp_rank, self.tp_size = check_tp_rank(tp_rank, tp_size)
        _check_group(group, self.tp_rank, self.tp_size, type(self).__name__)
        self.group, self.name = group, name
        self.num_embeddings, self.embedding_dim = weight.shape
        self.num_embeddings_per_partition = -(-self.num_embeddings // self.tp_size)
        self.start = min(self.tp_rank * self.num_embeddings_per_partition, self.num_embeddings)
        self.end = min(self.start + self.num_embeddings_per_partition, self.num_embeddings)
        shard = weight.new_zeros(self.num_embeddings_per_partition, self.embedding_dim)
        shard[: self.end - self.start] = weight[self.start:self.end]
        self.weight = nn.Parameter(shard, requires_grad=False)

    def partial(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` token ids -> ``[n, hidden]``: the embedding of ids in ``[start, end)``, zeros for the others."""
        mine = (input_ids >= self.start) & (input_ids < self.end)
        # Ids of other ranks are looked up at local row 0 (any valid row) and then zeroed.
        local = torch.where(mine, input_ids - self.start, torch.zeros_like(input_ids))
        out = nn.functional.embedding(local, self.weight)
        return out.masked_fill_(~mine[:, None], 0.0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` token ids -> ``[n, hidden]``, the full embedding on every rank (one all-reduce)."""
        return _reduce(self.group, self.tp_size, self.partial(input_ids), self.name)


class ParallelLMHead(nn.Module):
    """The LM head split by vocabulary: each rank computes the logits of its token ids, an all-gather joins them.

    Args:
        full: the full ``lm_head`` (``nn.Linear``) or its weight ``[vocab, hidden]``, or a
            :class:`VocabParallelEmbedding` shard to *tie* to (the weights are shared, not copied: SmolLM2 ties its
            LM head to its embedding, and the shards tie the same way because both are split by vocabulary).
        tp_rank, tp_size: this rank and the number of ranks (those of the embedding when tied).
        group: the group to all-gather over.

    :meth:`partial`: ``hidden`` ``[n, hidden]`` -> this rank's logits ``[n, ceil(vocab / tp_size)]`` (padding rows
    give 0). ``forward``: all-gathered and the padding dropped: ``[n, vocab]``, the same on every rank.

    vLLM: ``vllm/model_executor/layers/vocab_parallel_embedding.py:ParallelLMHead`` holds the shard
    (``ParallelLMHead.tie_weights``); the logits are computed and all-gathered by
    ``vllm/model_executor/layers/logits_processor.py:LogitsProcessor`` (``_gather_logits``).
    """

    def __init__(self, full: nn.Linear | torch.Tensor | VocabParallelEmbedding, tp_rank: int, tp_size: int,
                 group: TensorParallelGroup | None = None, name: str = "lm_head") -> None:
        super().__init__()
        self.tp_rank, self.tp_size = check_tp_rank(tp_rank, tp_size)
        _check_group(group, self.tp_rank, self.tp_size, type(self).__name__)
        self.group, self.name = group, name
        if isinstance(full, VocabParallelEmbedding):
            if (full.tp_rank, full.tp_size) != (self.tp_rank, self.tp_size):
                raise ValueError(f"cannot tie rank {self.tp_rank}/{self.tp_size} of the LM head to the embedding "
                                 f"shard of rank {full.tp_rank}/{full.tp_size}")
            shard = full
        else:
            shard = VocabParallelEmbedding(full, tp_rank, tp_size)
        self.num_embeddings, self.start, self.end = shard.num_embeddings, shard.start, shard.end
        self.num_embeddings_per_partition = shard.num_embeddings_per_partition
        self.weight = shard.weight  # the same Parameter when tied

    def partial(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> this rank's logits ``[n, ceil(vocab / tp_size)]`` (fp32; the last rank's padding
        columns are 0 and are dropped after the gather)."""
        return nn.functional.linear(hidden, self.weight).float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> the full logits ``[n, vocab]`` (fp32) on every rank (one all-gather)."""
        local = self.partial(hidden)
        if self.tp_size == 1:
            return local[:, : self.num_embeddings]
        if self.group is None:
            raise RuntimeError(f"{self.name}: this shard has no TensorParallelGroup to all-gather with; pass one, or "
                               f"concatenate the ranks' partial() outputs yourself (simulate_all_gather)")
        return self.group.all_gather(local, dim=-1, what=self.name)[:, : self.num_embeddings]
