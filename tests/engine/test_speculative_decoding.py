"""Speculative decoding with n-gram drafts: the scheduler verifies drafts, rolls back rejected ones, and nothing it
does changes a greedy token.

The tiny random Llama of ``engine_helpers`` is checked against a reference that recomputes the whole sequence with
no cache; SmolLM2 on a repetitive prompt shows that drafts are really accepted and save forward passes.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.config import SchedulerConfig, SpeculativeConfig
from minillm.core.sched.output import ModelRunnerOutput
from minillm.core.sched.scheduler import Scheduler
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.request import Request
from minillm.sampling_params import SamplingParams
from tests.engine_helpers import TINY, check_greedy_match, greedy_reference, single_thread  # noqa: F401
from tests.engine.test_engine import _TINY_MODEL, run_to_completion, serve_and_check_greedy

pytestmark = pytest.mark.usefixtures("single_thread")

MAX_TOKENS = 12


def ngram(k: int = 3, lo: int = 1, hi: int = 3) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}


# Prompts that repeat a pattern, so that prompt lookup finds matches (random prompts would rarely draft).
def _repetitive(draw_list: list[int], reps: int) -> list[int]:
    return (draw_list * reps)[: max(1, len(draw_list) * reps)]


# -- greedy tokens do not change, whatever the engine does around the drafts -----------------------------------------
@settings(max_examples=30, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 4, 16]), budget=st.sampled_from([3, 8, 40, 256]),
       threshold=st.sampled_from([0, 2, 7]), k=st.sampled_from([1, 3, 5]), tight_cache=st.booleans(),
       prefix_caching=st.booleans())
def test_speculative_greedy_equals_no_cache_reference(data, block_size, budget, threshold, k, tight_cache,
                                                      prefix_caching):
    max_model_len = 48
    num = data.draw(st.integers(1, 5))
    prompts = []
    for _ in range(num):
        pattern = data.draw(st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=6))
        prompts.append(_repetitive(pattern, data.draw(st.integers(1, 5))))
    arrive = data.draw(st.lists(st.integers(0, 4), min_size=num, max_size=num))
    blocks = -(-max_model_len // block_size) + 1 + (1 if tight_cache else 200)
    args = EngineArgs(block_size=block_size, num_gpu_blocks=blocks, max_num_batched_tokens=budget,
                      max_num_seqs=min(budget, 8), max_model_len=max_model_len,
                      long_prefill_token_threshold=threshold, enable_prefix_caching=prefix_caching,
                      speculative_config=ngram(k))
    engine = LLMEngine(_TINY_MODEL, None, args)
    serve_and_check_greedy(engine, prompts, arrive, MAX_TOKENS)
    assert engine.stats.num_accepted_tokens <= engine.stats.num_draft_tokens


def _run(prompts: list[list[int]], params: SamplingParams, **engine_args) -> tuple[dict[str, list[int]], LLMEngine]:
    args = dict(block_size=4, num_gpu_blocks=200, max_model_len=64)
    args.update(engine_args)
    engine = LLMEngine(_TINY_MODEL, None, EngineArgs(**args))
    return run_to_completion(engine, {0: [(str(i), p, params) for i, p in enumerate(prompts)]}), engine


def test_drafts_are_accepted_and_save_steps():
    """On prompts the tiny model continues by repeating them, drafts are verified, many kept, and the same tokens
    come out in fewer steps than without speculation."""
    prompts = [[5, 9, 17] * 6, [40, 41, 42, 43] * 5, [7] * 12]
    params = SamplingParams.greedy(max_tokens=24)
    plain, plain_engine = _run(prompts, params)
    spec, spec_engine = _run(prompts, params, speculative_config=ngram(4))
    assert spec == plain
    assert all(len(t) == 24 for t in spec.values())  # max_tokens exactly, even when drafts could run past it
    stats = spec_engine.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert 0 < stats.acceptance_rate <= 1
    assert stats.num_steps < plain_engine.stats.num_steps
    assert stats.num_generated_tokens == plain_engine.stats.num_generated_tokens


def test_seeded_sampling_with_drafts_ignores_batching_and_chunking():
    """Drafts depend only on a request's own tokens, and the rejection sampler draws from the request's own
    generator: the batch around it changes nothing."""
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=16)
    prompts = [[5, 9, 17] * 6, [40, 41, 42, 43] * 5, list(range(60, 75))]
    a, _ = _run(prompts, params, speculative_config=ngram(3))
    b, _ = _run(prompts, params, speculative_config=ngram(3), max_num_batched_tokens=9, max_num_seqs=2,
                long_prefill_token_threshold=5)
    c, _ = _run(prompts[:1], params, speculative_config=ngram(3))
    assert a == b
    assert a["0"] == c["0"]


def test_drafts_never_pass_max_model_len():
    prompt = [5, 9, 17] * 6  # 18 tokens; 6 more fill max_model_len = 24
    params = SamplingParams.greedy(max_tokens=None)
    tokens, engine = _run([prompt], params, max_model_len=24, speculative_config=ngram(5))
    assert len(tokens["0"]) == 24 - len(prompt)
    ref, logits = greedy_reference(_TINY_MODEL, prompt, 24 - len(prompt))
    check_greedy_match(tokens["0"], ref, logits, what="max_model_len")


# -- the scheduler's side -----------------------------------------------------------------------------------------
def _scheduler(budget: int = 64, max_model_len: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=min(8, budget), max_model_len=max_model_len)
    return Scheduler(cfg, num_gpu_blocks=64, block_size=4)


def _decoding_request(sched: Scheduler, prompt: list[int], first_token: int) -> Request:
    """A request whose prompt was prefilled and whose first token was sampled."""
    req = Request("r", prompt, SamplingParams.greedy(max_tokens=20))
    sched.add_request(req)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["r"], {"r": 0}, [[first_token]]))
    return req


def test_scheduler_schedules_drafts_and_rolls_back_the_rejected_ones():
    sched = _scheduler()
    req = _decoding_request(sched, list(range(1, 11)), 50)
    assert (req.num_tokens, req.num_computed_tokens) == (11, 10)
    req.spec_token_ids = [51, 52, 53]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 4}  # the last sampled token and three drafts
    assert so.scheduled_spec_decode_tokens == {"r": [51, 52, 53]}
    assert req.num_computed_tokens == 14
    # The model kept 51 and 52, rejected 53 and sampled 60 in its place.
    outs = sched.update_from_output(so, ModelRunnerOutput(["r"], {"r": 0}, [[51, 52, 60]]))
    assert outs[0].new_token_ids == [51, 52, 60]
    assert req.all_token_ids[-4:] == [50, 51, 52, 60]
    assert req.num_computed_tokens == 13  # K/V of 50, 51, 52 are valid; 53's slot will be overwritten
    assert req.num_tokens - req.num_computed_tokens == 1
    assert req.spec_token_ids == []


def test_a_stop_token_among_the_accepted_drafts_ends_the_request_there():
    sched = _scheduler()
    req = Request("r", list(range(1, 11)), SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[52]))
    sched.add_request(req)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["r"], {"r": 0}, [[50]]))
    req.spec_token_ids = [51, 52, 53]
    so = sched.schedule()
    outs = sched.update_from_output(so, ModelRunnerOutput(["r"], {"r": 0}, [[51, 52, 53, 54]]))
    assert outs[0].new_token_ids == [51, 52] and outs[0].finish_reason == "stop"
    assert req.output_token_ids == [50, 51, 52]
    assert sched.kv_cache_manager.num_free_blocks == 63  # all blocks back (64 minus the null block)


def test_the_budget_and_max_model_len_cut_the_drafts():
    sched = _scheduler(budget=3)
    req = _decoding_request(sched, [1, 2], 50)
    req.spec_token_ids = [51, 52, 53, 54]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 3} and so.scheduled_spec_decode_tokens == {"r": [51, 52]}

    sched = _scheduler(max_model_len=16)
    req = _decoding_request(sched, list(range(1, 14)), 50)  # 14 tokens, 13 computed
    req.spec_token_ids = [51, 52, 53, 54]
    so = sched.schedule()
    # Positions 13 and 14 are fed; the token sampled after position 14 is the 16th and last one.
    assert so.num_scheduled_tokens == {"r": 2} and so.scheduled_spec_decode_tokens == {"r": [51]}


def test_update_draft_token_ids_skips_finished_and_prefilling_requests():
    sched = _scheduler()
    req = _decoding_request(sched, [1, 2, 3], 50)
    sched.update_draft_token_ids(ModelRunnerOutput(["r", "gone"], {"r": 0, "gone": 1}, [[50], []],
                                                   draft_token_ids=[[7, 8], [9]]))
    assert req.spec_token_ids == [7, 8]
    sched.finish_requests("r")
    sched.update_draft_token_ids(ModelRunnerOutput(["r"], {"r": 0}, [[1]], draft_token_ids=[[3]]))
    assert req.spec_token_ids == [7, 8]  # untouched: it finished


# -- configuration -------------------------------------------------------------------------------------------------
def test_speculative_config_is_checked_and_filled_in():
    assert SpeculativeConfig.from_any(None) is None
    full = SpeculativeConfig.from_any('{"method": "ngram", "num_speculative_tokens": 5}')
    assert full == SpeculativeConfig("ngram", num_speculative_tokens=5, prompt_lookup_max=3, prompt_lookup_min=1)
    args = EngineArgs(speculative_config={"method": "ngram"})
    assert args.speculative_config == args.create_speculative_config() == SpeculativeConfig("ngram")
    assert args.speculative_config.num_speculative_tokens == 3


@pytest.mark.parametrize("config, match", [
    ({"method": "eagle"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "lookahead": 2}, "unknown key"),
    ("{not json", "JSON"),
    (["ngram"], "dict"),
])
def test_bad_speculative_configs_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(speculative_config=config)


def test_logprobs_with_speculation_are_refused_at_the_door():
    engine = LLMEngine(_TINY_MODEL, None, EngineArgs(num_gpu_blocks=40, max_model_len=48,
                                                     speculative_config=ngram()))
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, logprobs=1))
    assert not engine.has_unfinished_requests()


# -- the real model ------------------------------------------------------------------------------------------------
def test_smollm_counting_prompt_accepts_drafts_and_keeps_greedy_tokens(smollm):
    model, tokenizer = smollm
    prompt = tokenizer.encode("one two three, one two three, one two three, one two three, one two")
    params = SamplingParams.greedy(max_tokens=24)
    results = {}
    for name, spec in (("plain", None), ("ngram", ngram(4))):
        engine = LLMEngine(model, tokenizer, EngineArgs(num_gpu_blocks=64, max_model_len=256,
                                                        speculative_config=spec))
        results[name] = (run_to_completion(engine, {0: [("a", prompt, params)]})["a"], engine.stats)
    assert results["ngram"][0] == results["plain"][0]
    assert results["ngram"][1].num_accepted_tokens >= 8
    assert results["ngram"][1].num_steps < results["plain"][1].num_steps


def test_triton_backend_verifies_drafts_like_the_torch_backend():
    """Draft verification sends several query tokens per request with a context: the Triton kernel's causal offset
    handles them like any chunk."""
    prompts = [[5, 9, 17] * 4, [7] * 10]
    params = SamplingParams.greedy(max_tokens=6)
    torch_tokens, _ = _run(prompts, params, speculative_config=ngram(3), num_gpu_blocks=40, max_model_len=48)
    triton_tokens, engine = _run(prompts, params, speculative_config=ngram(3), num_gpu_blocks=40, max_model_len=48,
                                 attention_backend="triton")
    assert triton_tokens == torch_tokens
    assert engine.stats.num_accepted_tokens > 0
