"""OpenAI request body -> SamplingParams: max_completion_tokens vs max_tokens, the default, lowering, refusals.

The length rule is vLLM v0.33.0's: above max_model_len is a 400, above the room left is lowered to the room.
"""
import pytest

from minillm.entrypoints.openai.sampling import (ContextLengthExceededError, requested_max_tokens,
                                                 resolve_max_tokens, to_sampling_params)


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
def test_a_limit_larger_than_the_room_is_lowered_to_it_like_vllm(api, name):
    """vLLM v0.33.0 (``get_max_tokens``): a limit that fits max_model_len but not the room the prompt leaves is
    silently lowered to the room (older releases refused it with a 400)."""
    assert to_sampling_params({name: 1949}, prompt_len=100, max_model_len=2048, api=api).max_tokens == 1948
    assert resolve_max_tokens({name: 2048}, 100, 2048, api=api) == 1948  # max_model_len itself is allowed
    assert resolve_max_tokens({name: 2048}, 2047, 2048, api=api) == 1


@pytest.mark.parametrize("api,name", [("chat", "max_completion_tokens"), ("chat", "max_tokens"),
                                      ("completion", "max_tokens")])
def test_a_limit_larger_than_max_model_len_is_refused_like_vllm(api, name):
    """vLLM v0.33.0 (``TokenizeParams.__post_init__``): a limit above max_model_len itself is a 400, whatever the
    prompt, and the message names the field, both numbers and what to do."""
    with pytest.raises(ContextLengthExceededError) as e:
        to_sampling_params({name: 2049}, prompt_len=100, max_model_len=2048, api=api)
    assert e.value.param == name
    assert str(e.value) == (f"{name}=2049 cannot be greater than max_model_len=2048. "
                            f"Please request fewer output tokens.")
    assert isinstance(e.value, ValueError)  # callers that catch ValueError still see a refusal
    with pytest.raises(ContextLengthExceededError, match=f"{name}=5000 cannot be greater"):
        requested_max_tokens({name: 5000}, 2048, api=api)  # checked without the prompt, before tokenizing


def test_max_completion_tokens_is_the_one_checked_when_both_are_given():
    assert resolve_max_tokens({"max_completion_tokens": 10, "max_tokens": 5000}, 100, 2048) == 10
    with pytest.raises(ContextLengthExceededError) as e:
        resolve_max_tokens({"max_completion_tokens": 5000, "max_tokens": 10}, 100, 2048)
    assert e.value.param == "max_completion_tokens"


def test_completions_implicit_default_fits_the_room():
    """The Completions API's default of 16 is lowered to the room, like a 16 the client sent."""
    assert to_sampling_params({}, prompt_len=2040, max_model_len=2048, api="completion").max_tokens == 8
    assert to_sampling_params({"max_tokens": 16}, prompt_len=2040, max_model_len=2048, api="completion"
                              ).max_tokens == 8
    # vLLM's CompletionRequest.max_tokens field default is 16, checked like a sent value: above a tiny
    # max_model_len it is refused.
    with pytest.raises(ContextLengthExceededError, match="max_tokens=16 cannot be greater than max_model_len=8"):
        to_sampling_params({}, prompt_len=2, max_model_len=8, api="completion")
    assert to_sampling_params({"max_tokens": None}, 2, 8, api="completion").max_tokens == 6


def test_prompt_without_room_is_refused():
    with pytest.raises(ContextLengthExceededError, match="maximum context length is 2048 tokens") as e:
        to_sampling_params({}, prompt_len=2048, max_model_len=2048)
    assert "leaves no room" in str(e.value) and e.value.param is None
    with pytest.raises(ContextLengthExceededError) as e:  # vLLM's TokenizeParams._token_len_check wording
        to_sampling_params({"max_tokens": 5}, prompt_len=2100, max_model_len=2048)
    assert str(e.value) == ("This model's maximum context length is 2048 tokens. However, your prompt contains 2100 "
                            "input tokens, which exceeds this limit even without any output tokens. Please reduce "
                            "the length of the input prompt.")
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
