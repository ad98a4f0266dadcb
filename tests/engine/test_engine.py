"""LLMEngine: continuous batching is invisible in the tokens, streaming adds up, aborts free blocks, bad input is refused.

The property tests use a tiny random Llama (fast, large logit gaps) against a reference that recomputes the whole
sequence without any cache; the behaviour tests use SmolLM2 and its tokenizer.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams
from tests.engine_helpers import TINY, check_greedy_match, greedy_reference, single_thread, tiny_model  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

_TINY_MODEL = tiny_model()
_REFERENCE: dict[tuple[tuple[int, ...], int], tuple[list[int], list[torch.Tensor]]] = {}
MAX_TOKENS = 6


def _reference(prompt: list[int], max_tokens: int = MAX_TOKENS):
    """The tiny model's no-cache greedy tokens and logits for ``prompt`` (cached: hypothesis repeats prompts)."""
    key = (tuple(prompt), max_tokens)
    if key not in _REFERENCE:
        _REFERENCE[key] = greedy_reference(_TINY_MODEL, prompt, max_tokens)
    return _REFERENCE[key]


def run_to_completion(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]
                      ) -> dict[str, list[int]]:
    """Add requests at the step given as key (continuous batching), step until done; return the token ids."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while arrivals or engine.has_unfinished_requests():
        for rid, prompt, params in arrivals.pop(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 2000, "the engine does not make progress"
    return tokens


def assert_all_blocks_free(engine: LLMEngine) -> None:
    assert engine.get_num_free_blocks() == engine.num_gpu_blocks - 1  # the null block is never handed out
    assert engine.kv_cache_manager.usage == 0.0
    assert not engine.kv_cache_manager.req_to_blocks
    assert not engine.model_runner.requests


def serve_and_check_greedy(engine: LLMEngine, prompts: list[list[int]], arrive: list[int],
                           max_tokens: int = MAX_TOKENS) -> None:
    """Request ``i`` arrives at step ``arrive[i]`` and decodes ``max_tokens`` greedy tokens of the tiny model; each
    must match the no-cache reference (up to a near tie), and every KV block must come back."""
    arrivals: dict[int, list] = {}
    for i, (p, a) in enumerate(zip(prompts, arrive)):
        arrivals.setdefault(a, []).append((f"r{i}", p, SamplingParams.greedy(max_tokens=max_tokens)))
    tokens = run_to_completion(engine, arrivals)
    for i, p in enumerate(prompts):
        ref, logits = _reference(p, max_tokens)
        check_greedy_match(tokens[f"r{i}"], ref, logits, what=f"request {i} (prompt length {len(p)})")
    assert_all_blocks_free(engine)


# -- continuous batching, chunking, prefix caching, preemption: none of it changes a greedy token -------------------
@settings(max_examples=25)
@given(data=st.data(), block_size=st.sampled_from([1, 4, 16]), threshold=st.sampled_from([0, 1, 7]),
       budget=st.sampled_from([8, 40, 256]), max_num_seqs=st.sampled_from([1, 3, 8]),
       prefix_caching=st.booleans(), tight_cache=st.booleans())
def test_engine_greedy_equals_no_cache_reference(data, block_size, threshold, budget, max_num_seqs, prefix_caching,
                                                 tight_cache):
    max_model_len = 48
    common = data.draw(st.lists(st.integers(0, TINY.vocab_size - 1), min_size=0, max_size=20))
    num = data.draw(st.integers(1, 6))
    prompts = [common + data.draw(st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=20))
               for _ in range(num)]
    arrive = data.draw(st.lists(st.integers(0, 6), min_size=num, max_size=num))
    # Tight: room for one request of max_model_len and not much more, so running requests get preempted.
    blocks = -(-max_model_len // block_size) + 1 + (1 if tight_cache else 200)
    args = EngineArgs(block_size=block_size, num_gpu_blocks=blocks, max_num_batched_tokens=max(budget, max_num_seqs),
                      max_num_seqs=max_num_seqs, max_model_len=max_model_len, long_prefill_token_threshold=threshold,
                      enable_prefix_caching=prefix_caching)
    serve_and_check_greedy(LLMEngine(_TINY_MODEL, None, args), prompts, arrive)


def test_tight_cache_really_preempts_and_prefix_cache_really_hits():
    """The two knobs the property test turns do what they claim on a fixed workload."""
    # a and c take 5 + 5 of the 12 usable blocks; growing to 26 tokens each they need 14: one is preempted.
    # b shares a's first 5 blocks (20 tokens) and arrives later: a prefix-cache hit.
    prompts = [list(range(1, 21)), list(range(1, 21)) + [40, 41], list(range(50, 70))]
    args = EngineArgs(block_size=4, num_gpu_blocks=13, max_num_batched_tokens=64, max_model_len=48,
                      enable_prefix_caching=True)
    engine = LLMEngine(_TINY_MODEL, None, args)
    arrivals = {0: [("a", prompts[0], SamplingParams.greedy(max_tokens=MAX_TOKENS)),
                    ("c", prompts[2], SamplingParams.greedy(max_tokens=MAX_TOKENS))],
                2: [("b", prompts[1], SamplingParams.greedy(max_tokens=MAX_TOKENS))]}
    tokens = run_to_completion(engine, arrivals)
    assert engine.stats.num_preemptions > 0
    assert engine.stats.num_cached_prompt_tokens > 0
    for rid, p in zip("abc", prompts):
        ref, logits = _reference(p)
        check_greedy_match(tokens[rid], ref, logits, what=rid)
    assert_all_blocks_free(engine)


def test_triton_backend_equals_torch_backend_on_the_tiny_model():
    prompts = [list(range(3, 20)), list(range(7, 12))]
    results = []
    for backend in ("torch", "triton"):
        engine = LLMEngine(_TINY_MODEL, None, EngineArgs(block_size=4, num_gpu_blocks=40, max_model_len=48,
                                                         long_prefill_token_threshold=7, attention_backend=backend))
        results.append(run_to_completion(engine, {0: [(str(i), p, SamplingParams.greedy(max_tokens=3))
                                                       for i, p in enumerate(prompts)]}))
    assert results[0] == results[1]
    for i, p in enumerate(prompts):
        ref, logits = _reference(p)
        check_greedy_match(results[1][str(i)], ref[:3], logits[:3], what=f"triton {i}")


def test_seeded_sampling_ignores_batching_chunking_and_preemption():
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=8)
    prompts = [list(range(1, 30)), list(range(30, 60)), list(range(60, 70))]
    outs = []
    for blocks, threshold in ((200, 0), (14, 5)):
        engine = LLMEngine(_TINY_MODEL, None, EngineArgs(block_size=4, num_gpu_blocks=blocks, max_model_len=48,
                                                         long_prefill_token_threshold=threshold))
        outs.append(run_to_completion(engine, {0: [(str(i), p, params) for i, p in enumerate(prompts)]}))
        if blocks == 14:
            assert engine.stats.num_preemptions > 0
    assert outs[0] == outs[1]
    assert len(set(map(tuple, outs[0].values()))) == 3


def test_every_scheduled_request_gets_a_sampled_row_and_mid_prefill_rows_are_dropped():
    """The engine's SamplerOutput.sampled_token_ids is int32 [num_reqs, 1], a row per scheduled request in the
    runner's order, mid-prefill ones included (vLLM v0.33.0: logits at logits_indices for every request, then
    discard_request_mask); the dropped rows reach neither the request nor the step's outputs."""
    engine = LLMEngine(_TINY_MODEL, None, EngineArgs(block_size=4, num_gpu_blocks=64, max_model_len=48,
                                                     long_prefill_token_threshold=5, max_num_batched_tokens=12))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    engine.add_request("A", list(range(1, 13)), params)
    engine.add_request("B", list(range(20, 23)), params)
    num_discarded = 0
    while engine.has_unfinished_requests():
        before = {rid: r.num_output_tokens for rid, r in engine.scheduler.requests.items()}
        outs = {o.request_id: o for o in engine.step()}
        x, out = engine.model_runner.last_inputs, engine.model_runner.last_sampler_output
        assert out.sampled_token_ids.shape == (len(x.req_ids), 1) and out.sampled_token_ids.dtype == torch.int32
        for i, rid in enumerate(x.req_ids):
            if x.discard_request_mask[i]:
                num_discarded += 1
                assert rid not in outs and engine.scheduler.requests[rid].num_output_tokens == before[rid] == 0
            else:
                assert outs[rid].outputs[0].token_ids[-1] == int(out.sampled_token_ids[i, 0])
    assert num_discarded == 2  # A's first two 5-token chunks
    assert_all_blocks_free(engine)


