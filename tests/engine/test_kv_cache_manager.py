"""KVCacheManager (chapter 2): allocation, prefix caching, freeing, and a hypothesis state machine over all of it."""
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minillm.core import KVCacheManager, hash_block_tokens, hash_request_tokens
from minillm.request import Request


def _req(rid, tokens):
    return Request(rid, list(tokens))


def _prefill(mgr, req):
    """Admit ``req`` the way the scheduler does: look up the cache, allocate the rest, mark all computed."""
    blocks, hit = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    if new is not None:
        mgr.record_prefix_cache_stats(req, hit)
        req.num_computed_tokens = req.num_tokens
    return new, hit


def test_allocate_across_block_boundary():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    r = _req("a", range(6))
    new, hit = _prefill(mgr, r)
    assert hit == 0 and len(new) == 2 and mgr.get_block_ids("a") == [1, 2]
    r.append_output_token_ids(100)  # token 7 of 8: block 2 still has room
    assert mgr.allocate_slots(r, 1) == []
    r.num_computed_tokens += 1
    r.append_output_token_ids(101)
    assert mgr.allocate_slots(r, 1) == []  # token 8 fills block 2 exactly
    r.num_computed_tokens += 1
    r.append_output_token_ids(102)
    new = mgr.allocate_slots(r, 1)  # token 9 needs a third block
    assert [b.block_id for b in new] == [3] and mgr.get_block_ids("a") == [1, 2, 3]
    assert mgr.num_free_blocks == 6 and mgr.usage == pytest.approx(3 / 9)


def test_full_blocks_are_cached_and_hit_but_never_the_whole_prompt():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    a = _req("a", range(8))  # exactly two full blocks
    _prefill(mgr, a)
    assert a.block_hashes == hash_request_tokens(list(range(8)), 4)
    b = _req("b", range(8))
    blocks, hit = mgr.get_computed_blocks(b)
    # Both blocks are cached, but token 7 must be recomputed to get the logits: only one block is a hit.
    assert hit == 4 and [x.block_id for x in blocks] == [1]
    new = mgr.allocate_slots(b, 4, hit, blocks)
    mgr.record_prefix_cache_stats(b, hit)
    assert mgr.get_block_ids("b")[0] == 1 and len(new) == 1
    assert mgr.block_pool.blocks[1].ref_cnt == 2
    c = _req("c", list(range(8)) + [9])
    assert mgr.get_computed_blocks(c)[1] == 8  # looked up, never admitted: not counted
    s = mgr.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (2, 8 + 8, 0 + 4)
    assert s.hit_rate == pytest.approx(4 / 16)
    c.num_preemptions = 1  # admitted again after a preemption: counted apart, outside the hit rate
    mgr.record_prefix_cache_stats(c, 8)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 9, 8) and s.requests == 2
    assert mgr.make_prefix_cache_stats().hits == 4 and mgr.prefix_cache_stats.hits == 0


def test_lookups_are_not_counted_only_admissions_are():
    """vLLM v0.33.0 counts a request once, at admission (kv_cache_manager.py:KVCacheManager.
    record_prefix_cache_stats, called from Scheduler.schedule); get_computed_blocks records nothing."""
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    _prefill(mgr, _req("a", range(9)))
    b = _req("b", range(9))
    for _ in range(3):  # a request that waits: looked up in each of three steps
        assert mgr.get_computed_blocks(b)[1] == 8
    s = mgr.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (1, 9, 0)  # only a


def test_a_different_first_block_breaks_the_chain():
    mgr = KVCacheManager(num_blocks=10, block_size=2)
    _prefill(mgr, _req("a", [1, 2, 3, 4, 5]))
    # Same second block [3, 4] but a different first block: no hit at all.
    assert mgr.get_computed_blocks(_req("b", [9, 9, 3, 4, 5]))[1] == 0
    assert mgr.get_computed_blocks(_req("c", [1, 2, 3, 9, 5]))[1] == 2


def test_allocate_returns_none_and_changes_nothing_when_full():
    mgr = KVCacheManager(num_blocks=4, block_size=2)  # 3 usable blocks
    _prefill(mgr, _req("a", range(4)))
    before = (mgr.num_free_blocks, dict(mgr.req_to_blocks))
    assert mgr.allocate_slots(_req("b", range(10, 14)), 4) is None
    assert (mgr.num_free_blocks, dict(mgr.req_to_blocks)) == before
    assert mgr.get_block_ids("b") == []


def test_hit_on_a_free_cached_block_counts_against_free_blocks():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = _req("a", [1, 2, 3])
    _prefill(mgr, a)
    mgr.free(a)  # block of [1, 2] is free but cached
    b = _req("b", [1, 2, 7, 8, 9, 10])
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 2
    # 3 blocks needed: 1 hit (taken from the free queue) + 2 new = all 3 free blocks -> fits.
    assert mgr.allocate_slots(b, 4, hit, blocks) is not None and mgr.num_free_blocks == 0


