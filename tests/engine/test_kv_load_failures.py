"""What the scheduler does when a KV connector reports a failed load (chapter 9), as vLLM v0.33.0 does under
``kv_load_failure_policy="recompute"``: ``invalid_block_ids`` (``Scheduler._update_requests_with_invalid_blocks``)
and ``failed_recving`` (``Scheduler._handle_failed_recving``).

The fake model runner stands in for the model: it writes each scheduled token into a fake KV cache and reads every
request's whole history back before it samples, raising if a slot holds the wrong token. A failed load is simulated
by overwriting the slots the load should have filled; a request that read them before they are recomputed would
fail the run, so these tests check the recovery itself, not only the scheduler's numbers.
"""
from __future__ import annotations

from collections.abc import Callable

from minillm.config import SchedulerConfig
from minillm.course.fake_runner import FakeModelRunner
from minillm.core.sched.output import EngineCoreOutput, KVConnectorOutput, SchedulerOutput
from minillm.core.sched.scheduler import Scheduler
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 40
PREFIX = list(range(100, 108))  # two full blocks that A and B share through the prefix cache
PROMPTS = {"A": PREFIX + [1, 2], "B": PREFIX + [3, 4]}

# fail(scheduler, step, scheduler_output): the KVConnectorOutput of that step (after damaging the fake KV cache);
# check(scheduler, step, scheduler_output, outputs): runs after the scheduler took the step's output.
Fail = Callable[[Scheduler, int, SchedulerOutput], KVConnectorOutput]
Check = Callable[[Scheduler, int, SchedulerOutput, list[EngineCoreOutput]], None]


def run(fail: Fail | None = None, check: Check | None = None) -> tuple[Scheduler, dict[str, list[int]]]:
    """A arrives at step 0 and B at step 1 (after A's prompt is computed, so B hits A's two full blocks); fake greedy
    tokens to the end. Returns the scheduler and each request's output tokens."""
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64)
    sched = Scheduler(config, num_gpu_blocks=NUM_BLOCKS, block_size=BS, enable_prefix_caching=True)
    runner = FakeModelRunner(NUM_BLOCKS, BS)
    sched.runner = runner
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for step in range(100):
        if step < len(PROMPTS):
            rid = list(PROMPTS)[step]
            sched.add_request(Request(rid, PROMPTS[rid], SamplingParams(max_tokens=6, ignore_eos=True),
                                      arrival_time=float(step)))
        if not sched.has_requests():
            return sched, tokens
        so = sched.schedule()
        out = runner.execute_model(so)
        out.kv_connector_output = fail(sched, step, so) if fail is not None else None
        outputs = sched.update_from_output(so, out)
        for o in outputs:
            tokens[o.request_id] += o.new_token_ids
        if check is not None:
            check(sched, step, so, outputs)
    raise AssertionError("the requests did not finish in 100 steps")


def damage(sched: Scheduler, block_id: int) -> None:
    """What a load that never filled ``block_id`` leaves there."""
    for slot in range(block_id * BS, (block_id + 1) * BS):
        sched.runner.kv_slots[slot] = -7


def is_cached(sched: Scheduler, block_id: int) -> bool:
    return any(block_id in blocks for blocks in sched.kv_cache_manager.block_pool.cached_block_hash_to_block.values())


def all_blocks_back(sched: Scheduler) -> bool:
    return sched.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 1  # all but the null block


def test_without_failures_the_two_requests_share_two_blocks():
    def check(sched, step, so, outputs):
        if step == 1:
            assert sched.kv_cache_manager.get_block_ids("B")[:2] == sched.kv_cache_manager.get_block_ids("A")[:2]
            assert so.num_scheduled_tokens == {"A": 1, "B": 2}, "B computes only its own tail"

    sched, tokens = run(check=check)
    assert all(len(t) == 6 for t in tokens.values()) and all_blocks_back(sched)


def test_a_shared_invalid_block_is_recomputed_by_its_first_holder_and_stays_cached():
    # Step 2 (A and B decode): a load is reported to have failed on the second block, which B shares with A.
    # v0.33.0: A, first in the running queue, goes back to that block's first token (4) and recomputes it in
    # place; B keeps counting it as computed and only redoes this step, since A rewrites the block in the very step
    # where B reads it again. The block stays in the prefix cache (v0.33.0 evicts only under the "fail" policy).
    _, reference = run()
    seen: dict[str, int] = {}

    def fail(sched, step, so):
        if step != 2:
            return KVConnectorOutput()
        seen["block"] = block = sched.kv_cache_manager.get_block_ids("A")[1]
        assert block == sched.kv_cache_manager.get_block_ids("B")[1]
        seen["A"] = sched.requests["A"].num_computed_tokens - so.num_scheduled_tokens["A"]
        seen["B"] = sched.requests["B"].num_computed_tokens - so.num_scheduled_tokens["B"]
        damage(sched, block)
        return KVConnectorOutput(invalid_block_ids={block})

    def check(sched, step, so, outputs):
        if step == 2:
            assert outputs == [], "both read the bad block in this step: their tokens are dropped"
            assert sched.requests["A"].num_computed_tokens == BS, "A recomputes from the bad block's first token"
            assert sched.requests["B"].num_computed_tokens == seen["B"] == 10, \
                "B keeps the shared block as computed and redoes only this step's token"
            assert is_cached(sched, seen["block"]), "the block stays in the prefix cache, to be rewritten"
        if step == 3:
            assert so.num_scheduled_tokens == {"A": seen["A"] + 1 - BS, "B": 1}
            assert set(so.scheduled_cached_reqs.all_token_ids) == {"A", "B"}, \
                "token ids resent whole: the runner appended a token that was dropped"

    sched, tokens = run(fail, check)
    assert seen, "the failure was injected"
    assert tokens == reference, "the recovery gives the tokens of a run where nothing failed"
    assert all_blocks_back(sched)


def test_a_whole_failed_load_of_a_running_request_recomputes_it_from_0_and_keeps_its_blocks():
    # Step 0: A's prompt is "loaded" and a token sampled from it; then the connector reports that the whole load
    # failed (failed_recving). v0.33.0's Scheduler._handle_failed_recving sets num_computed_tokens = 0 (for a request
    # still WAITING_FOR_REMOTE_KVS: its loads are asynchronous). minillm loads synchronously, so A is already
    # running: it goes back to 0, keeps its blocks, and the token is dropped. An id the scheduler does not hold
    # as running is left to the connector.
    _, reference = run()
    seen: dict[str, list[int]] = {}

    def fail(sched, step, so):
        if step != 0:
            return KVConnectorOutput()
        seen["blocks"] = sched.kv_cache_manager.get_block_ids("A")
        for block_id in seen["blocks"]:
            damage(sched, block_id)
        return KVConnectorOutput(failed_recving={"A", "never-added"})

    def check(sched, step, so, outputs):
        if step == 0:
            assert outputs == [] and sched.requests["A"].num_computed_tokens == 0
            assert sched.requests["A"].status == RequestStatus.RUNNING
            assert sched.kv_cache_manager.get_block_ids("A") == seen["blocks"]
        if step == 1:
            assert so.num_scheduled_tokens["A"] == len(PROMPTS["A"]), "A recomputes its whole prompt"
            assert so.scheduled_cached_reqs.new_block_ids[so.scheduled_cached_reqs.req_ids.index("A")] == [], \
                "into the blocks it kept"

    sched, tokens = run(fail, check)
    assert seen, "the failure was injected"
    assert tokens == reference
    assert all_blocks_back(sched)