def test_priority_policy_runs_the_urgent_request_first():
    engine = LLMEngine(_TINY_MODEL, None, EngineArgs(num_gpu_blocks=40, max_model_len=48, max_num_seqs=1,
                                                     scheduling_policy="priority"))
    engine.add_request("late", [1, 2, 3], SamplingParams.greedy(max_tokens=2), priority=5)
    engine.add_request("urgent", [4, 5, 6], SamplingParams.greedy(max_tokens=2), priority=-1)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["urgent", "late"]


# -- SmolLM2: text, streaming, stops, aborts, errors ---------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(smollm):
    model, tok = smollm
    return LLMEngine(model, tok, EngineArgs(num_gpu_blocks=48, max_model_len=256, max_num_batched_tokens=128))


def test_streamed_deltas_add_up_to_the_final_text(engine):
    tok = engine.tokenizer
    from minillm import chat_prompt_ids

    requests = {
        "paris": (chat_prompt_ids(tok, "What is the capital of France?"), SamplingParams.greedy(max_tokens=24)),
        "stop-str": (chat_prompt_ids(tok, "What is the capital of France?"),
                     SamplingParams.greedy(max_tokens=24, stop=["of France is"])),
        "kettle": ("Once upon a time, a kettle", SamplingParams.greedy(max_tokens=12)),
    }
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    text = {rid: "" for rid in requests}
    ids = {rid: [] for rid in requests}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            text[out.request_id] += c.delta_text
            ids[out.request_id] += c.delta_token_ids
            assert c.text == text[out.request_id] and c.token_ids == ids[out.request_id]
            if out.finished:
                final[out.request_id] = c
    assert final["paris"].text == "The capital of France is Paris."
    assert final["paris"].finish_reason == "stop" and final["paris"].stop_reason is None  # EOS
    assert final["paris"].token_ids[-1] == tok.eos_token_id
    assert final["stop-str"].text == "The capital "  # cut just before the stop string
    assert (final["stop-str"].finish_reason, final["stop-str"].stop_reason) == ("stop", "of France is")
    assert final["kettle"].finish_reason == "length" and len(final["kettle"].token_ids) == 12
    assert final["kettle"].text == tok.decode(final["kettle"].token_ids, skip_special_tokens=True)
    assert_all_blocks_free(engine)


