"""When does a request stop? The check the scheduler runs after every token it appends.

:func:`check_stop` looks only at token ids; stop *strings* need the detokenized text and are checked by the
detokenizer (:mod:`minillm.engine.detokenizer`) after this.

vLLM counterpart: ``vllm/v1/core/sched/utils.py`` (``check_stop``), called from ``Scheduler.update_from_output``.
"""
from __future__ import annotations

from minillm.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether ``request`` is finished after its newest output token; if so, record why.

    Checked on ``request.output_token_ids[-1]``, in the order of older vLLM releases (the ``min_tokens`` guard first):

    1. fewer than ``min_tokens`` outputs: never stop on EOS / stop ids (the sampler also masks those logits);
    2. the EOS token (``request.eos_token_id``), unless ``ignore_eos``: ``FINISHED_STOPPED``;
    3. a token in ``stop_token_ids``: ``FINISHED_STOPPED`` with ``request.stop_reason`` = that id;
    4. ``num_output_tokens >= max_tokens`` or ``num_tokens >= max_model_len``: ``FINISHED_LENGTH_CAPPED``.

    vLLM v0.33.0 (``vllm/v1/core/sched/utils.py:check_stop``) checks 2, 3 and 4 first and the ``min_tokens`` guard
    after them, where it only holds off its repetition detection. The outcome is the same: during ``min_tokens`` the
    sampler masks EOS and the stop ids (EOS even with ``ignore_eos``), and ``max_tokens >= min_tokens`` is validated.
    ``max_model_len`` ends a request even before ``min_tokens`` here too: a request can never grow past what the
    model can attend to.

    Args:
        request: a :class:`~minillm.request.Request` with at least one output token. Its ``sampling_params`` is a
            :class:`~minillm.sampling_params.SamplingParams`; a missing field takes the SamplingParams default.
        max_model_len: the model's context length (prompt + output tokens).

    Returns:
        ``True`` when the request is finished (``request.status`` then says how), else ``False``.
    """
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
    if not request.output_token_ids:
        raise ValueError(f"request {request.request_id!r} has no output token to check yet")
    params = request.sampling_params
    min_tokens = getattr(params, "min_tokens", 0) or 0
    ignore_eos = getattr(params, "ignore_eos", False)
    stop_token_ids = getattr(params, "stop_token_ids", None) or ()
    max_tokens = request.max_tokens

    reached_context = request.num_tokens >= max_model_len
    if request.num_output_tokens < min_tokens:
        if reached_context:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    last = request.output_token_ids[-1]
    if not ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if reached_context or (max_tokens is not None and request.num_output_tokens >= max_tokens):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
