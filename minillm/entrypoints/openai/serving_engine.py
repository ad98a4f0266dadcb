"""What the chat and completions endpoints share: parsing and checking a body, error answers, the length rule.

Every refusal is an :class:`OpenAIRequestError`, turned into OpenAI's error body by
:meth:`OpenAIServing.create_error_response` (400 unless said otherwise): not JSON (``invalid_json``), a wrong type
(``invalid_type``, ``param`` the field), a value out of range (``invalid_value``, the message
:class:`~minillm.sampling_params.SamplingParams`' own), a limit above ``max_model_len`` or a prompt that leaves no
room (``context_length_exceeded``), an unknown ``model`` (404, ``model_not_found``). All are checked here, so no
bad value reaches the shared engine loop.

vLLM counterpart: ``vllm/entrypoints/serve/engine/serving.py`` (``BaseServing``: ``_check_model``,
``create_error_response``) and ``vllm/entrypoints/serve/exception_handling/error_response.py``
(``create_error_response``); the length checks are ``TokenizeParams`` in ``vllm/renderers/params.py``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from minillm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, OpenAIBaseModel, UsageInfo
from minillm.entrypoints.openai.sampling import (
    ContextLengthExceededError,
    check_prompt_fits,
    requested_max_tokens,
    to_sampling_params,
)
from minillm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=OpenAIBaseModel)
R = TypeVar("R")

# SamplingParams' messages start with the field's name ("top_p must be in (0, 1], got 1.5"): that is the param.
_KNOWN_PARAMS = {"temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "max_completion_tokens",
                 "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "include_stop_str_in_output", "n",
                 "prompt", "messages", "priority"}


class OpenAIRequestError(Exception):
    """A request the server refuses, with everything OpenAI's error body needs."""

    def __init__(self, message: str, param: str | None = None, code: str | None = "invalid_value",
                 status_code: int = HTTPStatus.BAD_REQUEST, err_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status_code = int(status_code)
        self.err_type = err_type


def error_body(message: str, err_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as a plain dict."""
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code)).model_dump()


def parse_request(model_cls: type[T], raw: bytes) -> T:
    """Validate a raw JSON body against a request model; the first problem becomes an :class:`OpenAIRequestError`."""
    try:
        request = model_cls.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            raise OpenAIRequestError(f"The request body is not valid JSON: {errors[0]['msg']}",
                                     code="invalid_json") from e
        if not errors[0]["loc"]:
            raise OpenAIRequestError("The request body must be a JSON object", code="invalid_type") from e
        # A union field (``stop: str | list[str]``) fails once per branch; the deepest failure says the most
        # ("stop.0 should be a string" rather than "stop should be a string").
        err = max(errors, key=lambda x: len(x["loc"]))
        # Drop the branch labels pydantic puts in the location ("stop.list[str].0" -> "stop.0").
        path = ".".join(str(x) for x in err["loc"] if not any(c in str(x) for c in "[]|")
                        and x not in ("str", "int", "float", "bool"))
        param = str(err["loc"][0])
        if err["type"] == "missing":
            raise OpenAIRequestError(f"Missing required parameter: '{path}'", param=param,
                                     code="missing_required_parameter") from e
        given = err.get("input")
        shown = type(given).__name__ if isinstance(given, (dict, list)) else json.dumps(given)[:80]
        is_type = err["type"].endswith("_type") or err["type"] in ("union_tag_invalid", "literal_error")
        raise OpenAIRequestError(f"Invalid {'type' if is_type else 'value'} for '{path}': {err['msg'].lower()}, "
                                 f"got {shown}", param=param,
                                 code="invalid_type" if is_type else "invalid_value") from e
    if request.model_extra:
        logger.warning("ignoring unknown request fields: %s", summarize_names(request.model_extra))
    return request


def summarize_names(names: Any, max_names: int = 10, max_chars: int = 40) -> str:
    """A log-sized list of names: the first ``max_names`` (each cut to ``max_chars``) and how many more. A client
    can send 100k unknown fields; the log line must not grow with them."""
    names = sorted(names)
    shown = [n if len(n) <= max_chars else n[:max_chars] + "..." for n in names[:max_names]]
    more = f" and {len(names) - max_names} more" if len(names) > max_names else ""
    return f"{shown}{more}"


def param_of(message: str) -> str | None:
    """The request field a ValueError message is about (its first word), if it is one."""
    first = message.split(" ", 1)[0].strip(":,'\"")
    return first if first in _KNOWN_PARAMS else None


def reject_unsupported(request: OpenAIBaseModel, checks: dict[str, Any]) -> None:
    """Refuse OpenAI fields this server cannot honour, rather than silently ignoring them.

    ``checks`` maps a field name to the value that means "not used" (``None`` always means not used too).
    """
    for name, neutral in checks.items():
        value = getattr(request, name)
        if value is None or value == neutral:
            continue
        raise OpenAIRequestError(f"{name}={value!r} is not supported by minillm's server", param=name,
                                 code="unsupported_parameter")


def _abort_unfinished(engine_client: Any, collector: Any) -> None:
    if not collector.finished:
        engine_client.abort(collector.request_id)


def abort_when_dropped(stream: Any, engine_client: Any, collector: Any) -> Any:
    """Make sure a streamed request is aborted if its stream is dropped before it finishes.

    A stream that runs is covered by ``AsyncLLM.stream_outputs``' own ``finally``. But when a client hangs up
    between the moment its request was queued and the moment Starlette starts iterating the stream, the
    generator never starts, so no ``finally`` of it can run; this finalizer fires when the generator object is
    garbage-collected and aborts the request if it had not finished. Returns ``stream``.
    """
    weakref.finalize(stream, _abort_unfinished, engine_client, collector)
    return stream


class OpenAIServing:
    """Base of the chat and completions handlers: the engine client, the model's name and the shared checks.

    Args:
        engine_client: an :class:`~minillm.engine.async_llm.AsyncLLM`.
        served_model_name: the ``id`` in ``/v1/models`` and the ``model`` of every response.
    """

    def __init__(self, engine_client: Any, served_model_name: str,
                 tokenizer_executor: ThreadPoolExecutor | None = None) -> None:
        self.engine_client = engine_client
        self.served_model_name = served_model_name
        self.tokenizer = engine_client.tokenizer
        self.max_model_len: int = engine_client.max_model_len
        # One thread: a tokenizer is not safe to share between threads, and one request's tokens are made at a
        # time anyway. vLLM v0.33.0 tokenizes in its renderer's pool, ``BaseRenderer._executor`` in
        # ``vllm/renderers/base.py``, one thread by default (``renderer_num_workers``).
        self.tokenizer_executor = tokenizer_executor or ThreadPoolExecutor(1, thread_name_prefix="minillm-tokenizer")

    async def run_in_tokenizer_thread(self, fn: Callable[..., R], *args: Any) -> R:
        """Run ``fn(*args)`` (tokenization, chat-template rendering) off the event loop.

        A long prompt takes seconds to tokenize (the Rust tokenizer and the Jinja template hold the GIL only part
        of that time); on the event loop it would freeze every other client, ``/health`` and the running streams
        included.
        """
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_executor, fn, *args)

    @staticmethod
    def create_error_response(err: OpenAIRequestError) -> JSONResponse:
        return JSONResponse(error_body(err.message, err.err_type, err.param, err.code), status_code=err.status_code)

    def check_model(self, request: Any) -> None:
        if request.model is not None and request.model != self.served_model_name:
            raise OpenAIRequestError(f"The model `{request.model}` does not exist. This server serves "
                                     f"`{self.served_model_name}`.", param="model", code="model_not_found",
                                     status_code=HTTPStatus.NOT_FOUND)

    def check_output_limit(self, request: OpenAIBaseModel, api: str) -> None:
        """Refuse a ``max_tokens`` / ``max_completion_tokens`` above ``max_model_len`` before the prompt is
        tokenized (vLLM checks it when it builds ``TokenizeParams``, before rendering the prompt)."""
        try:
            requested_max_tokens(request.model_dump(exclude_unset=True), self.max_model_len, api)
        except ContextLengthExceededError as e:
            raise OpenAIRequestError(str(e), param=e.param, code="context_length_exceeded") from e
        except ValueError as e:
            raise OpenAIRequestError(str(e), param=param_of(str(e))) from e

    def check_prompt_len(self, prompt_len: int, param: str) -> None:
        if prompt_len == 0:
            raise OpenAIRequestError("The prompt is empty; give at least one token", param=param)
        try:
            check_prompt_fits(prompt_len, self.max_model_len)
        except ContextLengthExceededError as e:
            raise OpenAIRequestError(str(e), param=param, code="context_length_exceeded") from e

    def to_sampling_params(self, request: OpenAIBaseModel, prompt_len: int, api: str) -> SamplingParams:
        """The request's :class:`SamplingParams` (``max_tokens`` resolved); ValueErrors become 400s."""
        body = request.model_dump(exclude_unset=True)
        try:
            return to_sampling_params(body, prompt_len, self.max_model_len, api=api)
        except ContextLengthExceededError as e:
            raise OpenAIRequestError(str(e), param=e.param or param_of(str(e)),
                                     code="context_length_exceeded") from e
        except ValueError as e:
            raise OpenAIRequestError(str(e), param=param_of(str(e))) from e

    async def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                          priority: int, param: str) -> Any:
        """Hand the request to the engine; its refusals (e.g. a token id outside the vocabulary) become 400s."""
        try:
            return await self.engine_client.add_request(request_id, prompt_ids, params, priority=priority)
        except ValueError as e:
            raise OpenAIRequestError(str(e), param=param_of(str(e)) or param) from e

    async def final_output(self, collector: Any) -> Any:
        """Drain the request's outputs and return the final one; ``None`` if the request ended without it (aborted,
        e.g. by a server shutting down: then the last partial output is no answer either)."""
        final = None
        async for out in self.engine_client.stream_outputs(collector):
            final = out
        return final if final is not None and final.finished else None


def sse(data: str) -> str:
    """One server-sent event: ``data: <payload>`` and a blank line."""
    return f"data: {data}\n\n"


def usage_of(prompt_len: int, completion_len: int) -> UsageInfo:
    """OpenAI's ``usage`` counts for one answer."""
    return UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion_len,
                     total_tokens=prompt_len + completion_len)


def stream_aborted() -> str:
    """The SSE event that ends a stream whose request was aborted by the server (it is shutting down): the client
    sees an error, not a silently shorter answer. (A client that hung up itself reads nothing more.)"""
    return sse(json.dumps(error_body("The request was aborted before it finished: the server is shutting down",
                                     "server_error", code="request_aborted")))


def stream_error(e: Exception) -> str:
    """The SSE event that reports a failure after the 200 status line of a stream was already sent."""
    return sse(json.dumps(error_body(f"{type(e).__name__}: {e}", "internal_error", code="internal_error")))