def test_stop_token_ids_and_prefix_cache_hits(engine):
    from minillm import chat_prompt_ids

    prompt = chat_prompt_ids(engine.tokenizer, "Name three colours of the rainbow, please.")
    first = None
    for rid in ("one", "two"):
        engine.add_request(rid, prompt, SamplingParams.greedy(max_tokens=4))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    first = first or out.outputs[0].token_ids
                    last = out
    assert last.num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0  # full blocks, last token recomputed
    assert last.outputs[0].token_ids == first
    stop_id = first[1]
    engine.add_request("three", prompt, SamplingParams.greedy(max_tokens=4, stop_token_ids=[stop_id]))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    c = outs[-1].outputs[0]
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", stop_id, first[:2])


def test_abort_frees_every_block(engine):
    for i in range(5):
        engine.add_request(f"a{i}", "Tell me a long story about a dragon " * (i + 1), SamplingParams.greedy(max_tokens=50))
    seen = set()
    for _ in range(3):
        seen |= {o.request_id for o in engine.step()}
    assert engine.get_num_free_blocks() < engine.num_gpu_blocks - 1
    engine.abort_request(["a0", "a4"])  # a running one and (likely) a waiting one
    engine.abort_request("no-such-request")  # ignored
    assert engine.get_num_unfinished_requests() == 3
    for _ in range(2):
        assert {o.request_id for o in engine.step()} <= {"a1", "a2", "a3"}
    engine.abort_request([f"a{i}" for i in range(5)])
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert_all_blocks_free(engine)
    engine.add_request("a0", "Hello", SamplingParams.greedy(max_tokens=1))  # the id can be reused
    assert engine.step()[0].finished
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("prompt, params, match", [
    ("", None, "prompt is empty"),
    ([], None, "prompt is empty"),
    ([1, 2, 49152], None, r"token ids must be integers in \[0, 49152\)"),
    ([1, -1], None, r"token ids must be integers in \[0, 49152\)"),
    ([1, 2.5], None, "token ids must be integers"),
    ([5] * 256, None, r"256 tokens, which leaves no room .* max_model_len \(256\)"),
    ([5] * 300, None, r"300 tokens, which leaves no room"),
    ("hi", {"temperature": -1.0}, "temperature must be >= 0"),
    ("hi", {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ("hi", {"max_tokens": 0}, "max_tokens must be at least 1"),
    ("hi", {"temperatur": 0.5}, "invalid sampling parameters"),
    ("hi", "greedy", "params must be a SamplingParams"),
    ("hi", SamplingParams(stop_token_ids=[10 ** 6]), r"stop_token_ids must be in \[0, 49152\)"),
    (3.14, None, "a prompt must be a string, a list of token ids or a dict"),
])
def test_bad_requests_are_refused_at_the_door(engine, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()
    assert "bad" not in engine.output_processor.request_states


def test_bad_request_ids_are_refused(engine):
    with pytest.raises(ValueError, match="request_id must be a non-empty string"):
        engine.add_request(7, "hi")
    engine.add_request("dup", "hi", SamplingParams.greedy(max_tokens=1))
    with pytest.raises(ValueError, match="'dup' is already in use"):
        engine.add_request("dup", "hello")
    engine.abort_request("dup")
    assert_all_blocks_free(engine)


def test_logprobs_of_the_sampled_tokens(engine):
    engine.add_request("lp", "The capital of France is", SamplingParams.greedy(max_tokens=3, logprobs=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    c = outs[-1].outputs[0]
    assert len(c.logprobs) == 3
    for token, entry in zip(c.token_ids, c.logprobs):
        assert token in entry and len(entry) <= 3 and entry[token] == max(entry.values()) <= 0.0  # greedy: the top
    assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs)))


def test_max_tokens_none_fills_the_context(engine):
    engine.add_request("fill", [5] * 250, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs[-1].outputs[0].token_ids) == 6 and outs[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_gpu_blocks=2, max_model_len=256), r"KV cache holds 1 usable blocks .* fewer than max_model_len"),
    (dict(max_model_len=10 ** 6), r"larger than the model's max_position_embeddings \(8192\)"),
    (dict(block_size=0), "block_size must be a positive integer"),
    (dict(num_gpu_blocks=1), "num_gpu_blocks must be an integer >= 2"),
    (dict(kv_cache_memory_fraction=1.5), r"kv_cache_memory_fraction must be in \(0, 1\]"),
    (dict(attention_backend="flash"), "attention_backend must be one of"),
    (dict(scheduling_policy="lifo"), "scheduling_policy must be one of"),
    (dict(max_num_batched_tokens=8, max_num_seqs=16), r"max_num_batched_tokens \(8\) must be >= max_num_seqs"),
    (dict(dtype="float8"), "dtype must be 'auto' or one of"),
])
def test_bad_engine_arguments_are_refused(smollm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(smollm[0], smollm[1], EngineArgs(**kwargs))


def test_kv_cache_size_from_memory_settings():
    args = EngineArgs(kv_cache_memory_bytes=64 * 1024 ** 2, block_size=16)
    per_block = 16 * TINY.kv_cache_bytes_per_token(4)
    assert args.resolved_num_gpu_blocks(TINY, 48) == 64 * 1024 ** 2 // per_block
    assert EngineArgs().resolved_num_gpu_blocks(TINY, 48) == 512 * 1024 ** 2 // per_block
    assert EngineArgs(kv_cache_memory_fraction=0.01).resolved_num_gpu_blocks(TINY, 48) > 2
    with pytest.raises(ValueError, match="unknown engine argument"):
        EngineArgs.from_kwargs(gpu_blocks=3)
