"""ASGI guards in front of every route: the body size limit (413) and the API key (401).

Both are pure ASGI middleware, so they run before FastAPI reads a byte of the body: a request that
declares a too-large Content-Length is answered at once, and a chunked one is cut off as soon as
its running total passes the limit. The key is compared in constant time (``hmac.compare_digest``).
Probes and scrapes (``EXEMPT_FROM_AUTH``) never need the key: kubelets and Prometheus carry none.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from keepwarm_runtime.server.base.errors import APIError, PayloadTooLarge, Unauthorized
from keepwarm_runtime.server.base.limits import DEFAULT_MAX_BODY_BYTES

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

EXEMPT_FROM_AUTH = frozenset({"/health", "/ready", "/ping", "/metrics"})


async def send_error(send: Send, error: APIError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = error.response().body
    extra = headers or []
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class BodyLimit:
    """413 for bodies over ``max_bytes``: at once from Content-Length, else while they stream in."""

    def __init__(
        self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES, exempt: frozenset[str] = frozenset()
    ) -> None:
        """``exempt``: paths whose routes enforce a limit of their own (audio uploads:
        --max-audio-upload-bytes, answered as ``audio_too_large``)."""
        self.app, self.max_bytes, self.exempt = app, max_bytes, exempt

    def _error(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"the request body is larger than this server's limit of {self.max_bytes} bytes "
            "(--max-request-body-bytes)",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt:
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await send_error(send, self._error())
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()
            return message

        await self.app(scope, counted, send)


class ApiKey:
    """401 unless ``Authorization: Bearer <key>`` matches; probe and metrics paths are exempt."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in EXEMPT_FROM_AUTH:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization") or b""
        if not hmac.compare_digest(given, self.expected):
            error = Unauthorized(
                "a valid API key is needed: send `Authorization: Bearer <key>`", code="invalid_api_key"
            )
            await send_error(send, error, [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)
