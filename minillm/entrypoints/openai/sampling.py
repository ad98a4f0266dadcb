"""An OpenAI-style request body -> :class:`SamplingParams`, including the ``max_completion_tokens`` rule.

``max_completion_tokens`` is the newer OpenAI name for "the most tokens the model may generate for this answer"
in the Chat Completions API; ``max_tokens`` is its deprecated alias there (still the only name in the legacy
Completions API). Only generated tokens count toward it, never the prompt (for reasoning models, reasoning tokens
count too). When neither is given, the answer may fill the rest of the context: ``max_model_len - prompt_len``.
A larger request is capped to that room; a prompt that leaves no room is refused.

vLLM counterpart: ``ChatCompletionRequest.to_sampling_params`` / ``CompletionRequest.to_sampling_params`` in the
OpenAI protocol module, and ``get_max_tokens`` in ``vllm/entrypoints/utils.py``.
"""
from __future__ import annotations

from typing import Any, Mapping

from minillm.sampling_params import SamplingParams

# Fields copied unchanged (vLLM accepts these extra fields next to the OpenAI ones).
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "include_stop_str_in_output")
# Completions API default for max_tokens (OpenAI's and vLLM's CompletionRequest).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def resolve_max_tokens(body: Mapping[str, Any], prompt_len: int, max_model_len: int, api: str = "chat") -> int:
    """How many tokens this request may generate.

    Chat: ``max_completion_tokens`` if given, else ``max_tokens``, else the room left; Completions: ``max_tokens``
    (default 16). Then capped to the room left, ``max_model_len - prompt_len``.

    Raises:
        ValueError: the prompt leaves no room, or a limit is not a positive integer.
    """
    if api not in ("chat", "completion"):
        raise ValueError(f"api must be 'chat' or 'completion', got {api!r}")
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be at least 1, got {prompt_len}")
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens, and the prompt has "
                         f"{prompt_len} tokens, which leaves no room for a completion. Shorten the prompt.")
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
        return room
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise ValueError(f"{name} must be a positive integer, got {requested!r}")
    return min(requested, room)


def to_sampling_params(body: Mapping[str, Any], prompt_len: int, max_model_len: int, api: str = "chat"
                       ) -> SamplingParams:
    """Build :class:`SamplingParams` from an OpenAI Chat Completions (``api="chat"``) or Completions body.

    Besides the length rule (:func:`resolve_max_tokens`): ``logprobs`` is a bool plus ``top_logprobs`` in chat
    and an int in completions; ``n`` must be 1 (one answer per request here). Other fields (``model``,
    ``messages``, ``stream``, ...) are ignored. Invalid values raise :class:`ValueError` from SamplingParams.
    """
    n = body.get("n", 1)
    if n not in (1, None):
        raise ValueError(f"n must be 1 (minillm returns one completion per request), got {n!r}")
    kwargs = {k: body[k] for k in _PASSTHROUGH if body.get(k) is not None}
    if api == "chat":
        top = body.get("top_logprobs")
        if body.get("logprobs"):
            kwargs["logprobs"] = 0 if top is None else top
        elif top is not None:
            raise ValueError("top_logprobs needs logprobs=true")
    elif body.get("logprobs") is not None:
        kwargs["logprobs"] = body["logprobs"]
    kwargs["max_tokens"] = resolve_max_tokens(body, prompt_len, max_model_len, api)
    return SamplingParams(**kwargs)
