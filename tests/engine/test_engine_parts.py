"""EngineParts is wired: every part is called by the engine at its place, and the package's parts passed explicitly
give the same engine as the defaults (so chapter 8's seam changes nothing until a learner's part goes in)."""
from __future__ import annotations

import pytest

from minillm.attention.reference import reference_attention
from minillm.core.kv_cache_manager import allocate_new_blocks, free_request_blocks, num_cached_prefix_tokens
from minillm.core.kv_cache_utils import hash_request_tokens
from minillm.core.sched.scheduler import Scheduler
from minillm.core.sched.utils import check_stop
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.parts import PART_NAMES, EngineParts
from minillm.course.exercises.capstone import run_requests
from minillm.sample.ops.topk_topp import apply_top_k_top_p
from minillm.sampling_params import SamplingParams
from minillm.worker.model_runner import prepare_inputs
from tests.engine_helpers import tiny_model

MODEL = tiny_model()
# Small blocks and cache, a small budget: chunked prefill, prefix hits (shared first 12 tokens) and preemption.
ARGS = dict(block_size=4, num_gpu_blocks=14, max_num_batched_tokens=12, max_num_seqs=4, max_model_len=48)
PROMPTS = [list(range(1, 13)) + [20 + i] * (5 + i) for i in range(4)]
PARAMS = [SamplingParams(max_tokens=8, temperature=0.0), SamplingParams(max_tokens=8, temperature=0.0),
          SamplingParams(max_tokens=8, temperature=1.0, top_k=5, top_p=0.8, seed=3),
          SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[7])]


def run(parts: EngineParts | None):
    engine = LLMEngine(MODEL, None, EngineArgs(**ARGS), parts=parts)
    return run_requests(engine, PROMPTS, PARAMS), engine.stats


def counting(calls: dict, name: str, fn):
    def wrapped(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)
    return wrapped


def test_every_part_is_called_and_the_package_parts_change_nothing():
    default_tokens, stats = run(None)
    assert stats.num_preemptions >= 1 and stats.num_cached_prompt_tokens > 0  # the workload needs every part
    calls: dict[str, int] = {}

    class CountingScheduler(Scheduler):
        def schedule(self):
            calls["scheduler_cls"] = calls.get("scheduler_cls", 0) + 1
            return super().schedule()

    package = dict(attention=reference_attention, allocate_slots=allocate_new_blocks,
                   block_hashes=hash_request_tokens, num_cached_tokens=num_cached_prefix_tokens,
                   free=free_request_blocks, top_k_top_p=apply_top_k_top_p, check_stop=check_stop,
                   prepare_inputs=prepare_inputs)
    parts = EngineParts(scheduler_cls=CountingScheduler,
                        **{name: counting(calls, name, fn) for name, fn in package.items()})
    tokens, _ = run(parts)
    assert tokens == default_tokens
    assert sorted(calls) == sorted(PART_NAMES) and all(n > 0 for n in calls.values()), calls


def test_engine_rejects_parts_of_the_wrong_type():
    with pytest.raises(ValueError, match="parts must be an EngineParts"):
        LLMEngine(MODEL, None, EngineArgs(**ARGS), parts={"free": free_request_blocks})


def test_a_wrong_part_changes_the_engine():
    """The seam is live: a top-k/top-p that keeps only the argmax makes the sampled request greedy."""
    def argmax_only(logits, k, p):
        keep = logits.argmax(dim=-1, keepdim=True)
        return logits.new_full(logits.shape, float("-inf")).scatter(1, keep, logits.gather(1, keep))

    tokens, _ = run(EngineParts(top_k_top_p=argmax_only))
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    engine = LLMEngine(MODEL, None, EngineArgs(**ARGS))
    engine.add_request("g", PROMPTS[2], greedy)
    finished = [out for _ in range(100) for out in engine.step() if out.finished]
    assert len(finished) == 1 and tokens[2] == finished[0].outputs[0].token_ids
    assert tokens[2] != run(None)[0][2]  # and the real top-k/top-p samples something else here
