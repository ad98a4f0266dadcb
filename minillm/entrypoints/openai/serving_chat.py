"""``POST /v1/chat/completions``: answer a conversation, all at once or streamed as server-sent events.

The messages are rendered with the model's chat template (ending with the assistant's header) and the token ids go
to the engine, with the output limit of :mod:`minillm.entrypoints.openai.sampling`. A stream is a first chunk with
``delta = {"role": "assistant", "content": ""}``, one chunk per step that produced text, a last chunk with
``finish_reason``, optionally a usage chunk (``stream_options.include_usage``), then ``data: [DONE]``.

vLLM counterpart: ``vllm/entrypoints/openai/chat_completion/serving.py`` (``OpenAIServingChat.create_chat_completion``,
``chat_completion_stream_generator``, ``chat_completion_full_generator``).
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from minillm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    random_uuid,
)
from minillm.entrypoints.openai.sampling import check_top_logprobs
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


class OpenAIServingChat(OpenAIServing):
    """Handles the Chat Completions API for one served model."""

    def prompt_token_ids(self, request: ChatCompletionRequest) -> list[int]:
        """The conversation rendered with the chat template, as token ids."""
        if self.tokenizer is None:
            raise OpenAIRequestError("This server's model has no tokenizer, hence no chat template: use "
                                     "/v1/completions with token ids", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt,
                                                     tokenize=True)
        except Exception as e:  # noqa: BLE001 - a template may raise anything on a conversation it rejects
            raise OpenAIRequestError(f"The chat template cannot render these messages: {e}",
                                     param="messages") from e
        if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | AsyncIterator[str] | None:
        """Validate, submit, and answer: the whole response, or (``stream``) an async iterator of SSE events.

        ``None`` means the request ended without an answer (it was aborted). Refusals raise
        :class:`~minillm.entrypoints.openai.serving_engine.OpenAIRequestError`.
        """
        self.check_model(request)
        try:  # an out-of-range value is an invalid value first, whether or not this server supports the field
            check_top_logprobs(request.top_logprobs)
        except ValueError as e:
            raise OpenAIRequestError(str(e), param="top_logprobs") from e
        reject_unsupported(request, {"logprobs": False, "top_logprobs": None, "logit_bias": {}, "tools": [],
                                     "response_format": {"type": "text"}})
        self.check_output_limit(request, api="chat")
        ids = await self.run_in_tokenizer_thread(self.prompt_token_ids, request)
        self.check_prompt_len(len(ids), "messages")
        params = self.to_sampling_params(request, len(ids), api="chat")
        request_id = f"chatcmpl-{random_uuid()}"
        collector = await self.add_request(request_id, ids, params, request.priority or 0, "messages")
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            stream = self.chat_completion_stream_generator(collector, len(ids), include_usage)
            return abort_when_dropped(stream, self.engine_client, collector)
        return await self.chat_completion_full_generator(collector, len(ids))

    async def chat_completion_full_generator(self, collector: Any,
                                             prompt_len: int) -> ChatCompletionResponse | None:
        """Wait for the final output; ``None`` if the request ended without one (aborted)."""
        final = await self.final_output(collector)
        if final is None:
            return None
        o = final.outputs[0]
        return ChatCompletionResponse(
            id=collector.request_id, model=self.served_model_name,
            choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content=o.text),
                                                  finish_reason=o.finish_reason, stop_reason=o.stop_reason)],
            usage=usage_of(prompt_len, len(o.token_ids)))

    async def chat_completion_stream_generator(self, collector: Any, prompt_len: int,
                                               include_usage: bool) -> AsyncIterator[str]:
        """The role chunk, one content chunk per step with text, the finish chunk, [usage], ``[DONE]``.

        A client that goes away cancels this generator; ``stream_outputs`` then aborts the request.
        """
        created = int(time.time())

        def chunk(delta: DeltaMessage, finish_reason: str | None = None, stop_reason: Any = None) -> str:
            choice = ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=finish_reason,
                                                        stop_reason=stop_reason)
            body = ChatCompletionStreamResponse(id=collector.request_id, created=created,
                                                model=self.served_model_name, choices=[choice]).model_dump()
            # OpenAI's deltas carry only what is new: no "role": null after the first chunk.
            body["choices"][0]["delta"] = {k: v for k, v in body["choices"][0]["delta"].items() if v is not None}
            return sse(json.dumps(body))

        num_tokens = 0
        finished = False
        try:
            yield chunk(DeltaMessage(role="assistant", content=""))
            async for out in self.engine_client.stream_outputs(collector):
                o = out.outputs[0]
                num_tokens = len(o.token_ids)
                finished = out.finished
                if out.finished:
                    delta = DeltaMessage(content=o.delta_text) if o.delta_text else DeltaMessage()
                    yield chunk(delta, o.finish_reason, o.stop_reason)
                elif o.delta_text:
                    yield chunk(DeltaMessage(content=o.delta_text))
            if not finished:
                yield stream_aborted()
            elif include_usage:
                yield sse(ChatCompletionStreamResponse(id=collector.request_id, created=created,
                                                       model=self.served_model_name, choices=[],
                                                       usage=usage_of(prompt_len, num_tokens)).model_dump_json())
        except Exception as e:  # noqa: BLE001 - the status line is sent already; report inside the stream
            yield stream_error(e)
        yield sse("[DONE]")
