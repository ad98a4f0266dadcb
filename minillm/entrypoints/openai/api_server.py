"""``minillm serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the stack vLLM uses).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /health`` (503 once
the engine has stopped) and, a minillm extra, ``GET /debug/kv_cache`` (the KV cache's and requests' counters).
One :class:`~minillm.engine.async_llm.AsyncLLM` owns the engine (given an engine object, ``build_app(llm)``, it sits
in front of that engine's own core); every connection is an asyncio task, and a client
that disconnects has its request aborted, which frees its blocks at once. Errors are OpenAI's error body
(:mod:`~minillm.entrypoints.openai.serving_engine`); the Host, API-key, content-type and size checks are in
:mod:`~minillm.entrypoints.openai.middleware`; SIGTERM or Ctrl-C aborts the requests in flight and exits 0
(:class:`GracefulServer`). Safety and usage: docs/serving.md.

vLLM counterpart: ``build_app`` in ``vllm/entrypoints/launchers/app.py``, ``run_server`` in
``vllm/entrypoints/launchers/api_server/entry.py``, the route functions in
``vllm/entrypoints/openai/chat_completion/api_router.py`` (``create_chat_completion``) and
``vllm/entrypoints/openai/completion/api_router.py`` (``create_completion``), and ``vllm/entrypoints/cli/serve.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from http import HTTPStatus
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.engine.async_llm import AsyncLLM, EngineDeadError
from minillm.engine.core_client import AsyncInprocClient
from minillm.engine.llm_engine import LLMEngine
from minillm.entrypoints.openai.middleware import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    AuthenticationMiddleware,
    HostCheckMiddleware,
    RequestBodyMiddleware,
    is_loopback_host,
)
from minillm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from minillm.entrypoints.openai.serving_chat import OpenAIServingChat
from minillm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minillm.entrypoints.openai.serving_engine import OpenAIRequestError, error_body, parse_request
from minillm.platforms.dtype import SERVING_DTYPE

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
API_KEY_ENV = "MINILLM_API_KEY"  # vLLM: VLLM_API_KEY
# After SIGTERM/SIGINT the requests in flight are aborted at once; this only bounds connections that stay open
# anyway (a client still sending its body).
GRACEFUL_SHUTDOWN_TIMEOUT_S = 3


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
    vLLM counterpart: ``with_cancellation`` in ``vllm/entrypoints/serve/utils/api_utils.py``.
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


def api_keys_from(api_key: str | Sequence[str] | None) -> list[str]:
    """The API keys to require: those given, else ``$MINILLM_API_KEY`` (vLLM: ``--api-key`` over
    ``VLLM_API_KEY``), without empty ones. An empty list means no key is required."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if not keys:
        keys = [os.environ.get(API_KEY_ENV, "")]
    return [k for k in keys if k]


def serve_engine_core(engine: LLMEngine) -> AsyncLLM:
    """An :class:`AsyncLLM` in front of ``engine``'s engine core: a front end of its own, and an engine thread that
    alone calls the engine's client until the AsyncLLM shuts down (then ``engine`` works again as before)."""
    if not isinstance(engine, LLMEngine):
        raise ValueError(f"build_app serves an LLM, an LLMEngine or an AsyncLLM, got {type(engine).__name__}")
    client = AsyncInprocClient(engine.engine_core, shutdown_client=False)
    return AsyncLLM.from_engine_core(client, engine.tokenizer, engine.engine_args)


