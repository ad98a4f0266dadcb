"""An OpenAI-style request body -> :class:`SamplingParams`, including the ``max_completion_tokens`` rule.

``max_completion_tokens`` is the newer OpenAI name for "the most tokens the model may generate for this answer"
in the Chat Completions API; ``max_tokens`` is its deprecated alias there (still the only name in the legacy
Completions API). Only generated tokens count toward it, never the prompt (for reasoning models, reasoning tokens
count too). When neither is given, the answer may fill the rest of the context: ``max_model_len - prompt_len``.
A limit larger than that room is **refused** (HTTP 400), as vLLM's server does, rather than quietly lowered: the
client asked for something the model cannot give, and should hear so. A prompt that leaves no room is refused too.
The Completions API's implicit default of 16 is the one exception: a client that sent no ``max_tokens`` gets
``min(16, room)`` (vLLM refuses that case as well, with an error about a value the client never sent).

Chat's ``top_logprobs`` must be in ``[0, 20]`` (OpenAI's range; vLLM's default ``max_logprobs`` is 20 as well).

vLLM counterpart: ``ChatCompletionRequest.to_sampling_params`` / ``CompletionRequest.to_sampling_params`` in the
OpenAI protocol module, ``get_max_tokens`` in ``vllm/entrypoints/utils.py``, and the too-large check in
``OpenAIServing._validate_input`` (``vllm/entrypoints/openai/serving_engine.py``).
"""
from __future__ import annotations

from typing import Any, Mapping

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
    """The prompt plus the requested output do not fit in ``max_model_len`` (OpenAI's ``context_length_exceeded``).

    Attributes:
        param: the request field to blame (``"max_completion_tokens"``, ``"max_tokens"``), or ``None`` when the
            prompt alone is too long.
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


def resolve_max_tokens(body: Mapping[str, Any], prompt_len: int, max_model_len: int, api: str = "chat") -> int:
    """How many tokens this request may generate.

    Chat: ``max_completion_tokens`` if given, else ``max_tokens``, else the room left, ``max_model_len -
    prompt_len``. Completions: ``max_tokens`` if given, else ``min(16, room)``. A given limit must fit in the room.

    Raises:
        ContextLengthExceededError: the prompt leaves no room, or a given limit is larger than the room (vLLM's
            "'max_tokens' or 'max_completion_tokens' is too large" 400).
        ValueError: a limit is not a positive integer, or ``max_completion_tokens`` is sent to the Completions API.
    """
    if api not in ("chat", "completion"):
        raise ValueError(f"api must be 'chat' or 'completion', got {api!r}")
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be at least 1, got {prompt_len}")
    room = max_model_len - prompt_len
    if room < 1:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens, and the prompt has {prompt_len} "
            f"tokens, which leaves no room for a completion. Shorten the prompt.")
    if api == "chat":
        if body.get("max_completion_tokens") is not None:
            requested, name = body["max_completion_tokens"], "max_completion_tokens"
        else:
            requested, name = body.get("max_tokens"), "max_tokens"
    else:
        if body.get("max_completion_tokens") is not None:
            raise ValueError("max_completion_tokens is a Chat Completions field; the Completions API uses max_tokens")
        if "max_tokens" not in body:  # the API's default, not the client's choice: fit it to the room
            return min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        requested, name = body["max_tokens"], "max_tokens"
    if requested is None:
        return room
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise ValueError(f"{name} must be a positive integer, got {requested!r}")
    if requested > room:
        raise ContextLengthExceededError(
            f"{name} is too large: {requested}. This model's maximum context length is {max_model_len} tokens and "
            f"the request has {prompt_len} input tokens, so at most {room} tokens can be generated "
            f"({requested} > {max_model_len} - {prompt_len}).", param=name)
    return requested


def to_sampling_params(body: Mapping[str, Any], prompt_len: int, max_model_len: int, api: str = "chat"
                       ) -> SamplingParams:
    """Build :class:`SamplingParams` from an OpenAI Chat Completions (``api="chat"``) or Completions body.

    Besides the length rule (:func:`resolve_max_tokens`): ``logprobs`` is a bool plus ``top_logprobs`` in chat
    and an int in completions; ``top_logprobs`` must be in ``[0, 20]``; ``n`` must be 1 (one answer per request
    here). Other fields (``model``, ``messages``, ``stream``, ...) are ignored. Invalid values raise
    :class:`ValueError` (from SamplingParams for its own fields); a limit that does not fit raises
    :class:`ContextLengthExceededError`.
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
