"""Prefill of one prompt in chunks over a contiguous KV cache, and two wrong shortcuts to measure against it.

Chunk ``c`` of a prompt starts at position ``ctx_c = n_0 + ... + n_{c-1}``; at every layer it appends its K/V to the
cache and attends over all ``ctx_c + n_c`` cached tokens (:func:`prefill_chunk`). All chunks in order give one full
prefill, up to fp32 rounding (:func:`chunked_prefill`). Wrong: :func:`independent_chunks_prefill` (each chunk
alone, an empty cache) and :func:`last_chunk_attention_prefill` (earlier chunks skip attention). Right: earlier
chunks may stop at the last layer's K/V projection (``kv_only_last_layer``): later tokens read only their K/V.

vLLM counterpart: the scheduler cuts a prompt into chunks (``vllm/v1/core/sched/scheduler.py``, the token budget
and ``num_computed_tokens``) and the model runner runs each against the paged KV cache
(``vllm/v1/worker/gpu_model_runner.py``), computing logits only at ``logits_indices``.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from minillm.attention.contiguous import ContiguousKVCache
from minillm.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, check_token_ids

# ---------------------------------------------------------------------------------------------------------------------
# How a prompt is cut


def even_chunk_sizes(num_tokens: int, num_chunks: int) -> list[int]:
    """Sizes of ``num_chunks`` chunks as equal as possible (the first ones get the remainder), summing to
    ``num_tokens``. ``even_chunk_sizes(10, 4) == [3, 3, 2, 2]``."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if not 1 <= num_chunks <= num_tokens:
        raise ValueError(f"num_chunks must be in [1, num_tokens={num_tokens}], got {num_chunks}")
    base, rem = divmod(num_tokens, num_chunks)
    return [base + 1] * rem + [base] * (num_chunks - rem)


def fixed_chunk_sizes(num_tokens: int, chunk_size: int) -> list[int]:
    """Chunks of ``chunk_size`` tokens and a shorter last one, as a scheduler with a fixed token budget cuts them.
    ``fixed_chunk_sizes(10, 4) == [4, 4, 2]``."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    full, rem = divmod(num_tokens, chunk_size)
    return [chunk_size] * full + ([rem] if rem else [])


def chunk_bounds(chunk_sizes: Sequence[int], num_tokens: int | None = None) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of each chunk; ``start`` is the chunk's ``ctx_len`` (tokens before it).

    Raises ``ValueError`` if a size is < 1 or, when ``num_tokens`` is given, the sizes do not sum to it.
    """
    sizes = [int(s) for s in chunk_sizes]
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"chunk sizes must be a non-empty list of positive integers, got {list(chunk_sizes)}")
    if num_tokens is not None and sum(sizes) != num_tokens:
        raise ValueError(f"chunk sizes {sizes} sum to {sum(sizes)}, but the prompt has {num_tokens} tokens")
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start, start + s))
        start += s
    return bounds


# ---------------------------------------------------------------------------------------------------------------------
# Attention implementations used by the experiments


class RecordingKVCache(ContiguousKVCache):
    """A :class:`ContiguousKVCache` that also counts what attention read, for the cost-of-chunking measurement.

    Attributes:
        kv_elements_read: K and V elements the attention of every layer read so far (prefix and chunk).
        visible_pairs: (query, key) pairs that passed the causal mask, summed over layers (per head).
        computed_pairs: (query, key) scores the dense reference computed, masked ones included, summed over layers.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv_elements_read = 0
        self.visible_pairs = 0
        self.computed_pairs = 0

    @property
    def kv_bytes_read(self) -> int:
        """``kv_elements_read`` times the cache's element size."""
        return self.kv_elements_read * self._k[0].element_size()

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = super().forward(layer_idx, q, k, v)
        n, total = q.shape[0], self._len[layer_idx]
        ctx = total - n
        self.kv_elements_read += self.keys(layer_idx).numel() + self.values(layer_idx).numel()
        self.visible_pairs += n * ctx + n * (n + 1) // 2
        self.computed_pairs += n * total
        return out


class ProjectionOnlyAttention:
    """An :class:`~minillm.attention.backend.AttentionImpl` that stores a chunk's K/V in ``cache`` and attends to
    nothing: it returns zeros, so the attention sub-layer adds nothing to the residual stream.

    This is the learner's hypothesis "earlier chunks need no attention" made concrete (chapter 1, Q3).
    """

    def __init__(self, cache: ContiguousKVCache) -> None:
        self.cache = cache

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.append(layer_idx, k, v)
        return torch.zeros_like(q)


