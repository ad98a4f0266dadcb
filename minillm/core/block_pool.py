"""The pool of KV cache blocks: hand blocks out, take them back, and remember full blocks by hash.

A block is free (in the free queue), allocated (``get_new_blocks``, ``ref_cnt = 1``), cached once full
(``cache_full_blocks``: its hash enters ``cached_block_hash_to_block``), shared (``touch``: another request with the
same prefix takes it) and freed (``free_blocks``). A freed block with a hash goes to the *back* of the free queue and
keeps its hash, so it can still be hit until it is reused (LRU eviction, done lazily when it is popped); one without
a hash goes to the *front* and is reused first. Block 0 is the *null block*: never handed out, the padding of block
tables.

vLLM counterpart: ``vllm/v1/core/block_pool.py`` (``BlockPool``, ``BlockHashToBlockMap``).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from minillm.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    """All ``num_blocks`` blocks of the cache, the free queue, and the prefix-cache index.

    Args:
        num_blocks: physical blocks, including the null block (so ``num_blocks - 1`` usable ones); at least 2.
        enable_caching: keep full blocks findable by hash (prefix caching).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the reserved null block), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> {block_id: block}. Several blocks may share a hash: two requests that computed the same prefix
        # at the same time each own a copy; either one serves a later hit.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    # -- prefix cache -------------------------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block cached under ``block_hash`` (free or in use), or ``None``."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under ``block_hashes[i]``.

        Args:
            blocks: a request's blocks, in token order.
            block_hashes: that request's hash chain (at least ``num_full_blocks`` long).
            num_cached_blocks: how many of its leading blocks are cached already.
            num_full_blocks: how many of its leading blocks are now full.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if len(block_hashes) < num_full_blocks:
            raise ValueError(f"need {num_full_blocks} block hashes, got {len(block_hashes)}")
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            block.block_hash = block_hashes[i]
            self.cached_block_hash_to_block.setdefault(block_hashes[i], {})[block.block_id] = block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop ``block`` from the prefix cache if it is there (it is about to hold new content)."""
        h = block.block_hash
        if h is None:
            return False
        entries = self.cached_block_hash_to_block.get(h)
        if entries is not None:
            entries.pop(block.block_id, None)
            if not entries:
                del self.cached_block_hash_to_block[h]
        block.reset_hash()
        return True

    def evict_cached_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take ``blocks`` out of the prefix cache (their content is not trusted, e.g. a step that was to write it
        failed); they stay allocated to whoever holds them."""
        if self.enable_caching:
            for block in blocks:
                self._maybe_evict_cached_block(block)

    # -- allocation -----------------------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue (evicting any cached content), ref 1 each."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks, only {self.get_num_free_blocks()} are free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            block.incr_ref()
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each of ``blocks`` (prefix-cache hits); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.incr_ref()

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 return to the free queue, *in this order*.

        ``ordered_blocks`` is in eviction priority, first evicted first. The caller passes a request's blocks tail
        first, so its last blocks are evicted before its first ones: a prefix is only useful if all blocks before
        it survive. Blocks without a hash (or every block when caching is off) go to the front of the queue
        (``prepend_n``, reused first: they can never be a prefix-cache hit), blocks with a hash to the back
        (``append_n``, LRU among cached blocks). So a cached prefix is not evicted while a useless block is free.

        vLLM v0.33.0: ``vllm/v1/core/block_pool.py:BlockPool.free_blocks`` ("LIFO reuse of non-cached blocks",
        "FIFO reuse of cached blocks for LRU eviction behavior").
        """
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        for block in ordered_blocks:
            block.decr_ref()
            if block.ref_cnt == 0 and not block.is_null:
                if block.block_hash is None or not self.enable_caching:
                    evict_first.append(block)
                else:
                    evict_last.append(block)
        self.free_block_queue.prepend_n(evict_first)
        self.free_block_queue.append_n(evict_last)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no request holds a block (else returns ``False``)."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True

    # -- counters -------------------------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (null block excluded) held by requests, in ``[0, 1]``."""
        usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash right now (in use or free)."""
        return sum(len(v) for v in self.cached_block_hash_to_block.values())
