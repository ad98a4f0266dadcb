"""Request: what a prompt may be, and the token counts the scheduler reads."""
import numpy as np
import pytest
import torch

from minillm.request import Request, RequestStatus


def test_prompt_ids_are_stored_as_a_new_list_of_ints():
    src = (3, np.int64(4), torch.tensor(5))
    req = Request("r", src)
    assert req.prompt_token_ids == [3, 4, 5] and all(type(t) is int for t in req.prompt_token_ids)
    assert req.all_token_ids == [3, 4, 5] and req.all_token_ids is not req.prompt_token_ids
    ids = [0, 1]
    req = Request("s", ids)
    ids.append(9)  # the caller's list is not the request's
    assert req.prompt_token_ids == [0, 1] and req.status == RequestStatus.WAITING


@pytest.mark.parametrize("bad, match", [
    ("abc", r"must be a list or tuple of token ids.*got str 'abc'"),
    (b"ab", r"must be a list or tuple.*got bytes"),
    (None, r"must be a list or tuple.*got NoneType"),
    (7, r"must be a list or tuple.*got int"),
    (torch.tensor([1, 2]), r"must be a list or tuple.*got Tensor"),
    ([], r"the prompt is empty"),
    ([1, "2"], r"prompt_token_ids\[1\] must be an int >= 0, got '2'"),
    ([1, 2.0], r"prompt_token_ids\[1\] must be an int >= 0, got 2.0"),
    ([True], r"prompt_token_ids\[0\] must be an int >= 0, got True"),
    ([5, -1], r"prompt_token_ids\[1\] must be an int >= 0, got -1"),
    ([None], r"prompt_token_ids\[0\] must be an int >= 0, got None"),
    ([torch.tensor(1.5)], r"prompt_token_ids\[0\] must be an int >= 0"),
], ids=["str", "bytes", "None", "int", "tensor", "empty", "str-id", "float-id", "bool-id", "negative", "None-id",
        "float-tensor-id"])
def test_bad_prompts_are_refused_with_the_request_id(bad, match):
    with pytest.raises(ValueError, match=match) as info:
        Request("req-7", bad)
    assert "'req-7'" in str(info.value)


def test_token_counts_with_outputs_and_draft_tokens():
    req = Request("r", [1, 2, 3])
    req.append_output_token_ids(4)
    req.append_output_token_ids([5, 6])
    assert (req.num_prompt_tokens, req.num_output_tokens, req.num_tokens) == (3, 3, 6)
    req.spec_token_ids = [7, 8]
    assert req.num_tokens_with_spec == 8 and req.num_tokens == 6  # drafts are not tokens until accepted