def test_free_is_tail_first_so_tails_are_evicted_first():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    a = _req("a", range(7))  # blocks 1, 2, 3 (full), 4 (partial)
    _prefill(mgr, a)
    mgr.free(a)
    order = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    # The partial block 4 has no hash: to the front (reused first); the cached 3, 2, 1 to the back, tail first.
    assert order == [4, 5, 6, 7, 3, 2, 1]
    # Five new blocks: 4, 5, 6, 7 (no useful content) then 3. Block 1 and 2 (the prefix) survive.
    _prefill(mgr, _req("x", range(100, 109)))
    assert mgr.get_computed_blocks(_req("y", range(7)))[1] == 4


def test_a_cached_prefix_is_not_evicted_while_unhashed_blocks_are_free():
    """vLLM v0.33.0 BlockPool.free_blocks: a freed block without a hash goes to the front of the free queue, so
    the pool reuses every such block before it evicts a cached one, whatever order they were freed in."""
    mgr = KVCacheManager(num_blocks=6, block_size=2)  # 5 usable blocks
    a = _req("a", [1, 2, 3])  # block 1 full (cached), block 2 partial
    b = _req("b", [50, 51, 52])  # block 3 full (cached), block 4 partial
    _prefill(mgr, a)
    _prefill(mgr, b)
    mgr.free(a)
    mgr.free(b)  # the partial block 4 is freed after the cached block 1
    order = [x.block_id for x in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    assert order == [4, 2, 5, 1, 3]  # unhashed 4, 2 (LIFO) and never-used 5 before cached 1, 3 (LRU)
    _prefill(mgr, _req("c", range(100, 105)))  # 3 new blocks: 4, 2, 5; nothing cached is evicted
    assert mgr.get_block_ids("c") == [4, 2, 5]
    assert mgr.get_computed_blocks(_req("a2", [1, 2, 3]))[1] == 2  # a's prefix block still hits
    assert mgr.get_computed_blocks(_req("b2", [50, 51, 52]))[1] == 2


def test_no_caching_mode_and_bad_arguments():
    mgr = KVCacheManager(num_blocks=6, block_size=2, enable_caching=False)
    _prefill(mgr, _req("a", range(4)))
    assert mgr.get_computed_blocks(_req("b", range(4))) == ([], 0)
    assert mgr.block_pool.num_cached_blocks == 0
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate_slots(_req("c", [1]), -1)
    mgr2 = KVCacheManager(num_blocks=6, block_size=2)
    _prefill(mgr2, _req("a", range(4)))
    r = _req("b", range(4))
    blocks, hit = mgr2.get_computed_blocks(r)
    with pytest.raises(ValueError, match="must equal"):
        mgr2.allocate_slots(r, 2, hit + 1, blocks)


def test_reset_prefix_cache():
    mgr = KVCacheManager(num_blocks=6, block_size=2)
    a = _req("a", range(5))
    _prefill(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(_req("b", range(5)))[1] == 0


def test_cache_salt_isolates_requests():
    mgr = KVCacheManager(num_blocks=6, block_size=2)
    a = _req("a", range(5))
    a.cache_salt = "tenant-1"
    _prefill(mgr, a)
    assert mgr.get_computed_blocks(_req("b", range(5)))[1] == 0
    c = _req("c", range(5))
    c.cache_salt = "tenant-1"
    assert mgr.get_computed_blocks(c)[1] == 4


# -- the property test ------------------------------------------------------------------------------------------------
PROMPT_PREFIXES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], [7, 7]]


