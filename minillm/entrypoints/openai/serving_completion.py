"""``POST /v1/completions``: continue a text, all at once or streamed as server-sent events.

The flow of one request: check the body (a ``max_tokens`` above ``max_model_len`` is a 400) -> tokenize the
prompt -> check it leaves room -> build ``SamplingParams`` (``max_tokens`` defaults to 16 in this API, and is lowered
to the room the prompt leaves when it is larger) -> hand it to the engine loop -> either wait for the
final output (one JSON answer) or turn each step's ``delta_text`` into a chunk (``data: {...}``), ending with
``data: [DONE]``.

vLLM counterpart: ``vllm/entrypoints/openai/completion/serving.py`` (``OpenAIServingCompletion.create_completion``,
``completion_stream_generator``, ``request_output_to_completion_response``); the request and response bodies are in
``vllm/entrypoints/openai/completion/protocol.py``.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, cast

from minillm.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    random_uuid,
)
from minillm.entrypoints.openai.serving_engine import (
    OpenAIRequestError,
    OpenAIServing,
    abort_when_dropped,
    reject_unsupported,
    sse,
    stream_aborted,
    stream_error,
    usage_of,
)


class OpenAIServingCompletion(OpenAIServing):
    """Handles the Completions API for one served model."""

    def prompt_token_ids(self, request: CompletionRequest) -> list[int]:
        """The prompt as token ids. One prompt per request: a list of one string or one id list is unwrapped."""
        given = request.prompt
        prompt: str | list[int]
        if isinstance(given, list) and given and not isinstance(given[0], int):
            if len(given) != 1:
                raise OpenAIRequestError(f"minillm's server takes one prompt per request, got {len(given)}",
                                         param="prompt")
            prompt = given[0]
        else:
            prompt = cast("str | list[int]", given)  # a list here is empty or of ints
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise OpenAIRequestError("This server's model has no tokenizer: send the prompt as token ids",
                                         param="prompt")
            # Tokenized as LLMEngine.add_request would (special tokens such as a BOS added if the tokenizer does),
            # here so that the length can be checked and max_tokens resolved before the engine sees it.
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str] | None:
        """Validate, submit, and answer: the whole response, or (``stream``) an async iterator of SSE events.

        ``None`` means the request ended without an answer (it was aborted). Refusals raise
        :class:`~minillm.entrypoints.openai.serving_engine.OpenAIRequestError`.
        """
        self.check_model(request)
        reject_unsupported(request, {"echo": False, "best_of": 1, "suffix": "", "logit_bias": {},
                                     "logprobs": None})
        self.check_output_limit(request, api="completion")
        ids = await self.run_in_tokenizer_thread(self.prompt_token_ids, request)
        self.check_prompt_len(len(ids), "prompt")
        params = self.to_sampling_params(request, len(ids), api="completion")
        request_id = f"cmpl-{random_uuid()}"
        collector = await self.add_request(request_id, ids, params, request.priority or 0, "prompt")
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            stream = self.completion_stream_generator(collector, len(ids), include_usage)
            return abort_when_dropped(stream, self.engine_client, collector)
        return await self.completion_full_generator(collector, len(ids))

    async def completion_full_generator(self, collector: Any, prompt_len: int) -> CompletionResponse | None:
        """Wait for the final output; ``None`` if the request ended without one (aborted)."""
        final = await self.final_output(collector)
        if final is None:
            return None
        o = final.outputs[0]
        return CompletionResponse(
            id=collector.request_id, model=self.served_model_name,
            choices=[CompletionResponseChoice(index=0, text=o.text, finish_reason=o.finish_reason,
                                              stop_reason=o.stop_reason)],
            usage=usage_of(prompt_len, len(o.token_ids)))

    async def completion_stream_generator(self, collector: Any, prompt_len: int,
                                          include_usage: bool) -> AsyncIterator[str]:
        """One chunk per step that produced text; the last carries ``finish_reason``; then ``[DONE]``.

        If the client goes away, Starlette cancels this generator at its ``await``; ``stream_outputs`` then aborts
        the request, which frees its KV blocks.
        """
        created = int(time.time())
        num_tokens = 0
        finished = False
        try:
            async for out in self.engine_client.stream_outputs(collector):
                o = out.outputs[0]
                num_tokens = len(o.token_ids)
                finished = out.finished
                if not o.delta_text and not out.finished:
                    continue  # e.g. a token that ends mid-character, or a held-back partial stop string
                chunk = CompletionStreamResponse(
                    id=collector.request_id, created=created, model=self.served_model_name,
                    choices=[CompletionResponseStreamChoice(
                        index=0, text=o.delta_text, finish_reason=o.finish_reason if out.finished else None,
                        stop_reason=o.stop_reason if out.finished else None)])
                yield sse(chunk.model_dump_json())
            if not finished:
                yield stream_aborted()
            elif include_usage:
                chunk = CompletionStreamResponse(id=collector.request_id, created=created,
                                                 model=self.served_model_name, choices=[],
                                                 usage=usage_of(prompt_len, num_tokens))
                yield sse(chunk.model_dump_json())
        except Exception as e:  # noqa: BLE001 - the status line is sent already; report inside the stream
            yield stream_error(e)
        yield sse("[DONE]")

