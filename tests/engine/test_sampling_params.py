"""SamplingParams: vLLM names and defaults, normalisation, and a clear ValueError for every bad value."""
import math

import pytest

from minillm.sample.metadata import make_generator
from minillm.sampling_params import MAX_LOGPROBS, MAX_SEED, MIN_SEED, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, 0, 1.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == ([], [], False)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.sampling_type == SamplingType.RANDOM and not p.has_penalties


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(5, 7), top_k=-1)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 7] and p.top_k == 0
    assert p.all_stop_token_ids == {5, 7}
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams.greedy().sampling_type == SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(max_tokens=None).max_tokens is None
    q = p.clone(temperature=0.5)
    assert q.temperature == 0.5 and q.stop == ["###"] and p.temperature == 1.0


# (field, bad value, a fragment the message must contain)
BAD = [
    ("temperature", -0.1, "temperature"), ("temperature", math.inf, "temperature"),
    ("temperature", math.nan, "NaN"), ("temperature", "1", "temperature"),
    ("top_k", -2, "top_k"), ("top_k", 2.5, "top_k"), ("top_k", True, "top_k"),
    ("top_p", 0.0, "top_p"), ("top_p", 1.01, "top_p"), ("top_p", -1, "top_p"),
    ("min_p", -0.01, "min_p"), ("min_p", 1.5, "min_p"),
    ("seed", 1.5, "seed"),
    # torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; past either end it fails inside a step.
    ("seed", 2**70, r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\].*got 1180591620717411303424"),
    ("seed", 2**64, "got 18446744073709551616"), ("seed", -(2**63) - 1, "seed"),
    ("max_tokens", 0, "max_tokens"), ("max_tokens", -3, "max_tokens"), ("max_tokens", 2.0, "max_tokens"),
    ("min_tokens", -1, "min_tokens"),
    ("stop", [""], "empty"), ("stop", ["ok", 3], "stop"),
    ("stop", 5, "stop must be a string or a list of strings, got 5"), ("stop", {"a": 1}, "stop"),
    ("stop_token_ids", [-1], "stop_token_ids"), ("stop_token_ids", ["a"], "stop_token_ids"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of non-negative integers, got 5"),
    ("stop_token_ids", "12", "stop_token_ids must be a list"), ("stop_token_ids", [1.0], "stop_token_ids"),
    ("ignore_eos", 1, "ignore_eos"),
    ("logprobs", -1, "logprobs"),
    ("logprobs", MAX_LOGPROBS + 1, r"logprobs must be in \[0, 20\] \(vLLM's max_logprobs\).*got 21"),
    ("logprobs", 10**6, "max_logprobs"), ("logprobs", 2.0, "logprobs"),
    ("presence_penalty", 2.5, "presence_penalty"), ("presence_penalty", -2.01, "presence_penalty"),
    ("frequency_penalty", 3, "frequency_penalty"), ("frequency_penalty", -3, "frequency_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"), ("repetition_penalty", -1.0, "repetition_penalty"),
    ("repetition_penalty", math.inf, "repetition_penalty"),
    ("include_stop_str_in_output", "yes", "include_stop_str_in_output"),
]


@pytest.mark.parametrize("name,value,fragment", BAD)
def test_every_invalid_value_raises_a_clear_error(name, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**{name: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100


def test_numpy_scalars_are_accepted():
    np = pytest.importorskip("numpy")
    p = SamplingParams(top_k=np.int64(5), temperature=np.float32(0.5), max_tokens=np.int32(8))
    assert p.top_k == 5 and p.max_tokens == 8


def test_boundaries_are_accepted():
    edges = dict(temperature=0.0, top_p=1.0, min_p=1.0, top_k=1, presence_penalty=-2.0, frequency_penalty=2.0,
                 logprobs=0, max_tokens=1, repetition_penalty=1e-3)
    p = SamplingParams(**edges)
    assert {k: getattr(p, k) for k in edges} == edges  # accepted as given, not clamped


def test_the_edges_that_are_accepted_work_downstream():
    """Every accepted seed seeds a generator; a huge top_k is accepted (vLLM takes any k >= 1)."""
    assert (MIN_SEED, MAX_SEED, MAX_LOGPROBS) == (-(2**63), 2**64 - 1, 20)
    for seed in (MIN_SEED, -1, 0, 2**63, MAX_SEED):
        p = SamplingParams(seed=seed)
        assert p.sampling_type == SamplingType.RANDOM_SEED
        make_generator(p.seed)  # must not raise
    assert SamplingParams(logprobs=MAX_LOGPROBS).logprobs == 20
    assert SamplingParams(top_k=2**70).top_k == 2**70
    assert SamplingParams(stop=("a", "b"), stop_token_ids=[]).stop == ["a", "b"]
    # The clone of a valid object is valid (clone re-validates every field).
    assert SamplingParams(seed=MAX_SEED, top_k=2**70).clone(temperature=0.5).seed == MAX_SEED