def build_app(engine: Any, served_model_name: str | None = None, *, api_key: str | Sequence[str] | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              allowed_hosts: Sequence[str] | None = (), owns_engine: bool | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: an ``LLMEngine`` or an ``LLM`` (an :class:`AsyncLLM` serves its engine core through an engine
            thread that the app stops at shutdown; the engine is usable again afterwards), or an :class:`AsyncLLM`
            (left running: its owner shuts it down).
        served_model_name: the model's name in the API (default: the model file's name).
        api_key: a key (or several) every ``/v1`` request must send as ``Authorization: Bearer <key>``; default
            ``$MINILLM_API_KEY``; none set: no key is asked for.
        max_request_body_bytes: larger POST bodies get a 413 before they are read.
        allowed_hosts: ``Host`` names accepted besides the loopback ones (a server on loopback: ``()``, which
            stops DNS rebinding); ``None`` accepts any (a server listening on other interfaces).
        owns_engine: shut the engine down when the server stops; default: only an engine this function wrapped
            (``minillm serve`` passes ``True`` with the ``AsyncLLM`` it built).
    """
    engine = getattr(engine, "llm_engine", engine)  # an LLM: serve its engine
    wrap = not isinstance(engine, AsyncLLM)
    engine_client = serve_engine_core(engine) if wrap else engine
    owns_engine = wrap if owns_engine is None else owns_engine
    if served_model_name is None:
        served_model_name = default_served_model_name(engine_client.engine_args.model)
    tokenizer_executor = ThreadPoolExecutor(1, thread_name_prefix="minillm-tokenizer")  # shared: one tokenizer
    serving_chat = OpenAIServingChat(engine_client, served_model_name, tokenizer_executor)
    serving_completion = OpenAIServingCompletion(engine_client, served_model_name, tokenizer_executor)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if owns_engine:
            engine_client.shutdown()
        tokenizer_executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="minillm OpenAI-compatible server", lifespan=lifespan)
    app.state.engine_client = engine_client
    app.state.owns_engine = owns_engine
    app.state.served_model_name = served_model_name
    # add_middleware wraps: the last added runs first. Order of the checks: Host, API key, body.
    app.add_middleware(RequestBodyMiddleware, max_body_bytes=max_request_body_bytes)
    keys = api_keys_from(api_key)
    if keys:
        app.add_middleware(AuthenticationMiddleware, api_keys=keys)
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=allowed_hosts)

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
        return JSONResponse(asdict(await engine_client.get_stats()))

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


class GracefulServer(uvicorn.Server):
    """uvicorn's server, with a shutdown that does not wait for requests in flight, and an exit without re-raising.

    uvicorn's own graceful shutdown waits for every open request to finish: with a long stream in flight,
    SIGTERM left the process alive for minutes, and a second Ctrl-C force-quit it past the engine's shutdown. Here
    shutting down (a signal, or ``should_exit``) first stops the engine (when the app owns it): every request in
    flight ends at once, a non-streaming one with a 503 error body, a stream with an error event and
    ``[DONE]``; then uvicorn closes the connections, and anything still open after ``timeout_graceful_shutdown``
    seconds (a client that never finishes sending its body) is cancelled. uvicorn >= 0.29 re-raises the signal
    after a graceful exit (SIGTERM: killed by it, exit status 143; SIGINT: a ``KeyboardInterrupt`` traceback);
    this server returns normally instead, so ``minillm serve`` exits 0.
    """

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        app = self.config.app
        state = getattr(app, "state", None)
        if state is not None and getattr(state, "owns_engine", False):
            # Ends every request in flight now (their streams get an error event); joined off the event loop.
            await asyncio.to_thread(state.engine_client.shutdown)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            logger.warning("already shutting down (requests in flight were aborted); at most %s s more",
                           self.config.timeout_graceful_shutdown)
        self.should_exit = True


def server_config(app: FastAPI, host: str, port: int, log_level: str) -> Any:
    """The uvicorn configuration both ``minillm serve`` and :class:`BackgroundServer` use."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_TIMEOUT_S)


class BackgroundServer:
    """The server in a background thread of this process, for notebooks and tests: no second model load.

    Args:
        engine: what :func:`build_app` takes (``LLM``, ``LLMEngine`` or ``AsyncLLM``).
        port: ``0`` picks a free port (read it from :attr:`port` / :attr:`url` after :meth:`start`).
        **app_args: :func:`build_app`'s keyword arguments (``api_key``, ``max_request_body_bytes``,
            ``allowed_hosts``).

    Use::

        with BackgroundServer(llm) as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="unused")
            ...
        # stopped here; the engine's own loop thread is stopped too and ``llm`` works again as before.

    The engine must not be used from elsewhere while the server runs (its loop thread owns it).
    """

    def __init__(self, engine: Any, served_model_name: str | None = None, host: str = DEFAULT_HOST, port: int = 0,
                 log_level: str = "warning", **app_args: Any) -> None:
        if "allowed_hosts" not in app_args and not is_loopback_host(host):
            app_args["allowed_hosts"] = None  # listening elsewhere: any Host (set an api_key)
        self.app = build_app(engine, served_model_name, **app_args)
        self.served_model_name: str = self.app.state.served_model_name
        self._server = GracefulServer(server_config(self.app, host, port, log_level))
        self._thread: threading.Thread | None = None
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
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
        """Stop accepting connections, end the requests in flight (see :class:`GracefulServer`), stop the engine
        loop."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
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


# The engine arguments whose default differs under `serve` from EngineArgs' own: (value, help).
SERVE_ENGINE_DEFAULTS: dict[str, tuple[Any, str]] = {
    "dtype": (SERVING_DTYPE, f"weights, activations and KV cache (the cache follows the model). Default here: "
                             f"{SERVING_DTYPE}, the dtype this machine is built for: bfloat16 on a CPU with AMX-BF16 "
                             f"or AVX512-BF16, else float32 (float16 on a GPU); the choice and why are printed at "
                             f"start-up. float32 is EngineArgs' and LLM's default, exact against transformers' fp32 "
                             f"model. Or bfloat16, float16 (also fp32, bf16, fp16, half)."),
}


def add_engine_args(parser: argparse.ArgumentParser, defaults: dict[str, tuple[Any, str]] | None = None) -> None:
    """One ``--kebab-case`` option per :class:`~minillm.engine.arg_utils.EngineArgs` field (bools get
    ``--x/--no-x``), with the field's documentation as help. Unset options stay ``None`` so that EngineArgs' own
    defaults apply, except those in ``defaults`` (``name: (value, help)``), which default to ``value``."""
    from minillm.engine.arg_utils import EngineArgs

    docs = _field_docs(EngineArgs)
    defaults = defaults or {}
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
        value, help_text = defaults.get(f.name, (None, help_text))
        if typ is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=value,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=typ, default=value, help=help_text)


def engine_args_from_cli(args: argparse.Namespace) -> Any:
    """The :class:`EngineArgs` of the options given or defaulted by the parser (``--dtype``: ``auto``); the rest
    keep EngineArgs' defaults."""
    from minillm.engine.arg_utils import EngineArgs

    given = {name: getattr(args, name) for name in EngineArgs.field_names() if getattr(args, name, None) is not None}
    return EngineArgs.from_kwargs(**given)


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default {DEFAULT_HOST}: this machine only)")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help=f"require one of these keys as 'Authorization: Bearer <key>' on every /v1 route "
                             f"(default: ${API_KEY_ENV} if set, else no key). Set one before --host 0.0.0.0")
    parser.add_argument("--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help=f"refuse larger request bodies with a 413 before reading them (default "
                             f"{DEFAULT_MAX_REQUEST_BODY_BYTES})")
    parser.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                        help="Host header names accepted besides localhost/127.0.0.1/::1 (on loopback the others "
                             "are refused, which stops DNS rebinding; listening elsewhere, any is accepted unless "
                             "this is given)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: the model file's name)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (default info: one line per request)")
    add_engine_args(parser, SERVE_ENGINE_DEFAULTS)


