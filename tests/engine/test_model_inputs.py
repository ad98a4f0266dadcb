"""The model refuses malformed inputs with a ValueError that names the problem, before any layer runs."""
from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import tiny_model

MODEL = tiny_model()


@pytest.mark.parametrize("input_ids, positions, match", [
    (torch.tensor([[1, 2, 3]]), None, "1-D"),
    (torch.tensor([1.0, 2.0]), None, "integer token ids"),
    (torch.tensor([True, False]), None, "integer token ids"),
    (torch.tensor([1, 2, 3]), torch.tensor([0, 1]), "positions must have the shape"),
    (torch.tensor([1, 2, 3]), torch.tensor([[0, 1, 2]]), "positions must have the shape"),
    (torch.tensor([1, 211]), None, r"token ids must be in \[0, 211\)"),
    (torch.tensor([-1, 2]), None, r"token ids must be in \[0, 211\)"),
])
def test_bad_inputs_are_refused(input_ids, positions, match):
    with pytest.raises(ValueError, match=match):
        MODEL(input_ids, positions)


def test_good_inputs_still_run():
    hidden = MODEL(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
    assert hidden.shape == (3, MODEL.config.hidden_size)
