"""check_stop: vLLM's order (min_tokens, EOS, stop_token_ids, max_tokens / max_model_len) and the reason it records."""
import pytest

from minillm.core.sched.utils import check_stop
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams

EOS = 2


def req(outputs, prompt_len=3, eos=EOS, **params):
    r = Request("r", list(range(10, 10 + prompt_len)), SamplingParams(**params), eos_token_id=eos)
    r.append_output_token_ids(list(outputs))
    return r


def test_not_finished():
    r = req([5, 6], max_tokens=10)
    assert check_stop(r, max_model_len=100) is False
    assert r.status == RequestStatus.WAITING and r.stop_reason is None


def test_eos_stops_unless_ignored():
    r = req([5, EOS], max_tokens=10)
    assert check_stop(r, 100) and r.status == RequestStatus.FINISHED_STOPPED
    assert r.get_finished_reason() == "stop" and r.stop_reason is None
    r = req([5, EOS], max_tokens=10, ignore_eos=True)
    assert not check_stop(r, 100)
    r = req([5, EOS], eos=None, max_tokens=10)
    assert not check_stop(r, 100)


def test_stop_token_id_records_reason():
    r = req([5, 9], max_tokens=10, stop_token_ids=[9])
    assert check_stop(r, 100) and r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9


def test_min_tokens_holds_back_eos_and_stop_ids():
    assert not check_stop(req([EOS], max_tokens=10, min_tokens=2), 100)
    assert not check_stop(req([9], max_tokens=10, min_tokens=2, stop_token_ids=[9]), 100)
    assert check_stop(req([5, EOS], max_tokens=10, min_tokens=2), 100)


def test_max_tokens_and_max_model_len():
    r = req([5, 6, 7], max_tokens=3)
    assert check_stop(r, 100) and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.get_finished_reason() == "length"
    r = req([5, 6], prompt_len=3, max_tokens=None)
    assert check_stop(r, max_model_len=5) and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # The context limit ends a request even under min_tokens: it cannot grow past the model.
    r = req([5], prompt_len=4, max_tokens=None, min_tokens=10)
    assert check_stop(r, max_model_len=5) and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_eos_wins_over_length():
    # The last allowed token is EOS: vLLM reports "stop", not "length".
    r = req([5, EOS], max_tokens=2)
    assert check_stop(r, 100) and r.status == RequestStatus.FINISHED_STOPPED


def test_bad_calls():
    with pytest.raises(ValueError, match="no output token"):
        check_stop(req([]), 100)
    with pytest.raises(ValueError, match="max_model_len"):
        check_stop(req([1]), 0)
