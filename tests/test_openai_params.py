"""OpenAI request body -> SamplingParams: max_completion_tokens vs max_tokens, the default, refusals."""
import pytest

from minillm.entrypoints.openai.sampling import resolve_max_tokens, to_sampling_params


def test_max_completion_tokens_wins_over_deprecated_max_tokens():
    body = {"messages": [], "max_completion_tokens": 50, "max_tokens": 10}
    assert to_sampling_params(body, prompt_len=20, max_model_len=2048).max_tokens == 50
    assert to_sampling_params({"max_tokens": 10}, 20, 2048).max_tokens == 10
    assert to_sampling_params({"max_completion_tokens": None, "max_tokens": 7}, 20, 2048).max_tokens == 7


def test_default_is_the_room_left_and_requests_are_capped():
    assert to_sampling_params({}, prompt_len=100, max_model_len=2048).max_tokens == 1948
    assert to_sampling_params({"max_completion_tokens": 5000}, 100, 2048).max_tokens == 1948
    assert resolve_max_tokens({}, 2047, 2048) == 1


def test_prompt_without_room_is_refused():
    with pytest.raises(ValueError, match="maximum context length is 2048"):
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
