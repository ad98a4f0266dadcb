"""KVCacheBlock, FreeKVCacheBlockQueue, block hashing and BlockPool (chapter 2)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.core import (NONE_HASH, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens,
                          hash_request_tokens)


# -- hashing ----------------------------------------------------------------------------------------------------------
def test_hash_is_deterministic_and_32_bytes():
    h = hash_block_tokens(None, [1, 2, 3])
    assert h == hash_block_tokens(None, [1, 2, 3]) and isinstance(h, bytes) and len(h) == 32
    assert h == hash_block_tokens(NONE_HASH, [1, 2, 3])  # None means "first block": the fixed root seed


def test_hash_chain_depends_on_parent_tokens_and_extra_keys():
    a = hash_block_tokens(None, [1, 2])
    b = hash_block_tokens(None, [3, 4])
    # Same block tokens [5, 6] after different prefixes: different hashes, that is the point of the chain.
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(b, [5, 6])
    assert hash_block_tokens(None, [1, 2], ("salt",)) != a
    # Fixed-width encoding: [1, 23] and [12, 3] do not collide the way a naive string join would.
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])


def test_hash_request_tokens_only_hashes_full_blocks():
    toks = list(range(10))
    hs = hash_request_tokens(toks, 4)
    assert len(hs) == 2
    assert hs[1] == hash_block_tokens(hash_block_tokens(None, toks[:4]), toks[4:8])
    assert hash_request_tokens(toks[:8], 4) == hs  # the partial tail changes nothing
    with pytest.raises(ValueError, match="block_size"):
        hash_request_tokens(toks, 0)


# -- the free queue ---------------------------------------------------------------------------------------------------
def test_free_queue_order_and_remove_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert q.num_free_blocks == 4 and [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4, 2]
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[3])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[0])
    assert [b.block_id for b in q.popleft_n(4)] == [1, 3, 4, 2]
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), ops=st.lists(st.tuples(st.sampled_from(["pop", "remove", "append"]),
                                                     st.integers(0, 7)), max_size=40))
def test_free_queue_matches_a_list_model(n, ops):
    """Random pops / removals / appends agree with a plain Python list, and the links stay consistent."""
    blocks = [KVCacheBlock(i) for i in range(n)]
    q = FreeKVCacheBlockQueue(blocks)
    model = list(range(n))
    for op, i in ops:
        i %= n
        if op == "pop" and model:
            assert q.popleft().block_id == model.pop(0)
        elif op == "remove" and i in model:
            q.remove(blocks[i])
            model.remove(i)
        elif op == "append" and i not in model:
            q.append(blocks[i])
            model.append(i)
        assert [b.block_id for b in q.get_all_free_blocks()] == model
        assert q.num_free_blocks == len(model)
    for i in range(n):  # a block outside the queue has no links (so append/remove can detect misuse)
        if i not in model:
            assert blocks[i].prev_free_block is None and blocks[i].next_free_block is None


# -- the pool ---------------------------------------------------------------------------------------------------------
def test_pool_null_block_is_reserved():
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 3
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3] and all(b.ref_cnt == 1 for b in got)
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_pool_free_order_is_eviction_order():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)  # blocks 1, 2
    b = pool.get_new_blocks(2)  # blocks 3, 4
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    # a was freed first, and each request tail first: 2, 1, 4, 3.
    assert [x.block_id for x in pool.free_block_queue.get_all_free_blocks()] == [2, 1, 4, 3]


def test_pool_cached_block_survives_free_until_reused():
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [7, 7])
    pool.cache_full_blocks([blk], [h], 0, 1)
    assert pool.get_cached_block(h) is blk and blk.block_hash == h
    pool.free_blocks([blk])
    assert pool.get_cached_block(h) is blk  # freed, but still findable
    pool.touch([blk])  # a hit revives it: out of the free queue, ref 1
    assert blk.ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks([blk])
    new = pool.get_new_blocks(2)  # now the pool needs the memory: block 2 first, then the cached block 1
    assert blk in new and blk.block_hash is None and pool.get_cached_block(h) is None
    assert pool.num_cached_blocks == 0


def test_pool_reset_prefix_cache_only_when_idle():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"x" * 32], 0, 1)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"x" * 32) is None and blocks[0].block_hash is None


def test_block_double_free_is_an_error():
    blk = KVCacheBlock(1)
    with pytest.raises(ValueError, match="freed twice"):
        blk.decr_ref()
    blk.block_hash = b"h"
    with pytest.raises(ValueError, match="already has a hash"):
        blk.block_hash = b"g"