class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions (with prefix hits and chunked prefill), decode steps, frees and cache resets.

    The test keeps its own copy of what each physical block holds (``contents``, written at the slots the manager
    gives out, like reshape_and_cache would), so it can check that every request reads back its own tokens and that
    every cached hash names a block whose content produces that hash.
    """

    @initialize(num_blocks=st.integers(2, 14), block_size=st.integers(1, 4))
    def setup(self, num_blocks, block_size):
        self.mgr = KVCacheManager(num_blocks, block_size)
        self.bs = block_size
        self.live: dict[str, Request] = {}
        self.contents: dict[int, dict[int, int]] = {}  # block id -> {offset: token}
        self.next_id = 0
        self.seen_hashes: set[bytes] = set()  # every hash any request ever had: candidate parents

    def _write(self, req, start, end):
        ids = self.mgr.get_block_ids(req.request_id)
        for pos in range(start, end):
            self.contents.setdefault(ids[pos // self.bs], {})[pos % self.bs] = req.all_token_ids[pos]

    def _compute(self, req, n):
        """Schedule ``n`` tokens of ``req``; returns False (state untouched) if the pool is too full."""
        free_before = self.mgr.num_free_blocks
        if self.mgr.allocate_slots(req, n) is None:
            assert self.mgr.num_free_blocks == free_before
            return False
        self._write(req, req.num_computed_tokens, req.num_computed_tokens + n)
        req.num_computed_tokens += n
        return True

    @rule(prefix=st.sampled_from(PROMPT_PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=6),
          chunk=st.integers(1, 12))
    def add_request(self, prefix, suffix, chunk):
        req = Request(f"r{self.next_id}", prefix + suffix)
        self.next_id += 1
        blocks, hit = self.mgr.get_computed_blocks(req)
        assert hit == len(blocks) * self.bs and hit < req.num_tokens
        assert [b.block_hash for b in blocks] == req.block_hashes[:len(blocks)]
        n = min(chunk, req.num_tokens - hit)
        free_before = self.mgr.num_free_blocks
        if self.mgr.allocate_slots(req, n, hit, blocks) is None:
            assert self.mgr.num_free_blocks == free_before and self.mgr.get_block_ids(req.request_id) == []
            return
        self._write(req, hit, hit + n)  # cache hits are NOT written: their content must already be there
        req.num_computed_tokens = hit + n
        self.live[req.request_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 5), token=st.integers(0, 3))
    def step(self, data, chunk, token):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if req.num_computed_tokens == req.num_tokens:  # decode: the sampled token joins the sequence
            req.append_output_token_ids(token)
        self._compute(req, min(chunk, req.num_tokens - req.num_computed_tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.mgr.free(self.live.pop(rid))
        assert self.mgr.get_block_ids(rid) == []

    @rule()
    def reset_prefix_cache(self):
        assert self.mgr.reset_prefix_cache() == (not self.live)

    @invariant()
    def blocks_are_accounted_for(self):
        pool = self.mgr.block_pool
        free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free_ids) == len(set(free_ids)) == self.mgr.num_free_blocks, "a block is in the free queue twice"
        holders: dict[int, int] = {}
        for rid, req in self.live.items():
            ids = self.mgr.get_block_ids(rid)
            assert len(ids) == len(set(ids)), f"{rid} holds a block twice"
            assert len(ids) * self.bs >= req.num_computed_tokens
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
        assert 0 not in holders and 0 not in free_ids, "the null block was handed out"
        assert set(self.mgr.req_to_blocks) == set(self.live)
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0), f"block {block.block_id}: wrong ref_cnt"
            # Exactly one of: held by a request, or free. Never both, never neither (a leak).
            assert (block.ref_cnt > 0) != (block.block_id in free_ids), f"block {block.block_id} leaked or double"

    @invariant()
    def every_request_reads_back_its_own_tokens(self):
        for rid, req in self.live.items():
            ids = self.mgr.get_block_ids(rid)
            for pos in range(req.num_computed_tokens):
                assert self.contents[ids[pos // self.bs]][pos % self.bs] == req.all_token_ids[pos], (
                    f"{rid} token {pos} is not what its block holds")

    @invariant()
    def cached_hashes_name_their_content(self):
        pool = self.mgr.block_pool
        for req in self.live.values():
            self.seen_hashes.update(req.block_hashes)
        for h, entries in pool.cached_block_hash_to_block.items():
            for bid, block in entries.items():
                assert block.block_hash == h and block.block_id == bid
                tokens = [self.contents[bid][o] for o in range(self.bs)]
                # The hash covers the whole prefix: some request's chain must end in (parent, these tokens) -> h.
                assert any(hash_block_tokens(p, tokens) == h for p in [None, *self.seen_hashes]), (
                    f"block {bid} content does not produce its hash")

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for req in list(self.live.values()):
            self.mgr.free(req)
        assert self.mgr.num_free_blocks == self.mgr.num_blocks - 1, "freeing everything did not refill the pool"
        assert all(b.ref_cnt == 0 for b in self.mgr.block_pool.blocks)


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
test_kv_cache_manager_state_machine = KVCacheMachine.TestCase


def test_block_table_widget_headless():
    """The chapter's widget drives a real manager; its text view reports the state, and a full pool is reported."""
    import matplotlib

    matplotlib.use("Agg")
    from minillm.course.widgets import BlockTableWidget

    w = BlockTableWidget(num_blocks=5, block_size=4, prompts={"A": list(range(10)), "A'": list(range(8)) + [99]})
    assert w.add_request("A") == "A0: 10 prompt tokens, 0 from the prefix cache"
    assert w.add_request("A'") == "A'1: 9 prompt tokens, 8 from the prefix cache"
    assert w.manager.get_block_ids("A'1")[:2] == w.manager.get_block_ids("A0")[:2]
    assert "pool full after 2 tokens" in w.append_tokens("A0", 5)  # 4 usable blocks: 3 for A, 1 more for A'
    text = w.state_text()
    assert "A0: block_table [1, 2, 3], 12 tokens" in text and "free 0" in text
    w.free("A0")
    # A' still holds the shared blocks 1 and 2: only A's own tail block 3 (full, so still cached: *) is free.
    assert w.manager.num_free_blocks == 1 and "free queue (evicted first -> last): 3*" in w.state_text()
    with pytest.raises(ValueError, match="no running request 'A0'"):
        w.free("A0")
    w.plot()
    w.ui()  # builds the ipywidgets view without a front-end
