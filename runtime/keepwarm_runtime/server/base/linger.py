"""Lingering close: an early refusal is answered, then the unread request body is read and dropped.

A guard that refuses a request before reading its body (413 too large, 401 no key, 400 wrong content
type) answers and, with ``Connection: close``, the server closes the socket. If the client is still
sending, the kernel answers its next bytes with a reset, which also throws away the answer the client
has not read yet: most clients (urllib, httpx, the openai client) only read once they have sent the
whole body, so they see a broken pipe instead of the 413. nginx's "lingering close" fixes this: after
the answer, keep reading and discarding for a bounded time and size, then close. This middleware
does the same for every route: when a response ends while its request body is unread, the answer goes
out first (so a client that reads early sees it at once), then up to ``LINGER_MAX_BYTES`` or
``LINGER_SECONDS`` of body are drained, then the response is ended and uvicorn closes the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LINGER_MAX_BYTES = 64 * 1024 * 1024  # body bytes drained after an early answer, at most
LINGER_SECONDS = 5.0  # time spent draining, at most (nginx: lingering_time 30 s, lingering_timeout 5 s)


def may_have_body(scope: Scope) -> bool:
    """Whether the request announced a body (a Content-Length above zero, or chunked framing)."""
    for key, value in scope.get("headers", ()):
        name = key.lower()
        if name == b"transfer-encoding":
            return True
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
    return False


async def drain(receive: Receive, max_bytes: int = LINGER_MAX_BYTES, seconds: float = LINGER_SECONDS) -> int:
    """Read and drop request body messages until the body ends, the client leaves, or a bound is hit;
    returns the bytes dropped."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    dropped = 0
    while dropped <= max_bytes:
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        try:
            message = await asyncio.wait_for(receive(), remaining)
        except TimeoutError:
            break
        if message["type"] != "http.request":
            break
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return dropped


class LingeringClose:
    """Pure ASGI middleware: drain what is left of the request body before a response ends."""

    def __init__(
        self, app: ASGIApp, max_bytes: int = LINGER_MAX_BYTES, seconds: float = LINGER_SECONDS
    ) -> None:
        self.app, self.max_bytes, self.seconds = app, max_bytes, seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not may_have_body(scope):
            await self.app(scope, receive, send)
            return
        body_read = False

        async def tracked() -> Message:
            nonlocal body_read
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read = True
            return message

        async def lingering(message: Message) -> None:
            ends = message["type"] == "http.response.body" and not message.get("more_body", False)
            if not ends or body_read:
                await send(message)
                return
            await send({**message, "more_body": True})  # the answer is on the wire before the drain
            await drain(receive, self.max_bytes, self.seconds)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app(scope, tracked, lingering)
