"""``minillm serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the stack vLLM uses).

Routes:

==========================  ==========================================================================================
``GET  /v1/models``          the one served model (``id`` = ``--served-model-name``, default the model file's name)
``POST /v1/completions``     Completions API (``prompt``, ``max_tokens`` default 16, ``stream``, ...)
``POST /v1/chat/completions`` Chat Completions API (``messages``, ``max_completion_tokens`` > ``max_tokens`` > room)
``GET  /health``             200 while the engine loop runs, 503 once it has stopped
``GET  /debug/kv_cache``     a minillm extra: the engine's KV cache and request counters (JSON), e.g.
                             ``{"num_blocks": 1025, "num_free_blocks": 1024, "kv_cache_usage": 0.0,
                             "num_unfinished_requests": 0, "num_requests_total": 3, "num_finished": 2,
                             "num_aborted": 1, "num_steps": 40}``. When no request runs, ``num_free_blocks`` is
                             ``num_blocks - 1`` (the null block is never free): that is how the tests see that a
                             client that hung up got its blocks back.
==========================  ==========================================================================================

One :class:`~minillm.engine.async_llm.AsyncLLM` owns the engine and steps it in a background thread; every HTTP
connection is an asyncio task that submits its request and reads its outputs. A client that disconnects has its
request aborted (streaming: Starlette cancels the response generator; non-streaming: a watcher notices the
``http.disconnect`` message and cancels the handler), which frees its KV blocks at once.

Errors are OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, with status 400 for a bad
request (malformed JSON, wrong types, out-of-range values, ``n != 1``, a prompt too long, an output limit larger
than the room the prompt leaves), 404 for an unknown model or route, 500 if the engine failed. See
:mod:`minillm.entrypoints.openai.serving_engine`.

It listens on 127.0.0.1 by default: it has no authentication, so exposing it (``--host 0.0.0.0``) is a choice.

Run it with ``python -m minillm serve [--port 8000] [engine args]`` (or ``python -m
minillm.entrypoints.openai.api_server``), then::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", max_completion_tokens=16,
                                   messages=[{"role": "user", "content": "What is the capital of France?"}])

vLLM counterpart: ``vllm/entrypoints/openai/api_server.py`` (``build_app``, ``run_server``, the route functions of
the same names) and ``vllm/entrypoints/cli/serve.py``; vLLM adds API keys, CORS, tool calling, logprobs, ``n > 1``,
embeddings and many more routes, and ``/metrics`` for Prometheus.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from dataclasses import asdict
from http import HTTPStatus
from pathlib import Path
from typing import Any, Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.engine.async_llm import AsyncLLM, EngineDeadError
from minillm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from minillm.entrypoints.openai.serving_chat import OpenAIServingChat
from minillm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minillm.entrypoints.openai.serving_engine import OpenAIRequestError, error_body, parse_request

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def default_served_model_name(model: str | None) -> str:
    """The name clients pass as ``model``: the file or directory name without its extension."""
    if model is None:
        from minillm.loaders.model_path import default_model_path

        model = str(default_model_path())
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


async def _listen_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (after the body has been read, ``receive()`` only ever
    yields ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, coro: Awaitable[Any]) -> tuple[bool, Any]:
    """Await ``coro`` unless the client hangs up first; then cancel it (its ``finally`` aborts the request).

    Returns ``(True, result)`` or ``(False, None)`` when the client went away.
    vLLM counterpart: ``with_cancellation`` in ``vllm/entrypoints/utils.py``.
    """
    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_listen_for_disconnect(request))
    done, _ = await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if handler in done:
        watcher.cancel()
        return True, handler.result()
    handler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await handler
    return False, None


def build_app(engine: Any, served_model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: an ``LLMEngine`` or an ``LLM`` (its engine is wrapped in an :class:`AsyncLLM` whose thread the app
            stops at shutdown; the engine is usable again afterwards), or an :class:`AsyncLLM` (left running: its
            owner shuts it down).
        served_model_name: the model's name in the API (default: the model file's name).
    """
    engine = getattr(engine, "llm_engine", engine)  # an LLM: serve its engine
    owns_engine = not isinstance(engine, AsyncLLM)
    engine_client = AsyncLLM(engine) if owns_engine else engine
    if served_model_name is None:
        args = getattr(getattr(engine_client, "engine", None), "engine_args", None)
        served_model_name = default_served_model_name(getattr(args, "model", None))
    serving_chat = OpenAIServingChat(engine_client, served_model_name)
    serving_completion = OpenAIServingCompletion(engine_client, served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if owns_engine:
            engine_client.shutdown()

    app = FastAPI(title="minillm OpenAI-compatible server", lifespan=lifespan)
    app.state.engine_client = engine_client
    app.state.served_model_name = served_model_name

    # -------------------------------------------------------------------------------- error bodies everywhere
    @app.exception_handler(OpenAIRequestError)
    async def openai_error_handler(_: Request, exc: OpenAIRequestError) -> JSONResponse:
        return OpenAIServingChat.create_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error_handler(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == HTTPStatus.NOT_FOUND else None
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", code=code),
                            status_code=exc.status_code)

    @app.exception_handler(EngineDeadError)
    async def engine_dead_handler(_: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "internal_error", code="engine_dead"),
                            status_code=HTTPStatus.SERVICE_UNAVAILABLE)

    @app.exception_handler(Exception)
    async def internal_error_handler(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", "internal_error", code="internal_error"),
                            status_code=HTTPStatus.INTERNAL_SERVER_ERROR)

    # -------------------------------------------------------------------------------- routes
    @app.get("/health")
    async def health() -> Response:
        if engine_client.errored:
            return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=HTTPStatus.OK)

    @app.get("/v1/models")
    async def show_available_models() -> JSONResponse:
        card = ModelCard(id=served_model_name, max_model_len=engine_client.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/debug/kv_cache")
    async def show_kv_cache() -> JSONResponse:
        return JSONResponse(asdict(engine_client.stats))

    async def _respond(raw_request: Request, handler: Awaitable[Any]) -> Response:
        connected, result = await run_unless_disconnected(raw_request, handler)
        if not connected:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        if result is None:
            raise EngineDeadError("the request ended without an answer (the engine stopped)")
        if isinstance(result, BaseModel):
            return JSONResponse(result.model_dump())
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def create_completion(raw_request: Request) -> Response:
        request = parse_request(CompletionRequest, await raw_request.body())
        return await _respond(raw_request, serving_completion.create_completion(request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request) -> Response:
        request = parse_request(ChatCompletionRequest, await raw_request.body())
        return await _respond(raw_request, serving_chat.create_chat_completion(request))

    return app


class BackgroundServer:
    """The server in a background thread of this process, for notebooks and tests: no second model load.

    Args:
        engine: what :func:`build_app` takes (``LLM``, ``LLMEngine`` or ``AsyncLLM``).
        port: ``0`` picks a free port (read it from :attr:`port` / :attr:`url` after :meth:`start`).

    Use::

        with BackgroundServer(llm) as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="unused")
            ...
        # stopped here; the engine's own loop thread is stopped too and ``llm`` works again as before.

    The engine must not be used from elsewhere while the server runs (its loop thread owns it).
    """

    def __init__(self, engine: Any, served_model_name: str | None = None, host: str = DEFAULT_HOST, port: int = 0,
                 log_level: str = "warning") -> None:
        import uvicorn

        self.app = build_app(engine, served_model_name)
        self.served_model_name: str = self.app.state.served_model_name
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level=log_level))
        self._thread: threading.Thread | None = None
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        """Start serving and return once the socket listens."""
        self._thread = threading.Thread(target=self._server.run, name="minillm-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port} (port in use?)")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Stop accepting connections, finish the open ones, stop the engine loop (uvicorn's graceful exit)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------------ command line
def _annotation_type(annotation: str) -> type:
    for name, typ in (("bool", bool), ("int", int), ("float", float)):
        if name in annotation.replace(" ", "").split("|"):
            return typ
    return str


def _field_docs(cls: type) -> dict[str, str]:
    """``name: text`` entries of a class docstring's ``Attributes:`` section, joined into one line each."""
    docs: dict[str, str] = {}
    current = None
    in_section = False
    for line in (cls.__doc__ or "").splitlines():
        stripped = line.strip()
        if stripped == "Attributes:":
            in_section = True
            continue
        if not in_section or not stripped:
            continue
        head, sep, rest = stripped.partition(": ")
        if sep and head.isidentifier() and line.startswith(" " * 8) and not line.startswith(" " * 12):
            current = head
            docs[current] = rest
        elif current is not None:
            docs[current] += " " + stripped
    return {k: v.replace("``", "").replace("%", "%%") for k, v in docs.items()}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--kebab-case`` option per :class:`~minillm.engine.arg_utils.EngineArgs` field (bools get
    ``--x/--no-x``), with the field's documentation as help. Unset options stay ``None`` so that EngineArgs' own
    defaults apply."""
    from minillm.engine.arg_utils import EngineArgs

    docs = _field_docs(EngineArgs)
    group = parser.add_argument_group("engine arguments (minillm.engine.arg_utils.EngineArgs)")
    for f in dataclasses.fields(EngineArgs):
        if not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        typ = _annotation_type(annotation)
        default = f.default if f.default is not dataclasses.MISSING else None
        doc = docs.get(f.name, "")
        help_text = doc if "default" in doc.lower() or "None:" in doc else f"{doc} (default: {default})".strip()
        if typ is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=typ, default=None, help=help_text)


def engine_args_from_cli(args: argparse.Namespace) -> Any:
    """The :class:`EngineArgs` of the options given (the rest keep their defaults)."""
    from minillm.engine.arg_utils import EngineArgs

    given = {name: getattr(args, name) for name in EngineArgs.field_names() if getattr(args, name, None) is not None}
    return EngineArgs.from_kwargs(**given)


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default {DEFAULT_HOST}: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: the model file's name)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (default info: one line per request)")
    add_engine_args(parser)


def add_serve_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on ``python -m minillm``'s sub-commands; the command runs :func:`run_server`.

    The returned parser has ``func=run_server`` set as a default, so a CLI can dispatch with ``args.func(args)``.
    """
    parser = subparsers.add_parser("serve", help="run an OpenAI-compatible HTTP server",
                                   description="Serve a model over the OpenAI API (completions, chat).")
    _add_serve_args(parser)
    parser.set_defaults(func=run_server)
    return parser


def run_server(args: argparse.Namespace) -> int:
    """Load the model, start the engine loop and serve until interrupted (Ctrl-C). Returns the exit code."""
    import uvicorn

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        engine_args = engine_args_from_cli(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if engine_args.resolved_attention_backend() == "triton" and engine_args.resolved_device() == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from minillm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(engine_args)
    name = args.served_model_name or default_served_model_name(engine_args.model)
    app = build_app(engine, name)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s: this server has no authentication; anyone who can reach the port can "
                       "use it", args.host)
    print(f"minillm: serving {name!r} (max_model_len {engine.max_model_len}) on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.entrypoints.openai.api_server",
                                     description="Serve a model over the OpenAI API (same as `minillm serve`).")
    _add_serve_args(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
