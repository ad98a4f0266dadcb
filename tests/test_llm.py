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


@pytest.fixture(scope="module")
def llm(smollm):
    model, tok = smollm
    return LLM(model, tokenizer=tok, num_gpu_blocks=64, max_model_len=512, max_num_batched_tokens=256)


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
