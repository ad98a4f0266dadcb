"""The pieces a paged KV cache is made of: a block, the queue of free blocks, and the hash that names a full block.

A block holds the K/V of ``block_size`` consecutive tokens in every layer; the engine only hands block ids out and
takes them back. Per block: ``ref_cnt`` (requests using it), ``block_hash`` (set once full and cached) and, when
free, its place in the :class:`FreeKVCacheBlockQueue`. Hashes chain, ``hash(block i) = H(hash(block i-1), its token
ids, extra keys)``, so equal hashes mean equal prefixes.

At start-up, :func:`get_kv_cache_configs` turns the workers' reports into the number of blocks every worker allocates.

vLLM counterpart: ``vllm/v1/core/kv_cache_utils.py`` (``KVCacheBlock``, ``FreeKVCacheBlockQueue``,
``hash_block_tokens``); ``PrefixCacheStats`` lives in ``vllm/v1/metrics/stats.py``, ``get_kv_cache_configs`` in
``vllm/v1/core/kv_cache_planning.py``.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from minillm.kv_cache_interface import FullAttentionSpec, KVCacheConfig, bytes_per_block

#: A block's hash: 32 bytes of SHA-256. Bytes (not Python's ``hash``) so it is the same in every process and run.
BlockHash = bytes

#: The parent hash of a request's first block (a fixed seed, so hashes are reproducible).
NONE_HASH: BlockHash = hashlib.sha256(b"minillm prefix cache root").digest()


def hash_block_tokens(parent_block_hash: BlockHash | None, block_token_ids: Sequence[int],
                      extra_keys: tuple[object, ...] | None = None) -> BlockHash:
    """Hash of one full block, chained on its parent's hash.

    Args:
        parent_block_hash: hash of the previous block of the same sequence; ``None`` for the first block.
        block_token_ids: the ``block_size`` token ids stored in this block.
        extra_keys: anything else that changes the K/V of these tokens (a LoRA id, a cache salt, ...); ``None``
            for plain text.

    Returns:
        32 bytes. Two blocks get the same hash iff their whole prefixes (all earlier tokens), their tokens and their
        extra keys are equal (up to SHA-256 collisions).
    """
    h = hashlib.sha256()
    h.update(NONE_HASH if parent_block_hash is None else parent_block_hash)
    # Fixed-width encoding of the token ids: no separator ambiguity between [1, 23] and [12, 3].
    h.update(struct.pack(f"<{len(block_token_ids)}q", *block_token_ids))
    if extra_keys:
        h.update(repr(tuple(extra_keys)).encode())
    return h.digest()


def hash_request_tokens(token_ids: Sequence[int], block_size: int, extra_keys: tuple[object, ...] | None = None,
                        parent_block_hash: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids`` (a trailing partial block gets none).

    ``extra_keys`` apply to the first block only (as a per-request cache salt does), which through the chain
    changes every later hash too.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    parent = parent_block_hash
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                   extra_keys if i == 0 and parent_block_hash is None else None)
        hashes.append(parent)
    return hashes


class KVCacheBlock:
    """Book-keeping for one physical block of the paged KV cache (the K/V tensors themselves live elsewhere).

    Attributes:
        block_id: index into the first dimension of every layer's ``[num_blocks, block_size, num_kv_heads,
            head_dim]`` key and value cache.
        ref_cnt: number of requests holding the block.
        block_hash: the hash it is cached under, or ``None``.
        is_null: the null block (id 0) stands for "no block"; it is never handed out.
    """

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: BlockHash | None = None
        # Links of the free queue; both None while the block is not in it.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def incr_ref(self) -> None:
        self.ref_cnt += 1

    def decr_ref(self) -> None:
        if self.ref_cnt <= 0:
            raise ValueError(f"block {self.block_id}: ref_cnt is already {self.ref_cnt}; freed twice?")
        self.ref_cnt -= 1

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
        if self._block_hash is not None:
            raise ValueError(f"block {self.block_id} already has a hash; reset it before caching it again")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash (called when a cached block is evicted for reuse)."""
        self._block_hash = None

    def __repr__(self) -> str:
        h = self._block_hash.hex()[:8] if self._block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """The free blocks, as a doubly linked list threaded through the blocks themselves.

    Order is eviction order: the front is popped first. :meth:`BlockPool.free_blocks` puts a freed block that has
    a hash at the back (:meth:`append_n`), so cached blocks are reused least recently freed first (LRU), and one
    without a hash at the front (:meth:`prepend_n`): its content can never be hit, so it is reused first (LIFO),
    before any cached block is evicted. vLLM v0.33.0: ``vllm/v1/core/kv_cache_utils.py``
    (``FreeKVCacheBlockQueue.prepend_n`` / ``append_n``).
    A Python ``deque`` would not do: a prefix-cache hit must take a free block out of the *middle* of the queue,
    which a linked list does in O(1) given the block.

    Two sentinel blocks (``id -1``) at the ends remove every "is this the first/last node" branch.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block, block.prev_free_block = block, prev
            prev = block
        prev.next_free_block, self.fake_free_list_tail.prev_free_block = self.fake_free_list_tail, prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front (least recently freed) block."""
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail or first is None:
            raise ValueError("no free blocks left")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the ``n`` front blocks, front first."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue, in O(1)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (it will be evicted last)."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        last.next_free_block, block.prev_free_block = block, last
        block.next_free_block, self.fake_free_list_tail.prev_free_block = self.fake_free_list_tail, block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the back, in order: the first of them is evicted first, the last one last."""
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, in order: afterwards ``blocks[0]`` is the front (popped next), then
        ``blocks[1]``, ..., then the blocks that were free before.

        Same order rule as vLLM's ``FreeKVCacheBlockQueue.prepend_n``: the list keeps its order, so
        :meth:`BlockPool.free_blocks` passing a request's blocks tail first puts the tail at the very front.
        """
        blocks = list(blocks)
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise ValueError(f"block {block.block_id} is already in the free queue")
        if len({id(b) for b in blocks}) != len(blocks):
            raise ValueError("a block appears twice in prepend_n")
        if not blocks:
            return
        first = self.fake_free_list_head.next_free_block
        assert first is not None
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block, block.prev_free_block = block, prev
            prev = block
        prev.next_free_block, first.prev_free_block = first, prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, front (next to be reused) to back."""
        out = []
        cur = self.fake_free_list_head.next_free_block
        while cur is not None and cur is not self.fake_free_list_tail:
            out.append(cur)
            cur = cur.next_free_block
        return out


@dataclass
class PrefixCacheStats:
    """Prefix-cache hit counters since the last reset, one record per *admitted* request.

    A request is counted when the scheduler admits it (:meth:`KVCacheManager.record_prefix_cache_stats` after its
    ``allocate_slots`` succeeded), not at each lookup: a request that waits several steps for KV space or token
    budget is looked up each step but counted once. A preempted request that is admitted again is counted in the
    ``preempted_*`` fields, apart, so the hit rate describes new requests only. vLLM v0.33.0:
    ``vllm/v1/metrics/stats.py:PrefixCacheStats.record``, called through
    ``vllm/v1/core/kv_cache_manager.py:KVCacheManager.record_prefix_cache_stats`` from ``Scheduler.schedule``
    ("Record at admission so unscheduled lookups are not counted").

    Attributes:
        requests: new requests admitted after a prefix-cache lookup.
        queries: tokens looked up for them (their lengths).
        hits: tokens of theirs found in the cache (whose prefill is skipped).
        preempted_requests / preempted_queries / preempted_hits: the same for requests admitted again after a
            preemption.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Count one admitted request: ``num_tokens`` looked up, ``num_hits`` of them found in the cache."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Hit tokens over looked-up tokens, new requests only (as vLLM's ``CachingMetrics``)."""
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.requests = self.queries = self.hits = 0
        self.preempted_requests = self.preempted_queries = self.preempted_hits = 0