# ---------------------------------------------------------------------------------------------------------------------
# One chunk through the model


def _kv_projection(self_attn: LlamaAttention, positions: torch.Tensor, x: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """K (rotated) and V of ``x`` ``[n, hidden]`` without computing Q: ``[n, num_kv_heads, head_dim]`` each."""
    n = x.shape[0]
    k = self_attn.k_proj(x).view(n, self_attn.num_kv_heads, self_attn.head_dim)
    v = self_attn.v_proj(x).view(n, self_attn.num_kv_heads, self_attn.head_dim)
    no_queries = k.new_empty(n, 0, self_attn.head_dim)  # RoPE rotates q and k together; here there is no q
    _, k = self_attn.rotary_emb(positions, no_queries, k)
    return k, v



@torch.inference_mode()
def prefill_chunk(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                  cache: ContiguousKVCache | ProjectionOnlyAttention, kv_only_last_layer: bool = False,
                  hidden_states_out: list[torch.Tensor] | None = None,
                  prefix_missing: bool = False) -> torch.Tensor | None:
    """Run one chunk through every layer against ``cache``, which holds the K/V of all earlier tokens.

    At each layer the chunk's K/V are appended to the cache and its queries attend over the cached prefix and,
    causally, themselves.

    Args:
        input_ids: ``[n]`` token ids of the chunk.
        positions: ``[n]`` absolute positions, ``ctx_len ... ctx_len+n-1`` where ``ctx_len = cache.num_tokens``.
        cache: where K/V history lives (any object with ``append`` and ``forward`` of a contiguous cache).
        kv_only_last_layer: stop at the last layer once its K/V are appended: no attention output, ``o_proj``, MLP,
            final norm. Right for every chunk but the one whose logits are wanted.
        hidden_states_out: if a list, receives the residual stream entering each layer (``[n, hidden]`` each).
        prefix_missing: WRONG on purpose, for :func:`independent_chunks_prefill`: the cache lacks (some of) the
            tokens before this chunk, so ``positions`` may start after ``cache.num_tokens``; they must still be
            consecutive.

    Returns:
        Final normed hidden states ``[n, hidden]``, or ``None`` with ``kv_only_last_layer``.

    Raises:
        ValueError: ``input_ids`` or ``positions`` not ``[n]``, a token id outside ``[0, vocab_size)``, or positions
            that are not ``ctx_len, ctx_len+1, ...``: a chunk at other positions would attend over a cache that does
            not hold the tokens before it, and silently compute something else.
    """
    if input_ids.dim() != 1 or positions.shape != input_ids.shape or input_ids.numel() == 0:
        raise ValueError(f"input_ids and positions must both be [n] with n >= 1, got {tuple(input_ids.shape)} and "
                         f"{tuple(positions.shape)}")
    check_token_ids(input_ids, model.config.vocab_size)  # model.forward's check: this layer-by-layer path bypasses it
    ctx_len = (cache.cache if isinstance(cache, ProjectionOnlyAttention) else cache).num_tokens
    start = int(positions[0])
    expected = torch.arange(start, start + positions.numel(), device=positions.device)
    if positions.is_floating_point() or not torch.equal(positions.long(), expected) \
            or (start < ctx_len if prefix_missing else start != ctx_len):
        shown = positions.tolist() if positions.numel() <= 8 else f"{positions[:4].tolist()} ... {int(positions[-1])}"
        rule = ">=" if prefix_missing else "equal to"
        raise ValueError(f"positions must be consecutive integers, the first one {rule} cache.num_tokens = {ctx_len} "
                         f"(the tokens already cached), got {shown}")
    inner = model.model
    num_layers = len(inner.layers)
    h = inner.embed_tokens(input_ids)
    for i, layer in enumerate(cast(Iterable[LlamaDecoderLayer], inner.layers)):
        if hidden_states_out is not None:
            hidden_states_out.append(h)
        if kv_only_last_layer and i == num_layers - 1:
            # The only thing a later token will ever read from this chunk at the last layer is its K/V.
            k, v = _kv_projection(layer.self_attn, positions, layer.input_layernorm(h))
            target = cache.cache if isinstance(cache, ProjectionOnlyAttention) else cache
            target.append(i, k, v)
            return None
        h = layer(positions, h, cache)
    return inner.norm(h)


# ---------------------------------------------------------------------------------------------------------------------
# Whole prompts, with everything captured


@dataclass
class PrefillRecord:
    """Everything one prefill of a prompt left behind, for comparing ways of running it.

    Attributes:
        chunk_sizes: how the prompt was cut.
        keys, values: per layer ``[num_tokens, num_kv_heads, head_dim]``: the K/V each token stored at that layer.
        residual: per layer ``[num_tokens, hidden]``: the residual stream entering that layer.
        hidden: final normed hidden states ``[num_tokens, hidden]``; ``None`` if earlier chunks skipped them.
        last_hidden: ``[hidden]``, the final hidden state of the last token (the one whose logits are sampled).
        kv_elements_read, kv_bytes_read, visible_pairs, computed_pairs: counters of :class:`RecordingKVCache`,
            summed over chunks.
        cache: the KV cache the prompt left behind (``None`` for independent chunks, which have one each); decode
            can continue from it with :func:`prefill_chunk`.
    """

    chunk_sizes: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    residual: list[torch.Tensor]
    hidden: torch.Tensor | None
    last_hidden: torch.Tensor
    kv_elements_read: int = 0
    kv_bytes_read: int = 0
    visible_pairs: int = 0
    computed_pairs: int = 0
    cache: ContiguousKVCache | None = None
    bounds: list[tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.bounds = chunk_bounds(self.chunk_sizes)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def greedy_continuation(self, model: LlamaForCausalLM, max_new_tokens: int) -> list[int]:
        """Decode ``max_new_tokens`` greedy tokens from this prefill's cache and last logits (the cache grows)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if self.cache is None:
            raise ValueError("this prefill kept no single KV cache (independent chunks); nothing to decode from")
        token = int(self.last_logits(model).argmax())
        out = [token]
        for _ in range(max_new_tokens - 1):
            pos = torch.tensor([self.cache.num_tokens], device=model.device)
            h = prefill_chunk(model, torch.tensor([token], device=model.device), pos, self.cache)
            assert h is not None  # None only with kv_only_last_layer
            with torch.inference_mode():
                token = int(model.compute_logits(h[-1:])[0].argmax())
            out.append(token)
        return out

    def last_logits(self, model: LlamaForCausalLM) -> torch.Tensor:
        """Logits ``[vocab]`` (fp32) at the last token: what the next token is sampled from."""
        with torch.inference_mode():
            return model.compute_logits(self.last_hidden[None])[0]


def _new_cache(model: LlamaForCausalLM, capacity: int) -> RecordingKVCache:
    return RecordingKVCache.for_model(model, capacity=max(1, capacity))


def _check_ids(model: LlamaForCausalLM, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``input_ids`` as a ``[num_tokens]`` int64 tensor on the model's device, checked before any chunk runs."""
    given_tensor = isinstance(input_ids, torch.Tensor)
    if isinstance(input_ids, torch.Tensor):
        check_token_ids(input_ids, model.config.vocab_size)  # before the cast to int64, which would truncate floats
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=model.device)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    if not given_tensor:
        check_token_ids(ids, model.config.vocab_size)
    return ids


def _run(model: LlamaForCausalLM, input_ids: torch.Tensor | Sequence[int], chunk_sizes: Sequence[int] | None,
         mode: str, kv_only_last_layer: bool = False) -> PrefillRecord:
    ids = _check_ids(model, input_ids)
    sizes = [ids.numel()] if chunk_sizes is None else [int(s) for s in chunk_sizes]
    bounds = chunk_bounds(sizes, ids.numel())
    num_layers = model.config.num_hidden_layers
    shared = _new_cache(model, ids.numel())
    caches: list[RecordingKVCache] = []
    hiddens: list[torch.Tensor | None] = []
    residual_chunks: list[list[torch.Tensor]] = []
    for c, (start, end) in enumerate(bounds):
        last = c == len(bounds) - 1
        attn: ContiguousKVCache | ProjectionOnlyAttention
        if mode == "independent":
            cache = _new_cache(model, end - start)
            caches.append(cache)
            attn = cache
        else:
            cache = shared
            attn = ProjectionOnlyAttention(shared) if (mode == "last_chunk_attention" and not last) else shared
        res: list[torch.Tensor] = []
        positions = torch.arange(start, end, device=ids.device)
        hiddens.append(prefill_chunk(model, ids[start:end], positions, attn,
                                     kv_only_last_layer=kv_only_last_layer and not last, hidden_states_out=res,
                                     prefix_missing=mode == "independent"))
        residual_chunks.append(res)
    if mode != "independent":
        caches = [shared]
    keys = [torch.cat([cc.keys(i) for cc in caches]) for i in range(num_layers)]
    values = [torch.cat([cc.values(i) for cc in caches]) for i in range(num_layers)]
    residual = [torch.cat([r[i] for r in residual_chunks]) for i in range(num_layers)]
    hidden = None if any(h is None for h in hiddens) else torch.cat(hiddens)  # type: ignore[arg-type]
    return PrefillRecord(
        chunk_sizes=sizes, keys=keys, values=values, residual=residual, hidden=hidden,
        last_hidden=hiddens[-1][-1],  # type: ignore[index]
        kv_elements_read=sum(cc.kv_elements_read for cc in caches),
        kv_bytes_read=sum(cc.kv_bytes_read for cc in caches),
        visible_pairs=sum(cc.visible_pairs for cc in caches),
        computed_pairs=sum(cc.computed_pairs for cc in caches),
        cache=None if mode == "independent" else shared,
    )


def chunked_prefill(model: LlamaForCausalLM, input_ids: torch.Tensor | Sequence[int],
                    chunk_sizes: Sequence[int] | None = None, kv_only_last_layer: bool = False) -> PrefillRecord:
    """Prefill ``input_ids`` (``[num_tokens]``) chunk by chunk over one KV cache: the correct chunked prefill.

    ``chunk_sizes=None`` is one chunk, i.e. the full prefill. With ``kv_only_last_layer`` every chunk but the last
    stops after appending its last-layer K/V (then ``record.hidden`` is ``None``; ``last_hidden`` is still exact).
    """
    return _run(model, input_ids, chunk_sizes, "chunked", kv_only_last_layer)


def independent_chunks_prefill(model: LlamaForCausalLM, input_ids: torch.Tensor | Sequence[int],
                               chunk_sizes: Sequence[int]) -> PrefillRecord:
    """WRONG on purpose: run each chunk alone, with its correct positions but an empty KV cache.

    This is "every chunk's K/V can be computed independently". The K/V it records for chunk ``c`` are what chunk
    ``c`` would store if no earlier tokens existed; ``last_hidden`` is what the last chunk sees without the rest.
    """
    return _run(model, input_ids, chunk_sizes, "independent")


def last_chunk_attention_prefill(model: LlamaForCausalLM, input_ids: torch.Tensor | Sequence[int],
                                 chunk_sizes: Sequence[int]) -> PrefillRecord:
    """WRONG on purpose: earlier chunks store K/V at every layer but skip attention; only the last chunk attends.

    This is "only the last chunk needs attention": an earlier chunk's residual stream gets no attention output
    (:class:`ProjectionOnlyAttention`), so from layer 1 on its K/V are computed from the wrong hidden states.
    """
    return _run(model, input_ids, chunk_sizes, "last_chunk_attention")


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact||_F / ||exact||_F`` computed in fp64 (0.0 when they are identical)."""
    if approx.shape != exact.shape:
        raise ValueError(f"shapes differ: {tuple(approx.shape)} vs {tuple(exact.shape)}")
    num = torch.linalg.vector_norm((approx.double() - exact.double()).flatten())
    den = torch.linalg.vector_norm(exact.double().flatten())
    return float(num / den) if float(den) > 0 else float(num)


def per_chunk_layer_errors(approx: PrefillRecord, exact: PrefillRecord, what: str = "keys") -> torch.Tensor:
    """``[num_chunks, num_layers]`` relative errors of ``approx`` against ``exact`` for ``what`` in ``"keys"``,
    ``"values"``, ``"residual"``, per chunk (token ranges of ``exact.bounds``) and layer."""
    if what not in ("keys", "values", "residual"):
        raise ValueError(f"what must be 'keys', 'values' or 'residual', got {what!r}")
    a, e = getattr(approx, what), getattr(exact, what)
    out = torch.zeros(len(exact.bounds), len(e), dtype=torch.float64)
    for c, (s, t) in enumerate(exact.bounds):
        for layer in range(len(e)):
            out[c, layer] = relative_error(a[layer][s:t], e[layer][s:t])
    return out
