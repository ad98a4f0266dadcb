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
    q.prepend_n([blocks[3], blocks[1]])  # into an empty queue
    q.prepend_n([blocks[4]])
    assert [b.block_id for b in q.get_all_free_blocks()] == [4, 3, 1] and q.num_free_blocks == 3
    with pytest.raises(ValueError, match="already in the free queue"):
        q.prepend_n([blocks[0], blocks[3]])
    with pytest.raises(ValueError, match="twice"):
        q.prepend_n([blocks[0], blocks[0]])
    assert q.num_free_blocks == 3 and blocks[0].next_free_block is None  # a refused prepend changes nothing


def _check_links(q: FreeKVCacheBlockQueue, model: list[int]) -> None:
    """The queue equals ``model`` walked forwards *and* backwards (so every prev/next link agrees)."""
    assert [b.block_id for b in q.get_all_free_blocks()] == model
    back, cur = [], q.fake_free_list_tail.prev_free_block
    while cur is not q.fake_free_list_head:
        back.append(cur.block_id)
        cur = cur.prev_free_block
    assert back == model[::-1]
    assert q.num_free_blocks == len(model)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 8),
       ops=st.lists(st.tuples(st.sampled_from(["pop", "pop_n", "remove", "append", "append_n", "prepend_n"]),
                              st.lists(st.integers(0, 7), max_size=4)), max_size=40))
def test_free_queue_matches_a_list_model(n, ops):
    """Random pops / removals / appends / prepends agree with a plain Python list, and the links stay consistent
    both ways. ``prepend_n(xs)`` is ``model[:0] = xs`` (the list keeps its order at the front, as in vLLM)."""
    blocks = [KVCacheBlock(i) for i in range(n)]
    q = FreeKVCacheBlockQueue(blocks)
    model = list(range(n))
    for op, ids in ops:
        ids = list(dict.fromkeys(i % n for i in ids))  # distinct ids
        out = [i for i in ids if i not in model]  # those not in the queue
        if op == "pop" and model:
            assert q.popleft().block_id == model.pop(0)
        elif op == "pop_n":
            k = min(len(ids), len(model))
            assert [b.block_id for b in q.popleft_n(k)] == model[:k]
            del model[:k]
        elif op == "remove" and ids and ids[0] in model:
            q.remove(blocks[ids[0]])
            model.remove(ids[0])
        elif op == "append" and out:
            q.append(blocks[out[0]])
            model.append(out[0])
        elif op == "append_n":
            q.append_n([blocks[i] for i in out])
            model.extend(out)
        elif op == "prepend_n":
            q.prepend_n([blocks[i] for i in out])
            model[:0] = out
        _check_links(q, model)
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
    """Hashed blocks go to the back (LRU), in the order given; unhashed ones to the front (LIFO), in the order
    given (vLLM v0.33.0 BlockPool.free_blocks: prepend_n / append_n)."""
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)  # blocks 1, 2
    b = pool.get_new_blocks(2)  # blocks 3, 4
    pool.cache_full_blocks(a + b, [bytes([i]) * 32 for i in range(4)], 0, 4)
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    # All hashed: a was freed first, and each request tail first: 2, 1, 4, 3.
    assert [x.block_id for x in pool.free_block_queue.get_all_free_blocks()] == [2, 1, 4, 3]
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)  # blocks 1, 2
    b = pool.get_new_blocks(2)  # blocks 3, 4
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    # No hashes: the last freed is reused first, each request's list keeping its order at the front: 4, 3, 2, 1.
    assert [x.block_id for x in pool.free_block_queue.get_all_free_blocks()] == [4, 3, 2, 1]


def test_pool_unhashed_blocks_go_to_the_front_hashed_to_the_back():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)  # 1..5; the free queue is empty
    pool.cache_full_blocks(blocks, [b"p" * 32, b"q" * 32], 0, 2)  # 1 and 2 are full and cached
    pool.free_blocks(reversed(blocks))  # tail first: 5, 4, 3 (no hash), 2, 1 (cached)
    assert [x.block_id for x in pool.free_block_queue.get_all_free_blocks()] == [5, 4, 3, 2, 1]
    (c,) = pool.get_new_blocks(1)
    pool.free_blocks([c])  # an unhashed block freed later still comes before every cached block
    assert [x.block_id for x in pool.free_block_queue.get_all_free_blocks()] == [5, 4, 3, 2, 1]
    # Three new blocks take 5, 4, 3: the cached blocks 1 and 2 survive.
    assert [x.block_id for x in pool.get_new_blocks(3)] == [5, 4, 3]
    assert pool.get_cached_block(b"p" * 32) is blocks[0] and pool.get_cached_block(b"q" * 32) is blocks[1]
    # With caching off every block is "without a hash": all LIFO.
    pool = BlockPool(4, enable_caching=False)
    x = pool.get_new_blocks(2)
    pool.free_blocks([x[1]])
    pool.free_blocks([x[0]])
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [1, 2, 3]


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