def get_kv_cache_configs(kv_cache_specs: Sequence[dict[str, FullAttentionSpec]], available_memory: Sequence[int],
                         num_gpu_blocks_override: int | None = None) -> list[KVCacheConfig]:
    """One :class:`~minillm.kv_cache_interface.KVCacheConfig` per worker, from what each reported at start-up.

    Each worker's blocks are its bytes over its bytes per block (the sum of its layers' ``page_size_bytes``); then
    every worker gets the smallest count, since one block table serves every rank. ``num_gpu_blocks_override``
    replaces each worker's bytes by that many blocks of its own, as vLLM does.

    Args:
        kv_cache_specs: per worker (rank order), layer name -> :class:`~minillm.kv_cache_interface.FullAttentionSpec`.
        available_memory: per worker, the bytes it can give its KV cache (``Worker.determine_available_memory``).
        num_gpu_blocks_override: ``EngineArgs.num_gpu_blocks``; ``None``: from the bytes.

    Returns:
        ``[KVCacheConfig(num_blocks=min over workers, kv_cache_spec=worker's)]``, rank order.

    Raises:
        ValueError: the lists differ in length or are empty, or a worker's bytes hold fewer than 2 blocks (the reserved
            null block and one for tokens): the message names the rank and its numbers (vLLM's
            ``_check_enough_kv_cache_memory``: "No available memory for the cache blocks").

    vLLM counterpart: ``vllm/v1/core/kv_cache_planning.py:get_kv_cache_configs`` (in v0.33.0 it moved there from
    ``kv_cache_utils.py``), which also groups layers of different kinds and fits ``max_model_len`` to the memory.
    """
    if len(kv_cache_specs) != len(available_memory) or not kv_cache_specs:
        raise ValueError(f"one KV cache spec and one memory report per worker, got {len(kv_cache_specs)} specs and "
                         f"{len(available_memory)} reports")
    num_blocks: list[int] = []
    for rank, (specs, available) in enumerate(zip(kv_cache_specs, available_memory, strict=True)):
        block_bytes = bytes_per_block(specs)
        if block_bytes <= 0:
            raise ValueError(f"worker rank {rank} reports no KV cache layers")
        if num_gpu_blocks_override is not None:
            available = num_gpu_blocks_override * block_bytes
        if available // block_bytes < 2:
            raise ValueError(f"No available memory for the cache blocks: worker rank {rank} can give its KV cache "
                             f"{available:,} bytes, and one block of its cache ({len(specs)} layers) takes "
                             f"{block_bytes:,} bytes; it needs at least 2 blocks ({2 * block_bytes:,} bytes: "
                             f"the reserved null block and one for tokens). Raise kv_cache_memory_bytes or "
                             f"kv_cache_memory_fraction, or lower block_size.")
        num_blocks.append(available // block_bytes)
    smallest = min(num_blocks)
    return [KVCacheConfig(num_blocks=smallest, kv_cache_spec=dict(specs)) for specs in kv_cache_specs]
