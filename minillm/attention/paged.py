"""The paged KV cache: fixed-size blocks of K/V shared by all requests, found through block tables.

Per layer, K and V each live in ``[num_blocks, block_size, num_kv_heads, head_dim]``. A request's token at position
``p`` lives in block ``block_ids[p // block_size]`` at offset ``p % block_size``: flat *slot* ``block_id *
block_size + offset``. A step's ``slot_mapping`` lists every new token's slot, so writing the step's K/V is one
scatter (``reshape_and_cache``). Here: the PyTorch versions (the Triton kernels' reference) and
:class:`PagedAttention`, the :class:`~minillm.attention.backend.AttentionImpl` over a paged cache.

vLLM counterparts: ``vllm/v1/worker/block_table.py`` (``BlockTable``, ``compute_slot_mapping``),
``vllm/_custom_ops.py`` (``reshape_and_cache_flash``), ``vllm/v1/attention/backends/triton_attn.py``
(``TritonAttentionImpl``), ``vllm/v1/attention/ops/triton_unified_attention.py`` (``unified_attention``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from minillm.attention.metadata import AttentionMetadata
from minillm.attention.reference import reference_attention
from minillm.config import LlamaConfig

if TYPE_CHECKING:
    from minillm.model.llama import LlamaForCausalLM

KVCache = tuple[torch.Tensor, torch.Tensor]
BACKENDS = ("torch", "triton")


# -- the tensors ------------------------------------------------------------------------------------------------------
def allocate_kv_caches(config: LlamaConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu", num_kv_heads: int | None = None) -> list[KVCache]:
    """One ``(key_cache, value_cache)`` pair per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Zero-filled. Block 0 is the null block the manager never hands out, so the usable capacity is ``(num_blocks -
    1) * block_size`` tokens. Memory: ``num_blocks * block_size * config.kv_cache_bytes_per_token(dtype size)``.
    ``num_kv_heads``: the KV heads this cache holds; default the model's, fewer on a tensor-parallel rank (its share).
    """
    if num_blocks < 2 or block_size < 1:
        raise ValueError(f"need num_blocks >= 2 (block 0 is the null block) and block_size >= 1, got "
                         f"num_blocks={num_blocks}, block_size={block_size}")
    shape = (num_blocks, block_size, config.num_key_value_heads if num_kv_heads is None else num_kv_heads,
             config.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_hidden_layers)]


def compute_slot_mapping(block_ids: Sequence[int] | torch.Tensor, start: int, end: int, block_size: int,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """Slots of positions ``start ... end-1`` of one request: ``block_ids[p // block_size] * block_size + p %
    block_size``.

    Returns:
        ``[end - start]`` int64.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (tokens per block), got {block_size}")
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
    if end > len(block_ids) * block_size:
        raise ValueError(f"position {end - 1} needs block {(end - 1) // block_size}, but the request has only "
                         f"{len(block_ids)} blocks")
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=device)
    pos = torch.arange(start, end, device=device)
    return ids[pos // block_size] * block_size + pos % block_size


def make_block_table(block_ids: Sequence[Sequence[int]], max_num_blocks: int | None = None,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """Stack requests' block ids into ``[num_reqs, max_num_blocks]`` int32, padded with the null block 0."""
    width = max((len(b) for b in block_ids), default=0) if max_num_blocks is None else max_num_blocks
    if any(len(b) > width for b in block_ids):
        raise ValueError(f"a request has more than max_num_blocks={width} blocks")
    table = torch.zeros(len(block_ids), max(width, 1), dtype=torch.int32)
    for i, ids in enumerate(block_ids):
        table[i, :len(ids)] = torch.as_tensor(list(ids), dtype=torch.int32)
    return table.to(device)


def build_attention_metadata(block_ids: Sequence[Sequence[int]], num_computed_tokens: Sequence[int],
                             num_new_tokens: Sequence[int], block_size: int,
                             device: torch.device | str = "cpu") -> AttentionMetadata:
    """The :class:`AttentionMetadata` of one step.

    Args:
        block_ids: each request's block ids (in token order), covering at least its ``seq_len`` tokens.
        num_computed_tokens: tokens each request already has in the cache (its causal offset).
        num_new_tokens: tokens each request computes this step (at least 1).
        block_size: tokens per block.

    The batch's tokens are request 0's new tokens, then request 1's, and so on.
    """
    n = len(block_ids)
    if not (n == len(num_computed_tokens) == len(num_new_tokens)) or n == 0:
        raise ValueError(f"need the same non-zero number of requests in block_ids ({n}), num_computed_tokens "
                         f"({len(num_computed_tokens)}) and num_new_tokens ({len(num_new_tokens)})")
    if min(num_new_tokens) < 1 or min(num_computed_tokens) < 0:
        raise ValueError(f"num_new_tokens must be >= 1 and num_computed_tokens >= 0, got {list(num_new_tokens)} and "
                         f"{list(num_computed_tokens)}")
    seq_lens = [c + q for c, q in zip(num_computed_tokens, num_new_tokens, strict=True)]
    slots = [compute_slot_mapping(ids, c, s, block_size)
             for ids, c, s in zip(block_ids, num_computed_tokens, seq_lens, strict=True)]
    qsl = [0]
    for q in num_new_tokens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=make_block_table(block_ids, device=device),
        slot_mapping=torch.cat(slots).to(device),
        max_query_len=max(num_new_tokens),
        max_seq_len=max(seq_lens),
    )


# -- PyTorch reference ops --------------------------------------------------------------------------------------------
def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")


def reshape_and_cache_torch(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the caches at ``slot_mapping``, in place.

    Slots ``< 0`` are padding and skipped. The cache's ``[num_blocks, block_size, ...]`` view as ``[num_blocks *
    block_size, ...]`` makes a slot a plain row index.
    """
    _check_cache(key_cache, value_cache)
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"key/value must be [num_tokens, {key_cache.shape[2]}, {key_cache.shape[3]}], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_mapping.long()
    valid = slots >= 0
    if bool((slots[valid] >= num_slots).any()):
        raise ValueError(f"slot {int(slots.max())} is beyond the cache ({num_slots} slots)")
    flat_k = key_cache.view(num_slots, *key_cache.shape[2:])
    flat_v = value_cache.view(num_slots, *value_cache.shape[2:])
    flat_k[slots[valid]] = key[valid].to(key_cache.dtype)
    flat_v[slots[valid]] = value[valid].to(value_cache.dtype)


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
              seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's first ``seq_len`` tokens of K and V as contiguous ``[seq_len, num_kv_heads, head_dim]`` tensors."""
    _check_cache(key_cache, value_cache)
    slots = compute_slot_mapping(block_ids, 0, seq_len, key_cache.shape[1], key_cache.device)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    return (key_cache.view(num_slots, *key_cache.shape[2:])[slots],
            value_cache.view(num_slots, *value_cache.shape[2:])[slots])


def paged_attention_torch(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                          scale: float | None = None, attend: Callable[..., torch.Tensor] | None = None
                          ) -> torch.Tensor:
    """Varlen attention over a paged cache, request by request: gather its K/V, then :func:`reference_attention`
    (or ``attend``).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, the new tokens of all requests, concatenated.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, this step's K/V already written.
        query_start_loc: ``[num_reqs + 1]``; request ``i`` owns rows ``query_start_loc[i] : query_start_loc[i+1]``.
        seq_lens: ``[num_reqs]``, history length of each request (cached context + its new tokens).
        block_table: ``[num_reqs, max_num_blocks]`` block ids.
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        attend: a function ``(q, k, v, ctx_len) -> out`` to use instead of :func:`reference_attention` (exercise
            1.2's signature, with the default scale; ``EngineParts.attention``). ``scale`` must be ``None`` then.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    _check_cache(key_cache, value_cache)
    if attend is not None and scale is not None:
        raise ValueError("attend uses the default scale 1/sqrt(head_dim); pass scale=None with it")
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    if len(qsl) != len(sl) + 1 or block_table.shape[0] != len(sl):
        raise ValueError(f"query_start_loc ({len(qsl)}), seq_lens ({len(sl)}) and block_table ({block_table.shape[0]}"
                         f" rows) disagree on the number of requests")
    out = torch.empty_like(q)
    for i, seq_len in enumerate(sl):
        a, b = qsl[i], qsl[i + 1]
        if b - a > seq_len:
            raise ValueError(f"request {i}: {b - a} new tokens but seq_len {seq_len}")
        k, v = gather_kv(key_cache, value_cache, block_table[i], seq_len)
        if attend is None:
            out[a:b] = reference_attention(q[a:b], k, v, ctx_len=seq_len - (b - a), scale=scale)
        else:
            out[a:b] = attend(q[a:b], k, v, seq_len - (b - a))
    return out


# -- the AttentionImpl ------------------------------------------------------------------------------------------------
class PagedAttention:
    """Attend through a paged KV cache (an :class:`~minillm.attention.backend.AttentionImpl`).

    Args:
        kv_caches: one ``(key_cache, value_cache)`` per layer (see :func:`allocate_kv_caches`).
        metadata: this step's :class:`AttentionMetadata`; replace ``self.metadata`` before each step.
        backend: ``"torch"`` (the PyTorch reference in this module) or ``"triton"`` (the chapter-3 kernels in
            ``kernels``: ``reshape_and_cache`` and ``unified_attention``).
        attend: with ``backend="torch"``, the per-request attention function (see :func:`paged_attention_torch`).
    """

    def __init__(self, kv_caches: list[KVCache], metadata: AttentionMetadata, backend: str = "torch",
                 attend: Callable[..., torch.Tensor] | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
        if attend is not None and backend != "torch":
            raise ValueError(f"attend replaces the torch backend's attention; backend {backend!r} has its own kernel")
        self.attend = attend
        self.kv_caches = kv_caches
        self.metadata = metadata
        self.backend = backend
        self._kernels = None
        self._checked_metadata: AttentionMetadata | None = None
        if backend == "triton":
            import kernels  # lazily: the torch backend must work without Triton

            self._kernels = kernels

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this step's ``k``, ``v`` at ``metadata.slot_mapping`` into layer ``layer_idx``, then attend.

        Shapes: ``q`` ``[num_tokens, num_heads, head_dim]``, ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]``;
        returns ``[num_tokens, num_heads, head_dim]``. All of a layer's writes happen before its attention, so a
        request may read blocks another request of the same batch writes in this step (a prefix-cache hit on
        blocks being filled right now).
        """
        if not 0 <= layer_idx < len(self.kv_caches):
            raise ValueError(f"layer_idx {layer_idx} out of range; there are {len(self.kv_caches)} layer caches")
        md = self.metadata
        if q.shape[0] != md.slot_mapping.shape[0]:
            raise ValueError(f"got {q.shape[0]} tokens but the metadata's slot_mapping has {md.slot_mapping.shape[0]}")
        key_cache, value_cache = self.kv_caches[layer_idx]
        if self._kernels is None:
            reshape_and_cache_torch(k, v, key_cache, value_cache, md.slot_mapping)
            return paged_attention_torch(q, key_cache, value_cache, md.query_start_loc, md.seq_lens, md.block_table,
                                         attend=self.attend)
        if md is not self._checked_metadata:
            # The index values are the same for every layer: check them once per step, not once per layer (on a
            # GPU each check copies them to the host, a sync that would stall the queue 2 x num_layers times).
            self._check_metadata_values(md, key_cache)
        self._kernels.reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping, check_values=False)
        return self._kernels.unified_attention(q, key_cache, value_cache, md.query_start_loc, md.seq_lens,
                                               md.block_table, md.max_query_len, md.max_seq_len, check_values=False)

    def _check_metadata_values(self, md: AttentionMetadata, key_cache: torch.Tensor) -> None:
        from kernels.reshape_and_cache import check_slot_values
        from kernels.unified_attention import check_batch_values

        num_blocks, block_size = key_cache.shape[:2]
        check_slot_values(md.slot_mapping, num_blocks, block_size)
        check_batch_values(md.query_start_loc, md.seq_lens, md.block_table, int(md.slot_mapping.shape[0]),
                           md.max_seq_len, block_size, num_blocks)
        self._checked_metadata = md