def add_serve_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on ``python -m minillm``'s sub-commands; the command runs :func:`run_server`.

    The returned parser has ``func=run_server`` set as a default, so a CLI can dispatch with ``args.func(args)``.
    """
    parser = subparsers.add_parser("serve", help="run an OpenAI-compatible HTTP server",
                                   description="Serve a model over the OpenAI API (completions, chat).")
    _add_serve_args(parser)
    parser.set_defaults(func=run_server)
    return parser


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 65535], got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def create_server_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, before the model loads: a bad address or a busy port fails in a second, not
    after the load (vLLM binds first too: ``create_server_socket`` in ``vllm/entrypoints/launchers/launcher.py``).

    Raises:
        OSError: the address cannot be resolved or bound (``socket.gaierror`` is one).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(infos[0][4])
    except OSError:
        sock.close()
        raise
    return sock


def run_server(args: argparse.Namespace) -> int:
    """Check the arguments, bind the port, load the model, start the engine loop and serve until SIGINT (Ctrl-C)
    or SIGTERM, which end the requests in flight and exit 0 within seconds. Returns the exit code (2: bad
    arguments or an address that cannot be bound; 130: interrupted while loading)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        engine_args = engine_args_from_cli(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        sock = create_server_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    loopback = is_loopback_host(args.host)
    api_keys = api_keys_from(args.api_key)
    if not loopback and not api_keys:
        logger.warning("listening on %s without an API key: anyone who can reach the port can use the model; "
                       "set --api-key or $%s", args.host, API_KEY_ENV)
    if engine_args.resolved_attention_backend() == "triton" and engine_args.resolved_device() == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    print(f"minillm: dtype {engine_args.dtype_choice()}", flush=True)
    try:
        # vLLM's way by default: the engine core in its own process, awaited by the event loop (AsyncMPClient);
        # MINILLM_ENABLE_V1_MULTIPROCESSING=0: the core in this process, stepped by an engine thread.
        engine = AsyncLLM.from_engine_args(engine_args)
    except KeyboardInterrupt:
        print("interrupted while loading the model", file=sys.stderr)
        sock.close()
        return 130
    except (ValueError, RuntimeError) as e:  # checks that need the model (e.g. max_model_len above the model's)
        print(f"error: {str(e).removeprefix('the engine core failed to start: ')}", file=sys.stderr)
        sock.close()
        return 2
    name = args.served_model_name or default_served_model_name(engine_args.model)
    allowed_hosts = args.allowed_hosts if args.allowed_hosts is not None else (() if loopback else None)
    app = build_app(engine, name, api_key=api_keys, max_request_body_bytes=args.max_request_body_bytes,
                    allowed_hosts=allowed_hosts, owns_engine=True)
    host = f"[{args.host}]" if ":" in args.host else args.host
    port = sock.getsockname()[1]
    print(f"minillm: serving {name!r} (max_model_len {engine.max_model_len}) on http://{host}:{port}/v1"
          f"{' (API key required)' if api_keys else ''}", flush=True)
    server = GracefulServer(server_config(app, args.host, port, args.uvicorn_log_level))
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()  # build_app leaves an AsyncLLM it was given to its owner: us
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.entrypoints.openai.api_server",
                                     description="Serve a model over the OpenAI API (same as `minillm serve`).")
    _add_serve_args(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
