"""OpenAI request body -> SamplingParams: max_completion_tokens vs max_tokens, the default, refusals."""
import pytest

from minillm.entrypoints.openai.sampling import (ContextLengthExceededError, resolve_max_tokens,
                                                 to_sampling_params)


def test_max_completion_tokens_wins_over_deprecated_max_tokens():
    body = {"messages": [], "max_completion_tokens": 50, "max_tokens": 10}
    assert to_sampling_params(body, prompt_len=20, max_model_len=2048).max_tokens == 50
    assert to_sampling_params({"max_tokens": 10}, 20, 2048).max_tokens == 10
    assert to_sampling_params({"max_completion_tokens": None, "max_tokens": 7}, 20, 2048).max_tokens == 7


def test_default_is_the_room_left():
    assert to_sampling_params({}, prompt_len=100, max_model_len=2048).max_tokens == 1948
    assert to_sampling_params({"max_tokens": None}, 100, 2048).max_tokens == 1948
    assert resolve_max_tokens({}, 2047, 2048) == 1
    # A limit that exactly fills the room is fine.
    assert to_sampling_params({"max_completion_tokens": 1948}, 100, 2048).max_tokens == 1948


@pytest.mark.parametrize("api,name", [("chat", "max_completion_tokens"), ("chat", "max_tokens"),
                                      ("completion", "max_tokens")])
def test_a_limit_larger_than_the_room_is_refused_like_vllm(api, name):
    """vLLM refuses (400) rather than lowering the limit, and says by how much it is over."""
    with pytest.raises(ContextLengthExceededError) as e:
        to_sampling_params({name: 5000}, prompt_len=100, max_model_len=2048, api=api)
    assert e.value.param == name
    msg = str(e.value)
    assert msg.startswith(f"{name} is too large: 5000.")
    assert "maximum context length is 2048 tokens" in msg and "100 input tokens" in msg
    assert "(5000 > 2048 - 100)" in msg
    assert isinstance(e.value, ValueError)  # callers that catch ValueError still see a refusal
    with pytest.raises(ContextLengthExceededError, match=r"\(1949 > 2048 - 100\)"):
        resolve_max_tokens({name: 1949}, 100, 2048, api=api)  # one over the room


def test_completions_implicit_default_fits_the_room():
    """The Completions API's default of 16 is not the client's request: it is lowered, not refused."""
    assert to_sampling_params({}, prompt_len=2040, max_model_len=2048, api="completion").max_tokens == 8
    with pytest.raises(ContextLengthExceededError, match="max_tokens is too large: 16"):
        to_sampling_params({"max_tokens": 16}, prompt_len=2040, max_model_len=2048, api="completion")


def test_prompt_without_room_is_refused():
    with pytest.raises(ContextLengthExceededError, match="maximum context length is 2048"):
        to_sampling_params({}, prompt_len=2048, max_model_len=2048)
    with pytest.raises(ValueError, match="prompt_len"):
        resolve_max_tokens({}, 0, 2048)


def test_completions_api():
    assert to_sampling_params({"prompt": "hi"}, 3, 2048, api="completion").max_tokens == 16
    assert to_sampling_params({"max_tokens": None}, 3, 2048, api="completion").max_tokens == 2045
    assert to_sampling_params({"logprobs": 2}, 3, 2048, api="completion").logprobs == 2
    with pytest.raises(ValueError, match="Chat Completions field"):
        to_sampling_params({"max_completion_tokens": 5}, 3, 2048, api="completion")
    with pytest.raises(ValueError, match="api"):
        resolve_max_tokens({}, 3, 2048, api="embeddings")


@pytest.mark.parametrize("value", [0, -1, 2.5, "10", True])
def test_bad_limits(value):
    with pytest.raises(ValueError, match="max_completion_tokens must be a positive integer"):
        to_sampling_params({"max_completion_tokens": value}, 3, 2048)


def test_other_fields():
    body = {"model": "x", "stream": True, "temperature": 0, "top_p": 0.5, "top_k": 4, "seed": 3, "stop": "\n",
            "presence_penalty": 0.1, "logprobs": True, "top_logprobs": 5, "min_tokens": 2, "ignore_eos": True}
    p = to_sampling_params(body, 10, 100)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.presence_penalty) == (0, 0.5, 4, 3, ["\n"], 0.1)
    assert (p.logprobs, p.min_tokens, p.ignore_eos, p.max_tokens) == (5, 2, True, 90)
    assert to_sampling_params({"logprobs": True}, 10, 100).logprobs == 0
    assert to_sampling_params({"logprobs": False}, 10, 100).logprobs is None
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        to_sampling_params({"top_logprobs": 2}, 10, 100)
    with pytest.raises(ValueError, match="n must be 1"):
        to_sampling_params({"n": 2}, 10, 100)
    with pytest.raises(ValueError, match="temperature"):
        to_sampling_params({"temperature": -1}, 10, 100)


@pytest.mark.parametrize("top", [-1, 21, 10**6, True, 2.0])
def test_top_logprobs_must_be_0_to_20(top):
    with pytest.raises(ValueError, match=r"top_logprobs must be an integer in \[0, 20\]"):
        to_sampling_params({"logprobs": True, "top_logprobs": top}, 10, 100)
    with pytest.raises(ValueError, match="top_logprobs"):  # out of range, even without logprobs=true
        to_sampling_params({"top_logprobs": top}, 10, 100)


def test_top_logprobs_bounds_are_accepted():
    assert to_sampling_params({"logprobs": True, "top_logprobs": 0}, 10, 100).logprobs == 0
    assert to_sampling_params({"logprobs": True, "top_logprobs": 20}, 10, 100).logprobs == 20


@pytest.mark.parametrize("body,fragment", [({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
                                           ({"logprobs": 21}, "max_logprobs"), ({"top_k": -5}, "top_k")])
def test_values_that_would_fail_inside_a_step_are_refused_here(body, fragment):
    with pytest.raises(ValueError, match=fragment):
        to_sampling_params(body, 3, 2048, api="completion")


def test_a_huge_top_k_is_accepted():
    assert to_sampling_params({"top_k": 2**70}, 3, 2048).top_k == 2**70
