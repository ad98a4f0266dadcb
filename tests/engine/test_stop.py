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


# ---------------------------------------------------------------- stop strings on the detokenized text
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minillm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings  # noqa: E402


class PieceTokenizer:
    """A toy tokenizer whose tokens are fixed strings, so stop strings can be placed across token borders."""

    def __init__(self, pieces):
        self.pieces = list(pieces)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and self.pieces[i] == "<eos>"))


PIECES = ["Hel", "lo", " wor", "ld", "\n", "\nQ", "uestion", ":", " ok", "<eos>", "##", "#", "a"]


def run(token_ids, **params):
    det = IncrementalDetokenizer(PieceTokenizer(PIECES), SamplingParams(**params))
    for i, t in enumerate(token_ids):
        reason = det.update([t])
        if reason is not None:
            return det.output_text, reason, i
    return det.output_text, None, None


def test_stop_string_spanning_tokens_is_trimmed():
    # "\n\nQuestion:" is spread over the tokens "\n", "\nQ", "uestion", ":".
    text, reason, step = run([0, 1, 4, 5, 6, 7, 8], stop=["\n\nQuestion:"])
    assert (text, reason, step) == ("Hello", "\n\nQuestion:", 5)
    text, reason, _ = run([0, 1, 4, 5, 6, 7, 8], stop=["\n\nQuestion:"], include_stop_str_in_output=True)
    assert text == "Hello\n\nQuestion:"
    # A stop string in the middle of one token: the rest of the token is cut too.
    text, reason, step = run([0, 1, 2, 3], stop=["o w"])
    assert (text, reason, step) == ("Hell", "o w", 2)
    # The earliest match wins when two stop strings end in the same step.
    text, reason, _ = run([0, 1, 2, 3], stop=["world", "lo wor"])
    assert (text, reason) == ("Hel", "lo wor")
    assert run([0, 1], stop=["xyz"]) == ("Hello", None, None)


def test_stop_terminated_token_left_out_of_text():
    det = IncrementalDetokenizer(PieceTokenizer(PIECES), SamplingParams(stop_token_ids=[12]))
    det.update([0, 1])
    det.update([12], stop_terminated=True)  # check_stop finished on stop id 12 ("a"): its text is not shown
    assert det.output_text == "Hello"
    det = IncrementalDetokenizer(PieceTokenizer(PIECES), SamplingParams(stop=["zz"]))
    det.update([0, 9])  # EOS is a special token: skipped when decoding
    assert det.output_text == "Hel"


def test_no_more_tokens_after_stop_string():
    det = IncrementalDetokenizer(PieceTokenizer(PIECES), SamplingParams(stop=["lo"]))
    assert det.update([0, 1]) == "lo" and det.output_text == "Hel" and det.stop_reason == "lo"
    with pytest.raises(ValueError, match="already stopped"):
        det.update([2])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=12),
       st.lists(st.sampled_from(["#", "##", "###", "lo w", "\n\n", "ld\n", "a#a", "Q"]), min_size=1, max_size=3))
def test_incremental_equals_search_on_the_whole_text(ids, stop):
    """Checking a few new characters per step finds the same first stop as searching the final text."""
    text, reason, _ = run(ids, stop=stop)
    full = PieceTokenizer(PIECES).decode(ids)
    firsts = [(full.find(s) + len(s), full.find(s), i, s) for i, s in enumerate(stop) if s in full]
    if not firsts:
        assert reason is None and text == full
        return
    # The stop is found on the step where the first stop string to *end* appears; among those, earliest start.
    end = min(f[0] for f in firsts)
    # Which ids produce text of length >= end first: that step's check sees every string ending by then.
    prefix_len = next(k for k in range(1, len(ids) + 1) if len(PieceTokenizer(PIECES).decode(ids[:k])) >= end)
    seen = PieceTokenizer(PIECES).decode(ids[:prefix_len])
    cands = [(seen.find(s), i, s) for i, s in enumerate(stop) if s in seen]
    start, _, s = min(cands)
    assert reason == s and text == seen[:start]


def test_check_stop_strings_direct():
    assert check_stop_strings("abcXYZ", 3, ["XYZ"], False) == ("XYZ", 3)
    assert check_stop_strings("abcXYZ", 3, ["XYZ"], True) == ("XYZ", 6)
    assert check_stop_strings("abcXYZ", 1, ["cX"], False) is None  # ended before the new characters: seen before
    assert check_stop_strings("abcXYZ", 2, ["XY"], False) == ("XY", 3)
    with pytest.raises(ValueError, match="new_char_count"):
        check_stop_strings("ab", 3, ["a"], False)


@pytest.mark.slow
def test_stop_string_with_the_real_tokenizer(tokenizer):
    """With SmolLM2's tokenizer: "\\n\\nQuestion" is several tokens; the text stops right before it."""
    text = "The answer is: Paris.\n\nQuestion: next"
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["\n\nQuestion"]))
    steps = 0
    for t in ids:
        steps += 1
        if det.update([t]) is not None:
            break
    assert det.stop_reason == "\n\nQuestion" and det.output_text == "The answer is: Paris."
    assert steps == len(tokenizer.encode("The answer is: Paris.\n\nQuestion"))  # found on the token completing it
    assert len(tokenizer.encode("\n\nQuestion")) > 1  # the stop string spans more than one token
