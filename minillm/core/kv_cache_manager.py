"""Which KV cache blocks each request owns: the scheduler's only view of the device's memory.

The scheduler asks :meth:`KVCacheManager.get_computed_blocks` how much of a new prompt is cached (the longest run of
full blocks whose hash chain matches, never the last prompt token, whose forward pass gives the first output's
logits) and :meth:`KVCacheManager.allocate_slots` for room for a step's tokens (``None``: the pool is too small, so
it stops admitting or preempts). Blocks that become full are cached at once; :meth:`KVCacheManager.free` returns a
request's blocks tail first.

vLLM counterpart: ``vllm/v1/core/kv_cache_manager.py`` (``KVCacheManager``) with ``single_type_kv_cache_manager.py``
(``FullAttentionManager``); vLLM adds sliding-window and other attention types and several KV cache groups.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Container, Sequence
from typing import TypedDict

from minillm.core.block_pool import BlockPool
from minillm.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    PrefixCacheStats,
    hash_block_tokens,
    hash_request_tokens,
)
from minillm.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for ``a`` tokens with ``b`` tokens per block."""
    return -(-a // b)


# -- the manager's three small jobs, as functions: what exercises 2.2, 2.4 and 2.5 ask for, and what the manager
# takes as arguments (so chapter 8 can hand it a learner's versions) ------------------------------------------------
def allocate_new_blocks(pool: BlockPool, req_blocks: list[KVCacheBlock], num_computed_tokens: int,
                        num_new_tokens: int, block_size: int) -> list[KVCacheBlock] | None:
    """Grow ``req_blocks`` (in place) to cover ``num_computed_tokens + num_new_tokens`` tokens.

    Returns the new blocks (empty when the last block still has room), or ``None`` when the pool has too few free
    blocks; then nothing changed.
    """
    num_new_blocks = max(0, cdiv(num_computed_tokens + num_new_tokens, block_size) - len(req_blocks))
    if num_new_blocks > pool.get_num_free_blocks():
        return None
    new_blocks = pool.get_new_blocks(num_new_blocks)
    req_blocks.extend(new_blocks)
    return new_blocks


def num_cached_prefix_tokens(block_hashes: Sequence[BlockHash], num_tokens: int, block_size: int,
                             cached_hashes: Container[BlockHash]) -> int:
    """How many leading tokens of a request of ``num_tokens`` tokens the prefix cache holds: whole blocks, walked
    along the hash chain until the first miss, and at most ``num_tokens - 1`` (the last token is recomputed for its
    logits)."""
    max_hit_blocks = (num_tokens - 1) // block_size
    num_hit_blocks = 0
    for h in block_hashes[:max_hit_blocks]:
        if h not in cached_hashes:
            break  # the chain: a miss at block i means no later block can match
        num_hit_blocks += 1
    return num_hit_blocks * block_size


def free_request_blocks(pool: BlockPool, req_blocks: Sequence[KVCacheBlock]) -> None:
    """Drop the request's reference to each of its blocks, tail first (see :meth:`BlockPool.free_blocks`)."""
    pool.free_blocks(reversed(req_blocks))


class KVCacheFns(TypedDict, total=False):
    """:class:`KVCacheManager`'s replaceable functions, as a scheduler passes them on (chapter 8)."""

    allocate_fn: Callable[..., list[KVCacheBlock] | None]
    block_hashes_fn: Callable[[Sequence[int], int], list[BlockHash]]
    num_cached_tokens_fn: Callable[..., int]
    free_fn: Callable[[BlockPool, Sequence[KVCacheBlock]], None]


class KVCacheManager:
    """Allocates blocks to requests from a :class:`BlockPool`, with prefix caching.

    Args:
        num_blocks: physical blocks in the cache, including the reserved null block 0.
        block_size: tokens per block.
        enable_caching: reuse full blocks across requests whose prefixes match (prefix caching).
        allocate_fn, block_hashes_fn, num_cached_tokens_fn, free_fn: the functions it allocates, hashes, looks
            up and frees with (exercises 2.2-2.5's signatures; default: this module's own). The engine hands a
            learner's down here (chapter 8); the manager never asks the engine for them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, *,
                 allocate_fn: Callable[..., list[KVCacheBlock] | None] = allocate_new_blocks,
                 block_hashes_fn: Callable[[Sequence[int], int], list[BlockHash]] = hash_request_tokens,
                 num_cached_tokens_fn: Callable[..., int] = num_cached_prefix_tokens,
                 free_fn: Callable[[BlockPool, Sequence[KVCacheBlock]], None] = free_request_blocks) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.allocate_fn = allocate_fn
        self.block_hashes_fn = block_hashes_fn
        self.num_cached_tokens_fn = num_cached_tokens_fn
        self.free_fn = free_fn
        self._block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # request id -> its blocks in token order (block i holds tokens i*block_size ... (i+1)*block_size - 1).
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # request id -> how many of its leading blocks are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # -- properties ---------------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        """Physical blocks, null block included."""
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free ones, including evictable cached ones)."""
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in ``[0, 1]``."""
        return self.block_pool.get_usage()

    # -- hashing --------------------------------------------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> list[bytes]:
        """Extend ``request.block_hashes`` to cover every full block of ``request.all_token_ids``.

        The chain only grows: tokens never change once appended, so earlier hashes stay valid across steps and
        preemptions. A request's ``cache_salt`` (if it has one) keys its first block, isolating its cache entries.
        """
        bs = self._block_size
        tokens = request.all_token_ids
        hashes = request.block_hashes
        if len(hashes) == len(tokens) // bs:
            return hashes  # no new full block since the last call
        salt = getattr(request, "cache_salt", None)
        if salt is None:
            # The whole chain again (block_hashes_fn has exercise 2.3's signature); this happens once per block
            # of output, not per token. The prefix already hashed must not change.
            chain = self.block_hashes_fn(tokens, bs)
            if list(chain[:len(hashes)]) != hashes:
                raise RuntimeError(f"block_hashes changed the hashes of blocks already cached for request "
                                   f"{request.request_id!r}: a block's hash must depend only on its tokens and parent")
            hashes.extend(chain[len(hashes):])
            return hashes
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i > 0 else None
            extra = (salt,) if i == 0 else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], extra))
        return hashes

    # -- the scheduler's API --------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of ``request``, as blocks and a token count.

        Only full blocks count, and at most ``num_tokens - 1`` tokens: the last token must be recomputed to get its
        logits. The blocks are not reserved yet; pass them to :meth:`allocate_slots` in the same step.

        Returns:
            ``(blocks, num_computed_tokens)`` with ``num_computed_tokens == len(blocks) * block_size``.
        """
        if not self.enable_caching:
            return [], 0
        hashes = self._update_block_hashes(request)
        num_hit = self.num_cached_tokens_fn(hashes, request.num_tokens, self._block_size,
                                            self.block_pool.cached_block_hash_to_block)
        blocks: list[KVCacheBlock] = []
        for h in hashes[:num_hit // self._block_size]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                raise ValueError(f"num_cached_tokens_fn counted {num_hit} cached tokens, but block {len(blocks)} "
                                 f"(hash {h.hex()[:12]}...) is not in the prefix cache; count only cached blocks")
            blocks.append(block)
        # No statistics here: a request waiting for room is looked up again every step. The scheduler counts it
        # once, when it is admitted (record_prefix_cache_stats).
        return blocks, len(blocks) * self._block_size

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count ``request`` in :attr:`prefix_cache_stats`: call once, when it is admitted (its ``allocate_slots``
        with the blocks of :meth:`get_computed_blocks` succeeded). A no-op when caching is off (no lookup was made).

        vLLM v0.33.0: ``vllm/v1/core/kv_cache_manager.py:KVCacheManager.record_prefix_cache_stats``, called in
        ``vllm/v1/core/sched/scheduler.py:Scheduler.schedule`` after ``allocate_slots``.
        """
        if not self.enable_caching:
            return
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_external_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make the request's blocks cover ``num_computed_tokens + num_new_computed_tokens +
        num_external_computed_tokens + num_new_tokens`` tokens.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens already have K/V in its blocks.
            num_new_tokens: tokens to compute this step.
            num_new_computed_tokens: tokens found in the prefix cache (first allocation only).
            new_computed_blocks: the blocks :meth:`get_computed_blocks` returned for them.
            num_external_computed_tokens: tokens a KV connector will load into new blocks before this step's
                forward pass (chapter 9; first allocation only). They need slots like computed ones, and count as
                computed once loaded.

        Returns:
            The newly allocated blocks (possibly empty, when the last block still has room), or ``None`` if the pool
            cannot hold them; then nothing changed.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_external_computed_tokens < 0:
            raise ValueError(f"num_new_tokens ({num_new_tokens}), num_new_computed_tokens "
                             f"({num_new_computed_tokens}) and num_external_computed_tokens "
                             f"({num_external_computed_tokens}) must be >= 0")
        new_computed_blocks = list(new_computed_blocks or [])
        rid = request.request_id
        req_blocks = self.req_to_blocks[rid]
        if new_computed_blocks and req_blocks:
            raise ValueError(f"request {rid!r} already has blocks; prefix-cache hits can only be added at its first "
                             f"allocation")
        if new_computed_blocks and not self.enable_caching:
            raise ValueError("new_computed_blocks given but prefix caching is disabled")
        if len(new_computed_blocks) * self._block_size != num_new_computed_tokens:
            raise ValueError(f"num_new_computed_tokens ({num_new_computed_tokens}) must equal len(new_computed_blocks)"
                             f" x block_size ({len(new_computed_blocks)} x {self._block_size})")

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        # External tokens are new to this engine's cache: they take fresh slots, as tokens computed here would.
        num_new_tokens += num_external_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens
        if new_computed_blocks:
            # A hit on a free cached block takes it out of the free queue, so it costs a free block too: check
            # before touching them, so that a refusal changes nothing.
            num_new_blocks = max(0, cdiv(num_tokens_need_slot, self._block_size) - len(new_computed_blocks))
            num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
            if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
                del self.req_to_blocks[rid]  # leave no trace of a request that got nothing
                return None
        if new_computed_blocks or rid not in self.num_cached_block:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[rid] = len(new_computed_blocks)
        new_blocks = self.allocate_fn(self.block_pool, req_blocks, num_computed_tokens, num_new_tokens,
                                      self._block_size)
        if new_blocks is None:
            if new_computed_blocks:  # the check above said they fit: the allocation function is wrong
                raise RuntimeError(f"allocate_slots refused {num_new_tokens} tokens that fit the free blocks")
            if not req_blocks:
                del self.req_to_blocks[rid]
                self.num_cached_block.pop(rid, None)
            return None

        if self.enable_caching:
            self.cache_blocks(request, min(num_tokens_need_slot, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that the first ``num_tokens`` tokens fill completely."""
        rid = request.request_id
        hashes = self._update_block_hashes(request)
        num_full = num_tokens // self._block_size
        num_cached = self.num_cached_block.get(rid, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(self.req_to_blocks[rid], hashes, num_cached, num_full)
            self.num_cached_block[rid] = num_full

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks (finished or preempted), tail first. A no-op if it has none."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.free_fn(self.block_pool, blocks)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks in token order (empty if it has none)."""
        return list(self.req_to_blocks.get(request_id, []))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in token order: its row of the ``block_table``."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after new weights are loaded). ``False`` while any request holds blocks."""
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.prefix_cache_stats.reset()
        return ok

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The hit counters since the last call, and reset them (what a periodic logger wants)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats
