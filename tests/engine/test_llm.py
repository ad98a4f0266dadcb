"""LLM (vLLM's offline API) and the interactive CLI chat, on SmolLM2."""
from __future__ import annotations

import argparse
import io

import pytest

import minillm
from minillm.entrypoints.llm import LLM
from minillm.sampling_params import SamplingParams
from tests.engine_helpers import single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module", params=["engine-core process", "in-process"])
def llm(smollm, request):
    """``LLM``'s default (the engine core in its own process; on a CPU synchronous, as vLLM v0.33.0 runs it there)
    and the in-process engine (``MINILLM_ENABLE_V1_MULTIPROCESSING=0``): every test below holds for both.
    (Async scheduling through the process: tests/engine/test_engine_core_process.py.)"""
    model, tok = smollm
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINILLM_ENABLE_V1_MULTIPROCESSING", "1" if request.param == "engine-core process" else "0")
        llm = LLM(model, tokenizer=tok, num_gpu_blocks=64, max_model_len=512, max_num_batched_tokens=256)
    assert llm.llm_engine.multiprocess_mode is (request.param == "engine-core process")
    yield llm
    llm.shutdown()


def _free(llm: LLM) -> bool:
    engine = llm.llm_engine
    return engine.get_num_free_blocks() == engine.num_gpu_blocks - 1 and not engine.has_unfinished_requests()


def test_generate_keeps_prompt_order_and_accepts_every_prompt_form(llm):
    tok = llm.get_tokenizer()
    chat_ids = minillm.chat_prompt_ids(tok, "What is the capital of France?")
    prompts = ["The three primary colours are", chat_ids, {"prompt_token_ids": chat_ids}, {"prompt": "Hello"}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["The three primary colours are", None, None, "Hello"]
    assert outs[1].prompt_token_ids == chat_ids
    assert outs[1].outputs[0].text == outs[2].outputs[0].text == "The capital of France is Paris."
    assert outs[0].prompt_token_ids == tok.encode("The three primary colours are")
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason in ("stop", "length")
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    assert _free(llm)


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(["Hello", "Hello"], [SamplingParams(temperature=0, max_tokens=2),
                                             SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    assert outs[1].outputs[0].token_ids[:2] == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="got 1 sampling_params for 2 prompts"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_a_bad_prompt_rejects_the_whole_batch(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["Hello", "", "World"], GREEDY, use_tqdm=False)
    assert _free(llm)
    with pytest.raises(ValueError, match="no prompts given"):
        llm.generate([], GREEDY, use_tqdm=False)


def test_chat_applies_the_template(llm):
    convo = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(convo, GREEDY, use_tqdm=False)
    assert len(out) == 1 and out[0].outputs[0].text == "The capital of France is Paris."
    both = llm.chat([convo, [{"role": "user", "content": "Say hello."}]], GREEDY, use_tqdm=False)
    assert both[0].outputs[0].text == out[0].outputs[0].text and len(both) == 2
    with pytest.raises(ValueError, match="non-empty conversation"):
        llm.chat([], GREEDY)


def test_progress_bar_counts_requests(llm, capsys):
    llm.generate(["One", "Two", "Three"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "tok/s" in err


def test_generate_stream_deltas_and_early_stop(llm):
    text, final = "", None
    for out in llm.generate_stream("Once upon a time", SamplingParams(temperature=0, max_tokens=10)):
        text += out.outputs[0].delta_text
        final = out
    assert final.finished and text == final.outputs[0].text and text
    stream = llm.generate_stream(["A long story:", "Another one:"], SamplingParams(temperature=0, max_tokens=50))
    next(stream)
    stream.close()  # the caller walks away: the rest is aborted and freed
    assert _free(llm)


def test_cli_chat_keeps_the_conversation(llm, monkeypatch):
    import minillm.cli as cli

    monkeypatch.setattr(cli, "_make_llm", lambda args: llm)
    args = argparse.Namespace(model=None, max_tokens=20, temperature=0.0, seed=0, max_model_len=512, system=None)
    stdin = io.StringIO("What is the capital of France?\n\n/reset\nAnd of Italy? Answer with the city.\n/exit\n")
    stdout = io.StringIO()
    assert cli.cmd_chat(args, stdin=stdin, stdout=stdout) == 0
    lines = stdout.getvalue().splitlines()
    assert lines[0] == "The capital of France is Paris."
    assert len(lines) == 2 and "Paris" not in lines[1]
    assert _free(llm)


# ---------------------------------------------------------------------------------------------------------------
# Interrupts and bad batches leave the engine clean (a tiny random model: these are about bookkeeping, not text).
TINY_ARGS = dict(tokenizer=None, num_gpu_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=32)
TINY_GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llms():
    """``(llm, reference)``: two engines on the same tiny random model; the reference has no prefix cache, so its
    answers cannot come from blocks an interrupted step left behind."""
    from tests.engine_helpers import tiny_model

    # In-process: the interrupts are planted in the scheduler, the runner and the output processor of this process
    # (tests/engine/test_engine_core_process.py interrupts an engine whose core has its own process).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINILLM_ENABLE_V1_MULTIPROCESSING", "0")
        return LLM(tiny_model(), **TINY_ARGS), LLM(tiny_model(), enable_prefix_caching=False, **TINY_ARGS)


def _tiny_prompts(salt: int) -> list[list[int]]:
    """8 prompts (10-17 tokens, several blocks each) that no other test uses, so nothing is cached for them."""
    return [[(7 * i + j * salt + 3 * salt) % 200 + 1 for j in range(10 + i)] for i in range(8)]


# Where a KeyboardInterrupt lands inside LLMEngine.step(): planning, the forward pass (where most time goes, so where
# a real Ctrl-C lands), the scheduler's update, detokenization; on the first step (mid-prefill) or a later one.
INTERRUPT_POINTS = [("scheduler", "schedule", 1), ("model_runner", "execute_model", 1),
                    ("model_runner", "execute_model", 4), ("scheduler", "update_from_output", 2),
                    ("output_processor", "process_outputs", 3)]


@pytest.mark.parametrize("component,method,nth", INTERRUPT_POINTS,
                         ids=[f"{c}.{m}#{n}" for c, m, n in INTERRUPT_POINTS])
def test_an_interrupted_generate_leaves_the_engine_usable(tiny_llms, monkeypatch, component, method, nth):
    """Ctrl-C during generate(): nothing stays in the engine, and the next generate() of the same prompts gives the
    right tokens (no orphan runs with it, and no prefix-cache block whose K/V was never written is reused)."""
    llm, reference = tiny_llms
    salt = INTERRUPT_POINTS.index((component, method, nth)) + 1
    prompts = _tiny_prompts(salt)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, TINY_GREEDY, use_tqdm=False)]
    engine = llm.llm_engine
    target = getattr(engine, component)
    original = getattr(target, method)
    calls = 0

    def interrupting(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == nth:
            raise KeyboardInterrupt  # what Ctrl-C raises in the main thread
        return original(*args, **kwargs)

    monkeypatch.setattr(target, method, interrupting)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, TINY_GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert engine.get_num_unfinished_requests() == 0 and _free(llm)
    assert not engine.output_processor.request_states and not engine.model_runner.requests
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, TINY_GREEDY, use_tqdm=False)]
    assert got == expected
    assert _free(llm)


def test_an_error_between_steps_aborts_the_batch(tiny_llms, monkeypatch):
    """An exception outside step() (here from the progress bar) aborts this batch's unfinished requests too."""
    llm, _ = tiny_llms
    import tqdm.auto

    class ExplodingBar:
        def __init__(self, *a, **k):
            pass

        def update(self, n):
            raise RuntimeError("the progress bar broke")

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", ExplodingBar)
    prompts = _tiny_prompts(11)
    params = [SamplingParams(temperature=0, max_tokens=1 + 5 * (i % 2), ignore_eos=True) for i in range(8)]
    with pytest.raises(RuntimeError, match="progress bar broke"):
        llm.generate(prompts, params, use_tqdm=True)
    assert _free(llm)


BAD_ELEMENTS = [
    {"prompt_token_ids": None}, {"prompt_token_ids": 5}, {"prompt_token_ids": "abc"}, {"prompt_token_ids": [1, "x"]},
    {"prompt_token_ids": [1, 10**9]}, {"prompt_token_ids": []}, {"prompt": None}, {"nothing": 1}, None, 3.5,
    object(), [[1, 2], [3]], [1.5, 2.0], "",
]


@pytest.mark.parametrize("bad", BAD_ELEMENTS, ids=[f"{i}-{type(b).__name__}" for i, b in enumerate(BAD_ELEMENTS)])
def test_a_bad_element_anywhere_in_a_batch_leaves_nothing_behind(tiny_llms, bad):
    """Every kind of bad element gives a ValueError naming it, before any request of the batch is added."""
    llm, reference = tiny_llms
    good = _tiny_prompts(12)[:2]
    with pytest.raises(ValueError, match="prompt 2 of 3"):
        llm.generate([*good, bad], TINY_GREEDY, use_tqdm=False)
    assert _free(llm) and not llm.llm_engine.output_processor.request_states
    outs = llm.generate(good, TINY_GREEDY, use_tqdm=False)  # only these two run, with the right tokens
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in reference.generate(good, TINY_GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("params,priority", [
    ([TINY_GREEDY, "greedy"], None), ([TINY_GREEDY, {"temperature": -1}], None), ([TINY_GREEDY, {"bogus": 1}], None),
    (TINY_GREEDY, [0, "high"]), (TINY_GREEDY, [0]), (TINY_GREEDY, 3), (42, None)])
def test_bad_params_or_priorities_leave_nothing_behind(tiny_llms, params, priority):
    llm, _ = tiny_llms
    with pytest.raises(ValueError):
        llm.generate(_tiny_prompts(13)[:2], params, use_tqdm=False, priority=priority)
    assert _free(llm) and not llm.llm_engine.output_processor.request_states
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(None, TINY_GREEDY, use_tqdm=False)
