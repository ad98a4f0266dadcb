"""An OpenAI-style request body -> :class:`SamplingParams`, including the ``max_completion_tokens`` rule.

``max_completion_tokens`` (chat; ``max_tokens`` its deprecated alias, and the Completions API's only name, default 16)
counts generated tokens only. As vLLM v0.33.0's server applies it: a limit above ``max_model_len`` is **refused**
(400); one that fits ``max_model_len`` but not the room the prompt leaves is **lowered** to that room (the answer
ends with ``finish_reason="length"``); no limit means the room; a prompt that leaves no room is refused. Chat's
``top_logprobs`` must be in ``[0, 20]``. (Older vLLM refused the lowered case too.)

vLLM counterpart: ``ChatCompletionRequest.to_sampling_params`` in
``vllm/entrypoints/openai/chat_completion/protocol.py``; the 400s are ``TokenizeParams`` in
``vllm/renderers/params.py``; the lowering is ``get_max_tokens`` in ``vllm/entrypoints/serve/utils/api_utils.py``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minillm.sampling_params import MAX_LOGPROBS, SamplingParams

# Fields copied unchanged (vLLM accepts these extra fields next to the OpenAI ones).
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "include_stop_str_in_output")
# Completions API default for max_tokens (OpenAI's and vLLM's CompletionRequest).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI's bound on chat ``top_logprobs`` (0..20); the same number as SamplingParams' MAX_LOGPROBS.
MAX_TOP_LOGPROBS = MAX_LOGPROBS


class ContextLengthExceededError(ValueError):
    """The request cannot fit in ``max_model_len`` (OpenAI's ``context_length_exceeded``): a limit above
    ``max_model_len`` itself, or a prompt that leaves no room for a single output token.

    Attributes:
        param: the request field to blame (``"max_completion_tokens"``, ``"max_tokens"``), or ``None`` when the
            prompt is too long.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_top_logprobs(value: Any) -> None:
    """Raise a :class:`ValueError` unless ``value`` is ``None`` or an integer in ``[0, MAX_TOP_LOGPROBS]``."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")


def requested_max_tokens(body: Mapping[str, Any], max_model_len: int, api: str = "chat") -> tuple[int | None, str]:
    """The output limit the request asks for and the field it came from, before the prompt is known.

    Chat: ``max_completion_tokens`` if given, else ``max_tokens``; Completions: ``max_tokens``, 16 when the body
    does not have the field. ``None`` means no limit. This is the check vLLM makes before it renders the prompt
    (``TokenizeParams.__post_init__``): a limit above ``max_model_len`` can never be served, whatever the prompt.

    Raises:
        ContextLengthExceededError: the limit is larger than ``max_model_len``.
        ValueError: a limit is not a positive integer, or ``max_completion_tokens`` is sent to the Completions API.
    """
    if api not in ("chat", "completion"):
        raise ValueError(f"api must be 'chat' or 'completion', got {api!r}")
    if api == "chat":
        if body.get("max_completion_tokens") is not None:
            requested, name = body["max_completion_tokens"], "max_completion_tokens"
        else:
            requested, name = body.get("max_tokens"), "max_tokens"
    else:
        if body.get("max_completion_tokens") is not None:
            raise ValueError("max_completion_tokens is a Chat Completions field; the Completions API uses max_tokens")
        requested, name = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS), "max_tokens"
    if requested is None:
        return None, name
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise ValueError(f"{name} must be a positive integer, got {requested!r}")
    if requested > max_model_len:
        raise ContextLengthExceededError(
            f"{name}={requested} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens.", param=name)
    return requested, name


def check_prompt_fits(prompt_len: int, max_model_len: int) -> None:
    """Refuse a prompt that leaves no room for one output token.

    Longer than ``max_model_len``: vLLM's ``TokenizeParams._token_len_check`` message. Exactly ``max_model_len``:
    vLLM refuses it as well, because the room, 0, becomes ``max_tokens=0`` (``SamplingParams``: "max_tokens must be
    at least 1"); the message here says why.

    Raises:
        ContextLengthExceededError: the prompt has ``max_model_len`` tokens or more.
        ValueError: ``prompt_len`` is below 1.
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be at least 1, got {prompt_len}")
    if prompt_len > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{prompt_len} input tokens, which exceeds this limit even without any output tokens. Please reduce the "
            f"length of the input prompt.")
    if prompt_len == max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{prompt_len} input tokens, which leaves no room for an output token. Please reduce the length of the "
            f"input prompt.")


def resolve_max_tokens(body: Mapping[str, Any], prompt_len: int, max_model_len: int, api: str = "chat") -> int:
    """How many tokens this request may generate: the requested limit (:func:`requested_max_tokens`), lowered to
    the room the prompt leaves, ``max_model_len - prompt_len``; the room itself when no limit is given.

    vLLM's ``get_max_tokens`` (``min`` of the room and the limit); the lowering is silent: the answer ends with
    ``finish_reason="length"``.

    Raises:
        ContextLengthExceededError: the limit is larger than ``max_model_len``, or the prompt leaves no room
            (:func:`check_prompt_fits`).
        ValueError: a limit is not a positive integer, or ``max_completion_tokens`` is sent to the Completions API.
    """
    requested, _ = requested_max_tokens(body, max_model_len, api)
    check_prompt_fits(prompt_len, max_model_len)
    room = max_model_len - prompt_len
    return room if requested is None else min(requested, room)


def to_sampling_params(body: Mapping[str, Any], prompt_len: int, max_model_len: int, api: str = "chat"
                       ) -> SamplingParams:
    """Build :class:`SamplingParams` from an OpenAI Chat Completions (``api="chat"``) or Completions body.

    Besides the length rule (:func:`resolve_max_tokens`): ``logprobs`` is a bool plus ``top_logprobs`` in chat
    and an int in completions; ``top_logprobs`` must be in ``[0, 20]``; ``n`` must be 1 (one answer per request
    here). Other fields (``model``, ``messages``, ``stream``, ...) are ignored. Invalid values raise
    :class:`ValueError` (from SamplingParams for its own fields); a limit above ``max_model_len``, or a prompt that
    leaves no room, raises :class:`ContextLengthExceededError`.
    """
    n = body.get("n", 1)
    if n not in (1, None):
        raise ValueError(f"n must be 1 (minillm returns one completion per request), got {n!r}")
    kwargs = {k: body[k] for k in _PASSTHROUGH if body.get(k) is not None}
    if api == "chat":
        top = body.get("top_logprobs")
        check_top_logprobs(top)
        if body.get("logprobs"):
            kwargs["logprobs"] = 0 if top is None else top
        elif top is not None:
            raise ValueError("top_logprobs needs logprobs=true")
    elif body.get("logprobs") is not None:
        kwargs["logprobs"] = body["logprobs"]
    kwargs["max_tokens"] = resolve_max_tokens(body, prompt_len, max_model_len, api)
    return SamplingParams(**kwargs)