def forward_paged(model: LlamaForCausalLM, kv_caches: list[KVCache], token_ids: Sequence[Sequence[int]],
                  block_ids: Sequence[Sequence[int]], num_computed_tokens: Sequence[int],
                  num_new_tokens: Sequence[int], block_size: int, backend: str = "torch") -> torch.Tensor:
    """One forward pass of a varlen batch through a paged cache: a bare-bones model-runner step.

    Request ``i`` computes tokens ``token_ids[i][num_computed_tokens[i] : num_computed_tokens[i] +
    num_new_tokens[i]]`` at those positions, reading its earlier K/V from ``block_ids[i]`` and writing the new K/V
    there. Nothing else is updated (the caller advances its ``num_computed_tokens``).

    Returns:
        Hidden states ``[sum(num_new_tokens), hidden_size]``; the last row of request ``i`` is at
        ``query_start_loc[i+1] - 1``.
    """
    md = build_attention_metadata(block_ids, num_computed_tokens, num_new_tokens, block_size, model.device)
    ids: list[int] = []
    pos: list[int] = []
    for toks, c, n in zip(token_ids, num_computed_tokens, num_new_tokens, strict=False):
        if c + n > len(toks):
            raise ValueError(f"asked for tokens up to {c + n} but the request has only {len(toks)}")
        ids.extend(toks[c:c + n])
        pos.extend(range(c, c + n))
    return model(torch.tensor(ids, dtype=torch.long, device=model.device),
                 torch.tensor(pos, dtype=torch.long, device=model.device),
                 attn=PagedAttention(kv_caches, md, backend))
