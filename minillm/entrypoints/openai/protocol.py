"""The JSON bodies of the OpenAI API, as pydantic models: what a client may send and what the server answers.

Requests are validated in pydantic's *strict* mode (``"temperature": "hot"`` or ``"max_tokens": 1.5`` are refused,
naming the field; an int is still a float); unknown fields are ignored with a warning, as OpenAI and vLLM do. Ranges
are checked afterwards by :class:`~minillm.sampling_params.SamplingParams`. Errors are OpenAI's error body, whose
``type`` and ``code`` follow OpenAI's API (vLLM answers ``type="BadRequestError"``, ``code=400``).

vLLM counterpart (same class names): ``vllm/entrypoints/openai/chat_completion/protocol.py``
(``ChatCompletionRequest``, ``ChatCompletionResponse``), ``vllm/entrypoints/openai/completion/protocol.py``
(``CompletionRequest``, ``CompletionResponse``) and ``vllm/entrypoints/serve/engine/protocol.py``
(``ErrorResponse``, ``ModelCard``, ``UsageInfo``).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def random_uuid() -> str:
    """32 hex characters; request ids are ``cmpl-<uuid>`` and ``chatcmpl-<uuid>`` like OpenAI's and vLLM's."""
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """Base of every request and response body: strict types, unknown fields kept aside (``model_extra``)."""

    model_config = ConfigDict(strict=True, extra="allow")


# ---------------------------------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    """``{"error": {...}}``: the body of every 4xx/5xx answer."""

    error: ErrorInfo


# ---------------------------------------------------------------------------------------------------- models
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minillm"
    max_model_len: int | None = None  # a vLLM extra: the longest prompt + completion this server accepts


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------------- shared
class UsageInfo(OpenAIBaseModel):
    """Token counts of one request: the prompt as the model saw it (chat template included) and the output."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False  # one more chunk before [DONE], with ``usage`` and no choices


class _SamplingFields(OpenAIBaseModel):
    """Fields both APIs share. Types only; ranges are SamplingParams' job."""

    model: str | None = None  # optional, as in vLLM: the one served model is used
    temperature: float | None = None  # OpenAI's default is 1; omitted means SamplingParams' default (1.0)
    top_p: float | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM extras (sampling knobs OpenAI does not have).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = 0  # lower runs first when the scheduler uses the "priority" policy


# ---------------------------------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: continue a text (or a list of token ids). ``max_tokens`` defaults to 16; any
    ``max_tokens`` is lowered to the room the prompt leaves, and one above ``max_model_len`` is a 400."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # a vLLM extra: the stop string or stop token id that ended the text


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    """One server-sent event of a streamed completion (``data: {...}``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------------- chat
class ChatCompletionContentPartText(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatCompletionMessageParam(OpenAIBaseModel):
    """One message of the conversation. ``content`` is a string or a list of text parts (no images here)."""

    role: str
    content: str | list[ChatCompletionContentPartText] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: answer a conversation rendered with the model's chat template.

    ``max_completion_tokens`` is the current OpenAI name of the output limit; ``max_tokens`` its deprecated alias.
    When both are given the former wins; when neither is, the answer may fill the context (``max_model_len``). A
    limit larger than ``max_model_len`` is refused (400); one larger than the room the prompt leaves is lowered to
    it. ``top_logprobs``: ``0..20``.
    """

    messages: list[ChatCompletionMessageParam] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True  # a vLLM extra: end the prompt with the assistant's header


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    """The new part of the answer in one chunk: the role in the first chunk, then pieces of content."""

    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One server-sent event of a streamed chat answer (``object: "chat.completion.chunk"``)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
