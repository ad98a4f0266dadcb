"""What every request passes before it reaches a route: the Host check, the API key, the body's type and size.

Three pure ASGI middlewares (``BaseHTTPMiddleware`` would buffer streamed responses), outermost first:
:class:`HostCheckMiddleware` (on loopback, a ``Host`` that is not loopback gets a 400: DNS rebinding),
:class:`AuthenticationMiddleware` (with an API key, ``/v1`` needs ``Authorization: Bearer <key>``, else 401) and
:class:`RequestBodyMiddleware` (a POST body must be ``application/json``, else 415, so no cross-origin "simple"
request; and at most ``max_body_bytes``, else 413, decided before the body is read). Each refusal is OpenAI's
error body, decided before any JSON is parsed or any token made.

vLLM counterpart: ``vllm/entrypoints/serve/middleware/authenticate.py`` (``AuthenticationMiddleware``, the same
hashed comparison); vLLM has no Host or content-type check and no body limit.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import secrets
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from http import HTTPStatus
from typing import Any

from minillm.entrypoints.openai.serving_engine import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_REQUEST_BODY_BYTES = 1024 * 1024
"""1 MiB: some 30 times the longest prompt SmolLM2 takes (8192 tokens as text or as token ids), and small enough
that tokenizing a body of this size takes a few seconds on a CPU (a 10 MB one took 48 s)."""

GUARDED_PREFIX = "/v1"
METHODS_WITH_BODY = ("POST", "PUT", "PATCH")


async def send_error(send: Send, status: int, message: str, code: str, param: str | None = None,
                     err_type: str = "invalid_request_error", headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Answer with OpenAI's error body and ``status``, without calling the app."""
    body = json.dumps(error_body(message, err_type, param=param, code=code)).encode()
    await send({"type": "http.response.start", "status": int(status),
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def is_loopback_host(host: str) -> bool:
    """``True`` for ``localhost`` and for IP literals of the loopback networks (``127.0.0.0/8``, ``::1``)."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(host_header: str) -> str:
    """The name in a ``Host`` header without its port: ``"[::1]:8000"`` -> ``"::1"``, ``"a.b:80"`` -> ``"a.b"``."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


class HostCheckMiddleware:
    """Refuse requests whose ``Host`` header names another machine (400, ``code="invalid_host"``).

    Args:
        app: the wrapped ASGI app.
        allowed_hosts: host names allowed besides the loopback ones (``localhost``, ``127.x.x.x``, ``::1``), which
            are always allowed.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str] = ()) -> None:
        self.app = app
        self.allowed_hosts = {h.strip("[]").lower() for h in allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = host_of(_header(scope, b"host") or "").lower()
            if not (is_loopback_host(host) or host in self.allowed_hosts):
                await send_error(send, HTTPStatus.BAD_REQUEST,
                                 f"Invalid Host header {host[:100]!r}: this server listens on loopback and answers "
                                 f"only requests addressed to localhost (a web page that rebinds its domain to this "
                                 f"machine is refused)", code="invalid_host")
                return
        await self.app(scope, receive, send)


class AuthenticationMiddleware:
    """Require ``Authorization: Bearer <key>`` on every ``/v1`` route (401, ``code="invalid_api_key"``).

    Args:
        app: the wrapped ASGI app.
        api_keys: the accepted keys (any one of them).
    """

    def __init__(self, app: ASGIApp, api_keys: Iterable[str]) -> None:
        self.app = app
        # Compare hashes in constant time: neither the key's length nor its first wrong byte leaks through timing.
        self.key_hashes = [hashlib.sha256(k.encode()).digest() for k in api_keys]
        if not self.key_hashes:
            raise ValueError("AuthenticationMiddleware needs at least one API key")

    def verify(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries one of the keys as a Bearer token."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.strip().encode()).digest()
        match = False
        for key_hash in self.key_hashes:  # no early exit, for the same reason
            match |= secrets.compare_digest(digest, key_hash)
        return match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope.get("method") != "OPTIONS"
                and scope["path"].removeprefix(scope.get("root_path", "")).startswith(GUARDED_PREFIX)
                and not self.verify(_header(scope, b"authorization"))):
            await send_error(send, HTTPStatus.UNAUTHORIZED,
                             "Incorrect or missing API key. Send it as the header 'Authorization: Bearer <key>' "
                             "(the OpenAI client's api_key).", code="invalid_api_key",
                             headers=[(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class RequestBodyMiddleware:
    """Require a JSON body of at most ``max_body_bytes`` on POST/PUT/PATCH (415 / 413), read whole before the route.

    Args:
        app: the wrapped ASGI app.
        max_body_bytes: the largest body accepted, in bytes.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> None:
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self, size: str) -> str:
        return (f"The request body is {size} bytes; this server accepts at most {self.max_body_bytes} bytes "
                f"(--max-request-body-bytes)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in METHODS_WITH_BODY:
            await self.app(scope, receive, send)
            return
        content_type = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
        if content_type != "application/json":
            await send_error(send, HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                             f"Unsupported Content-Type {content_type[:100]!r}; send the body as JSON with "
                             f"'Content-Type: application/json'", code="unsupported_media_type")
            return
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                await send_error(send, HTTPStatus.BAD_REQUEST, f"Invalid Content-Length {length[:40]!r}",
                                 code="invalid_content_length")
                return
            if int(length) > self.max_body_bytes:  # refused before a byte of it is read
                await send_error(send, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._too_large(length.strip()),
                                 code="request_too_large")
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:  # chunked (no Content-Length), or more than it said
                await send_error(send, HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                 self._too_large(f"more than {self.max_body_bytes}"), code="request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            # The route reads the body once from here; later calls (the disconnect watcher) go to the connection.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
