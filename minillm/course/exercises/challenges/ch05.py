"""Challenge 5's reference: ``allowed_token_ids`` and ``logit_bias`` on a batch of logits, one setting per request.

vLLM v0.33.0 applies both in the V1 sampler, before the penalties and temperature:
``vllm/v1/sample/sampler.py:Sampler.apply_logits_processors`` first fills ``allowed_token_ids_mask`` with ``-inf``
(the mask is True on every token a request does *not* allow: ``vllm/v1/worker/gpu_input_batch.py:
InputBatch.add_request`` sets the request's row to True, then False at its allowed ids), then runs the logits
processors that can change the argmax, among them
``vllm/v1/sample/logits_processor/builtin.py:LogitBiasLogitsProcessor.apply`` (``logits[reqs, token_ids] +=
biases``). The biases were clamped to [-100, 100] when the request's ``SamplingParams`` were made
(``vllm/sampling_params.py:SamplingParams.from_optional``), and ``SamplingParams._validate_allowed_token_ids`` and
``_validate_logit_bias`` refuse an empty allowed list and token ids outside the vocabulary.

minillm's sampler has neither setting; the course's challenge 5 asks for this function, and its check compares the
learner's with :func:`apply_allowed_and_bias`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

BIAS_LIMIT = 100.0  # vLLM clamps every bias to [-BIAS_LIMIT, BIAS_LIMIT]

# What a delegating answer could call (the tripwire replaces it while the learner's answer runs).
TARGETS = ("minillm.course.exercises.challenges.ch05:apply_allowed_and_bias",)


def _check_ids(ids: Iterable[int], vocab_size: int, row: int, name: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"request {row}: {name} holds token id(s) {bad} outside the vocabulary [0, {vocab_size})")


def apply_allowed_and_bias(logits: torch.Tensor, allowed_token_ids: Sequence[Sequence[int] | None],
                           logit_bias: Sequence[dict[int, float] | None]) -> torch.Tensor:
    """A copy of ``logits`` (``[num_reqs, vocab_size]``) with each request's settings applied to its own row.

    Args:
        logits: the model's scores, one row per request.
        allowed_token_ids: per request, ``None`` (every token allowed) or the token ids it may produce: every other
            token's logit becomes ``-inf``.
        logit_bias: per request, ``None`` or ``{token_id: bias}``: the bias, clamped to [-100, 100], is added to
            that token's logit (a disallowed token stays ``-inf``).

    Raises:
        ValueError: an empty allowed list, a token id outside ``[0, vocab_size)``, or lists whose length is not
            ``num_reqs``. ``logits`` itself is never changed.
    """
    num_reqs, vocab_size = logits.shape
    if len(allowed_token_ids) != num_reqs or len(logit_bias) != num_reqs:
        raise ValueError(f"one setting per request: {num_reqs} rows, {len(allowed_token_ids)} allowed lists, "
                         f"{len(logit_bias)} bias dicts")
    out = logits.clone()
    for r in range(num_reqs):
        allowed = allowed_token_ids[r]
        if allowed is not None:
            if len(allowed) == 0:
                raise ValueError(f"request {r}: allowed_token_ids is empty (use None to allow every token)")
            _check_ids(allowed, vocab_size, r, "allowed_token_ids")
            disallowed = torch.ones(vocab_size, dtype=torch.bool, device=logits.device)
            disallowed[list(allowed)] = False
            out[r, disallowed] = float("-inf")
        bias = logit_bias[r]
        if bias:
            _check_ids(bias, vocab_size, r, "logit_bias")
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            values = torch.tensor([min(BIAS_LIMIT, max(-BIAS_LIMIT, float(b))) for b in bias.values()],
                                  dtype=logits.dtype, device=logits.device)
            out[r, ids] += values
    return out
