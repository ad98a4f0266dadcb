"""Which KV cache blocks each request owns: the scheduler's only view of GPU memory.

The scheduler asks two questions per request and step:

- :meth:`KVCacheManager.get_computed_blocks` (a new request only): how much of the prompt is already in the cache?
  The answer is the longest run of *full* blocks whose hash chain matches, capped below the prompt length: the
  last prompt token is always recomputed, because its forward pass produces the logits of the first output token.
  (Once the request is admitted, the scheduler counts the lookup in the hit statistics:
  :meth:`KVCacheManager.record_prefix_cache_stats`.)
- :meth:`KVCacheManager.allocate_slots`: give this request room for ``num_new_tokens`` more tokens (plus, the first
  time, the cache hits found above), or say ``None`` if the pool is too small, so the scheduler can stop admitting
  requests or preempt one.

Blocks that become full are registered in the prefix cache immediately (their K/V is written in the same step,
before any later step can read them). :meth:`free` returns a request's blocks tail first.

vLLM counterpart: ``vllm/v1/core/kv_cache_manager.py`` (``KVCacheManager``) together with
``single_type_kv_cache_manager.py`` (``FullAttentionManager``); vLLM also handles sliding-window and other
attention types, several KV cache groups, speculative lookahead slots and KV transfer between instances.
"""
from __future__ import annotations

from collections import defaultdict

from minillm.core.block_pool import BlockPool
from minillm.core.kv_cache_utils import KVCacheBlock, PrefixCacheStats, hash_block_tokens
from minillm.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for ``a`` tokens with ``b`` tokens per block."""
    return -(-a // b)


class KVCacheManager:
    """Allocates blocks to requests from a :class:`BlockPool`, with prefix caching.

    Args:
        num_blocks: physical blocks in the cache, including the reserved null block 0.
        block_size: tokens per block.
        enable_caching: reuse full blocks across requests whose prefixes match (prefix caching).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
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
        salt = getattr(request, "cache_salt", None)
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i > 0 else None
            extra = (salt,) if (i == 0 and salt is not None) else None
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
        max_hit_blocks = (request.num_tokens - 1) // self._block_size
        blocks: list[KVCacheBlock] = []
        for h in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break  # the chain: a miss at block i means no later block can match
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
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Make the request's blocks cover ``num_computed_tokens + num_new_computed_tokens + num_new_tokens`` tokens.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens already have K/V in its blocks.
            num_new_tokens: tokens to compute this step.
            num_new_computed_tokens: tokens found in the prefix cache (first allocation only).
            new_computed_blocks: the blocks :meth:`get_computed_blocks` returned for them.

        Returns:
            The newly allocated blocks (possibly empty, when the last block still has room), or ``None`` if the pool
            cannot hold them; then nothing changed.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError(f"num_new_tokens ({num_new_tokens}) and num_new_computed_tokens "
                             f"({num_new_computed_tokens}) must be >= 0")
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
        num_tokens_need_slot = num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, cdiv(num_tokens_need_slot, self._block_size) - len(req_blocks)
                             - len(new_computed_blocks))
        # A hit on a free cached block takes it out of the free queue, so it costs a free block too.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
            if not req_blocks:
                del self.req_to_blocks[rid]  # leave no trace of a request that got nothing
            return None

        if new_computed_blocks or rid not in self.num_cached_block:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[rid] = len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)

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
        self.block_pool.free_blocks(reversed(blocks))

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
