"""Challenge 2: give back the KV blocks that a sliding window has left behind.

With sliding-window attention of width ``W`` the token at position ``p`` attends to positions ``p - W + 1 .. p``
only. A request's next token sits at position ``num_computed_tokens``, so every token before
``num_computed_tokens - W + 1`` is out of reach of every token still to come, and a block made only of such tokens
can go back to the pool while the request runs. Its place in the block table is taken by the null block, so that
block ``i`` still stands for positions ``i * block_size ..`` and the table keeps its length.

vLLM v0.33.0: ``vllm/v1/core/single_type_kv_cache_manager.py:SlidingWindowManager.get_num_skipped_tokens`` (the
number of leading tokens no future token attends to) and ``SingleTypeKVCacheManager.remove_skipped_blocks`` with
``_remove_blocks_in_range`` (free the blocks made only of those tokens, the last one first, stop at the first null
block, put ``block_pool.null_block`` in their place); ``vllm/v1/core/kv_cache_manager.py:KVCacheManager.
allocate_slots`` calls it at every step, before allocating. The freeing itself is ``vllm/v1/core/block_pool.py:
BlockPool.free_blocks``, exercise 2.5. minillm's engine has no sliding-window layers, so nothing here is used by it.
"""
from __future__ import annotations

from minillm.core.block_pool import BlockPool
from minillm.core.kv_cache_utils import KVCacheBlock

# What a delegating answer could call (the tripwire reads it for "C2").
TARGETS = ("minillm.course.exercises.challenges.ch02:free_out_of_window",
           "minillm.course.exercises.challenges.ch02:num_skipped_tokens")


def num_skipped_tokens(num_computed_tokens: int, sliding_window: int) -> int:
    """Leading tokens that no future token attends to.

    E.g. ``sliding_window=4, num_computed_tokens=7``: the next token (position 7) attends to positions 4 .. 7, so
    tokens 0 .. 3 are skipped and the result is 4.
    """
    return max(0, num_computed_tokens - sliding_window + 1)


def free_out_of_window(pool: BlockPool, req_blocks: list[KVCacheBlock], num_computed_tokens: int,
                       sliding_window: int, block_size: int) -> None:
    """Free the blocks of ``req_blocks`` that lie entirely before the window of the request's next token, and put
    ``pool.null_block`` in their places. Called again at every step; blocks freed by an earlier call are not freed
    again."""
    # Only whole blocks: a block with one token still in the window stays. Never more blocks than the request holds.
    num_blocks = min(num_skipped_tokens(num_computed_tokens, sliding_window) // block_size, len(req_blocks))
    freed: list[KVCacheBlock] = []
    for i in range(num_blocks - 1, -1, -1):  # the last skipped block first: tail first, as in exercise 2.5
        if req_blocks[i].is_null:  # freed by an earlier call, and so is every block before it
            break
        freed.append(req_blocks[i])
        req_blocks[i] = pool.null_block
    pool.free_blocks(freed)
