"""A fast PyTorch attention backend over the paged KV cache, for the engine on a CPU.

Same semantics as :func:`minillm.attention.paged.paged_attention_torch`, with the work grouped once per step by
:class:`SDPAPlan`: **decodes** (one query token, or a few with drafts) are sorted by length, cut into groups of
similar lengths, gathered through their block-table rows in one copy and attended by one padded
``scaled_dot_product_attention`` call per group (the query heads of a K/V head ride on SDPA's query axis); each
**prefill** chunk is one SDPA call, with ``is_causal`` when it has no cached context, else a shifted causal mask.

vLLM counterpart: ``vllm/v1/attention/backends/cpu_attn.py`` (``CPUAttentionBackend``,
``CPUAttentionBackendImpl.forward``), whose one C++ kernel (``cpu_attention_with_kv_cache``) attends the whole
varlen batch in place; older releases split prefills (SDPA) from decodes as this file does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minillm.attention.metadata import AttentionMetadata
from minillm.attention.paged import KVCache


@dataclass
class _Prefill:
    start: int                       # first row of this request in the flat batch
    end: int                         # one past its last row
    slots: torch.Tensor | None       # [seq_len] cache slots of its whole history; None: no context, use k/v as is
    mask: torch.Tensor | None        # [query_len, seq_len] bool, True = may attend; None: plain causal


@dataclass
class _DecodeGroup:
    rows: torch.Tensor               # [n, max_q] flat rows of these requests' query tokens (short ones padded
                                     # with their last row)
    block_table: torch.Tensor        # [n, num_blocks] int64, cut to the blocks the longest one needs
    block_ids: torch.Tensor          # [n * num_blocks] the same, flattened (for index_select)
    mask: torch.Tensor               # [n, 1, max_q, num_blocks * block_size] additive: 0 (attend) or -inf
    valid: torch.Tensor | None       # [n, max_q] bool, False on padding rows; None when max_q == 1

    @property
    def max_q(self) -> int:
        return int(self.rows.shape[1])


# Requests with at most this many query tokens are batched like decodes (a decode and its drafts).
MAX_BATCHED_QUERY_LEN = 8


# A decode group grows while its longest history is at most this much longer than its shortest.
DECODE_GROUP_SPREAD = 1.3


class SDPAPlan:
    """What :class:`TorchSDPAAttention` needs for one step, computed once from the :class:`AttentionMetadata`.

    Attributes:
        valid_slots / valid_rows: where each new token's K/V is written (rows with slot ``-1`` dropped).
        decode_groups: the decode requests (``query_len == 1``), sorted by ``seq_len`` and grouped.
        prefills: one entry per request with ``query_len > 1``.
    """

    def __init__(self, metadata: AttentionMetadata, block_size: int) -> None:
        md = metadata
        device = md.slot_mapping.device
        qsl = md.query_start_loc.tolist()
        seq_lens = md.seq_lens.tolist()
        slots = md.slot_mapping.to(torch.long)
        if bool((slots < 0).any()):
            keep = torch.nonzero(slots >= 0).flatten()
            self.valid_rows: torch.Tensor | None = keep
            self.valid_slots = slots[keep]
        else:
            self.valid_rows = None
            self.valid_slots = slots

        decodes = sorted((i for i in range(len(seq_lens)) if qsl[i + 1] - qsl[i] <= MAX_BATCHED_QUERY_LEN),
                         key=lambda i: seq_lens[i])
        groups: list[list[int]] = []
        for i in decodes:
            if groups and seq_lens[i] <= DECODE_GROUP_SPREAD * seq_lens[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        self.decode_groups = [self._decode_group(md, g, qsl, seq_lens, block_size, device) for g in groups]

        self.prefills: list[_Prefill] = []
        for i, seq_len in enumerate(seq_lens):
            a, b = qsl[i], qsl[i + 1]
            q_len = b - a
            if q_len <= MAX_BATCHED_QUERY_LEN:
                continue  # batched with the decodes
            ctx = seq_len - q_len
            if ctx < 0:
                raise ValueError(f"request {i}: {q_len} new tokens but seq_len {seq_len}")
            if ctx == 0:
                self.prefills.append(_Prefill(a, b, None, None))
                continue
            pos = torch.arange(seq_len, device=device)
            row = md.block_table[i].to(torch.long)
            hist_slots = row[pos // block_size] * block_size + pos % block_size
            q_pos = torch.arange(ctx, seq_len, device=device)
            self.prefills.append(_Prefill(a, b, hist_slots, pos[None, :] <= q_pos[:, None]))

    @staticmethod
    def _decode_group(md: AttentionMetadata, reqs: list[int], qsl: list[int], seq_lens: list[int],
                      block_size: int, device: torch.device) -> _DecodeGroup:
        num_blocks = -(-max(seq_lens[i] for i in reqs) // block_size)
        idx = torch.tensor(reqs, dtype=torch.long, device=device)
        q_lens = torch.tensor([qsl[i + 1] - qsl[i] for i in reqs], device=device)
        max_q = int(q_lens.max())
        t = torch.arange(max_q, device=device)
        t_valid = torch.minimum(t[None, :], q_lens[:, None] - 1)                       # [n, max_q]
        rows = torch.tensor([qsl[i] for i in reqs], dtype=torch.long, device=device)[:, None] + t_valid
        # Query token t of request i sits at position seq_len - q_len + t and sees the keys up to it.
        last_key = torch.tensor([seq_lens[i] for i in reqs], device=device)[:, None] - q_lens[:, None] + t_valid
        positions = torch.arange(num_blocks * block_size, device=device)
        mask = torch.zeros(len(reqs), 1, max_q, num_blocks * block_size, device=device)
        mask.masked_fill_((positions[None, None, :] > last_key[:, :, None])[:, None], float("-inf"))
        table = md.block_table[idx, :num_blocks].to(torch.long)
        valid = (t[None, :] < q_lens[:, None]) if max_q > 1 else None
        return _DecodeGroup(rows, table, table.reshape(-1), mask, valid)


class TorchSDPAAttention:
    """An :class:`~minillm.attention.backend.AttentionImpl` over a paged KV cache, vectorized for a CPU.

    Same contract as :class:`~minillm.attention.paged.PagedAttention` with ``backend="torch"`` (write this step's
    K/V at ``slot_mapping``, then attend each token over its request's history), same results up to fp32 rounding
    (the tests compare them).

    Args:
        kv_caches: one ``(key_cache, value_cache)`` per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        metadata: this step's :class:`AttentionMetadata`.
    """

    def __init__(self, kv_caches: list[KVCache], metadata: AttentionMetadata) -> None:
        self.kv_caches = kv_caches
        self.metadata = metadata
        self.block_size = kv_caches[0][0].shape[1]
        self.plan = SDPAPlan(metadata, self.block_size)
        # Per decode group with several query tokens: its mask repeated for the query heads of a K/V head, built at
        # the first layer and reused by the others (the plan does not know num_heads; the first q does).
        self._group_masks: dict[int, torch.Tensor] = {}

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[num_tokens, num_heads, head_dim]``, ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` ->
        ``[num_tokens, num_heads, head_dim]``."""
        key_cache, value_cache = self.kv_caches[layer_idx]
        plan = self.plan
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        if plan.valid_rows is None:
            flat_k.index_copy_(0, plan.valid_slots, k.to(key_cache.dtype))
            flat_v.index_copy_(0, plan.valid_slots, v.to(value_cache.dtype))
        else:
            flat_k.index_copy_(0, plan.valid_slots, k[plan.valid_rows].to(key_cache.dtype))
            flat_v.index_copy_(0, plan.valid_slots, v[plan.valid_rows].to(value_cache.dtype))

        out = torch.empty_like(q)
        num_heads = q.shape[1]
        group = num_heads // num_kv_heads
        for gi, g in enumerate(plan.decode_groups):
            n, nb = g.block_table.shape
            # index_select of whole blocks, [n * nb, block_size, Hkv, D] -> [n, Hkv, nb * block_size, D]. (Much
            # faster on a CPU than the equivalent advanced indexing key_cache[block_table].)
            gathered = (n, nb * block_size, num_kv_heads, head_dim)
            kd = key_cache.index_select(0, g.block_ids).view(gathered).transpose(1, 2)
            vd = value_cache.index_select(0, g.block_ids).view(gathered).transpose(1, 2)
            if g.valid is None:  # one query token each: the query heads of one K/V head side by side
                qd = q[g.rows[:, 0]].view(n, num_kv_heads, group, head_dim)
                od = F.scaled_dot_product_attention(qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=g.mask.to(q.dtype))
                out[g.rows[:, 0]] = od.reshape(n, num_heads, head_dim)
                continue
            # Several query tokens each: [n, max_q, H, D] -> [n, Hkv, max_q * group, D], rows (token, head).
            mq = g.max_q
            qd = q[g.rows].view(n, mq, num_kv_heads, group, head_dim).transpose(1, 2).reshape(
                n, num_kv_heads, mq * group, head_dim)
            mask = self._group_masks.get(gi)
            if mask is None:  # [n, 1, max_q * group, L]: row (token t, head h) gets token t's mask
                mask = self._group_masks[gi] = g.mask.to(q.dtype).repeat_interleave(group, dim=2)
            od = F.scaled_dot_product_attention(qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=mask)
            od = od.view(n, num_kv_heads, mq, group, head_dim).transpose(1, 2).reshape(n, mq, num_heads, head_dim)
            out[g.rows[g.valid]] = od[g.valid]
        for p in plan.prefills:
            qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            if p.slots is None:
                kp, vp = k[p.start:p.end], v[p.start:p.end]
                op = F.scaled_dot_product_attention(qp, kp.transpose(0, 1).unsqueeze(0),
                                                    vp.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True)
            else:
                kp = flat_k.index_select(0, p.slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
                vp = flat_v.index_select(0, p.slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, enable_gqa=True)
            out[p.start:p.end] = op[0].transpose(0, 1)
        return out
