"""A request's state inside the engine: its tokens, how many of them have K/V computed, and its status.

The one number that drives scheduling is :attr:`Request.num_computed_tokens`: every step the scheduler gives a
request ``num_tokens - num_computed_tokens`` more tokens (or fewer, if the budget is short). There is no separate
"prefill phase" or "decode phase"; a decode is simply a request that is one token behind.

vLLM counterpart: ``vllm/v1/request.py`` (``Request``, ``RequestStatus``).
"""
from __future__ import annotations

import enum
import operator
import time
from typing import Any


class RequestStatus(enum.IntEnum):
    """Where a request is. Every status after ``PREEMPTED`` is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # the client went away or abort_request() was called
    FINISHED_IGNORED = enum.auto()  # refused (e.g. the prompt can never fit)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        """The OpenAI ``finish_reason`` of a finished status: ``"stop"``, ``"length"`` or ``"abort"``."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


def _checked_token_ids(request_id: str, token_ids: Any) -> list[int]:
    """``token_ids`` as a new list of Python ints, or a ValueError that names the request and the bad value.

    A string is refused explicitly: it is a sequence, and ``list("abc")`` would quietly become three "tokens".
    """
    if not isinstance(token_ids, (list, tuple)):
        raise ValueError(f"request {request_id!r}: prompt_token_ids must be a list or tuple of token ids (ints >= 0), "
                         f"got {type(token_ids).__name__} {token_ids!r:.80}")
    if not token_ids:
        raise ValueError(f"request {request_id!r}: the prompt is empty; give at least one token")
    ids = []
    for i, t in enumerate(token_ids):
        try:
            # operator.index takes ints and NumPy/PyTorch integer scalars, and refuses floats and strings.
            v = None if isinstance(t, bool) else operator.index(t)
        except TypeError:
            v = None
        if v is None or v < 0:
            raise ValueError(f"request {request_id!r}: prompt_token_ids[{i}] must be an int >= 0, got {t!r}")
        ids.append(v)
    return ids


class Request:
    """One generation request as the scheduler sees it.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt, a non-empty list or tuple of token ids (ints >= 0; NumPy or PyTorch integer
            scalars are accepted and stored as ints).
        sampling_params: a :class:`~minillm.sampling_params.SamplingParams` (``max_tokens``, stop conditions, ...);
            duck-typed so chapters before the sampler can pass any object with ``max_tokens``.
        eos_token_id: the tokenizer's end-of-sequence id, or ``None``.
        arrival_time: seconds (default: now); breaks ties in priority order.
        priority: lower runs first under the ``"priority"`` policy.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any = None,
                 eos_token_id: int | None = None, arrival_time: float | None = None, priority: int = 0) -> None:
        self.request_id = request_id
        self.prompt_token_ids = _checked_token_ids(request_id, prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Prefix caching: hashes of this request's full blocks, filled in by the KV cache manager.
        self.block_hashes: list[Any] = []
        # Speculative decoding: draft tokens proposed after the last step, verified in the next one. They are not
        # part of all_token_ids until the model accepts them.
        self.spec_token_ids: list[int] = []
        # Async scheduling (AsyncScheduler): tokens that steps already scheduled will produce but that have not come
        # back yet. num_computed_tokens counts them, num_tokens does not (vLLM's num_output_placeholders).
        self.num_output_placeholders = 0
        # Tokens of the steps scheduled for it whose output has not come back yet (those of the step being updated
        # included), and how many of them are stale: the request was rolled back after they were scheduled
        # (preempted, or a KV load failed), so their output is dropped when it comes back (vLLM v0.33.0's
        # num_in_flight_tokens, num_stale_output_tokens). Both are 0 between the steps of a synchronous engine.
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        # Prompt tokens found computed at admission (prefix cache + KV connector), reported with every output; -1
        # until admitted (vLLM's Request.num_cached_tokens).
        self.num_cached_tokens = -1

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs (read-only view by convention; use :meth:`append_output_token_ids`)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """``num_tokens`` plus the draft tokens waiting to be verified."""
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return getattr(self.sampling_params, "max_tokens", None)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        """Priority order: lower ``priority`` first, then earlier arrival, then id (a total order for heaps)."""
        return (self.priority, self.arrival_time, self.request_id) < (other.priority, other.arrival_time,
                                                                       other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
