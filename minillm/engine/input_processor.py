"""Requests in: check and tokenize a prompt and its sampling parameters into an :class:`EngineCoreRequest`.

Both front ends (``LLMEngine``, ``AsyncLLM``) run every check here, in the caller's process, before anything reaches
the engine core: a bad request raises a ``ValueError`` that names the value and the fix, and changes nothing.

vLLM counterpart: ``vllm/v1/engine/input_processor.py`` (``InputProcessor.process_inputs``; older releases:
``Processor`` in ``processor.py``).
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from minillm.config import LlamaConfig
from minillm.engine import EngineCoreRequest
from minillm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Text, token ids, or vLLM's TextPrompt / TokensPrompt dicts ({"prompt": ...} / {"prompt_token_ids": ...}).
PromptType = str | Sequence[int] | Mapping[str, object] | torch.Tensor


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages name the bad value without quoting a huge one."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class InputProcessor:
    """Checks and tokenizes requests for one engine.

    Args:
        tokenizer: a Hugging Face tokenizer, or ``None`` (then prompts must be token ids).
        model_config: the served model's configuration (its vocabulary bounds the token ids).
        max_model_len: the longest sequence; a prompt must leave room for one output token.
        eos_token_id: what the core's ``min_tokens`` guard and stop check treat as EOS.
        speculative: speculative decoding is on (which refuses ``logprobs``).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, model_config: LlamaConfig, max_model_len: int,
                 eos_token_id: int | None, speculative: bool = False) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.speculative = speculative

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams | dict[str, Any] | None,
                       priority: int = 0, arrival_time: float | None = None
                       ) -> tuple[EngineCoreRequest, str | None]:
        """The checked, tokenized request and the prompt's text (``None`` when given as token ids).

        Raises:
            ValueError: an empty prompt, a prompt that leaves no room for one output token within
                ``max_model_len``, token ids outside the vocabulary (or not a list of ints), invalid sampling
                parameters, a request id that is not a non-empty string, or a priority or arrival time of the wrong
                type.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {short_repr(request_id)}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {short_repr(priority)}")
        prompt_text, prompt_ids = self._tokenize(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, which leaves no room for an output token "
                             f"within max_model_len ({self.max_model_len}); shorten the prompt or raise "
                             f"max_model_len")
        checked = self._check_params(params, len(prompt_ids))
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))):
            raise ValueError(f"arrival_time must be a number of seconds, got {short_repr(arrival_time)}")
        request = EngineCoreRequest(request_id, prompt_ids, checked, self.eos_token_id,
                                    time.time() if arrival_time is None else float(arrival_time), priority)
        return request, prompt_text

    def _tokenize(self, prompt: object) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give the prompt as a list of token ids")
            if prompt == "":
                raise ValueError("the prompt is empty; give at least one token")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                return text if isinstance(text, str) else None, self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, (list, tuple)) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 1):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__} "
                         f"{short_repr(prompt)}")

    def _check_token_ids(self, given: object) -> list[int]:
        ids: list[object] | None
        if isinstance(given, torch.Tensor):
            ids = given.tolist() if given.dim() == 1 else None
        elif isinstance(given, (list, tuple)):
            ids = list(given)
        else:  # None, an int, a string, a dict...: list() of them raises TypeError or gives characters
            ids = None
        if ids is None:
            raise ValueError(f"prompt_token_ids must be a list of token ids, got {short_repr(given)}")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be integers in [0, {vocab}) (the vocabulary), got "
                             f"{short_repr(bad[:5])}")
        return [t for t in ids if isinstance(t, int)]  # every one of them, checked above

    def _check_params(self, params: SamplingParams | dict[str, Any] | None, prompt_len: int) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            try:
                params = SamplingParams(**params)
            except TypeError as e:
                raise ValueError(f"invalid sampling parameters: {e}") from None
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams (or a dict of its fields), got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        bad = [t for t in (params.stop_token_ids or []) if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad}")
        if self.speculative and params.logprobs is not None:
            raise ValueError(f"logprobs={params.logprobs} is not supported with speculative decoding in minillm; "
                             f"leave logprobs=None or create the engine without speculative_config")
        # A validated private copy: the caller may reuse (or mutate) its object for other requests.
        changes: dict[str, int] = {}
        room = self.max_model_len - prompt_len
        if params.max_tokens is None or params.max_tokens > room:
            # "until the context is full"; a larger max_tokens would stop there too ("length"), and must not
            # travel as an int msgpack cannot hold (the engine core may be in another process).
            changes["max_tokens"] = room
            changes["min_tokens"] = min(params.min_tokens, room)
        if params.top_k >= vocab:
            changes["top_k"] = 0  # "keep every token", as a k at least the vocabulary does
        return params.clone(**changes)
