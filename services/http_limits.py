"""Request-size and slow-client limits for any ASGI app (the API and the gateway wrap themselves with it).

A body declared as 1 GB and sent one byte at a time held a connection (and a worker's memory) open for as long
as the client liked. `HttpLimits` reads the whole body before the app sees the request, under two limits:

- `max_body_bytes`: a larger `Content-Length` is answered 413 at once, without reading; a body that grows past
  it while streaming (chunked, or lying about its length) is answered 413 as soon as it does;
- `body_timeout_s`: the whole body must arrive within this many seconds of the request's start, else 408.

The app then gets the buffered body in one message, so its own parsing never waits on the client. Requests
without a body (GET) pass with no delay. Pure ASGI: no dependency on the framework inside.

With `max_json_depth`, a JSON body nested deeper than that is answered 400 before the app parses it (the API's
FastAPI parsed ~930 levels and then failed encoding its own 422 with a RecursionError: a 500 and a traceback).
The gateway leaves it unset and checks in its own parse, which it does anyway.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import Counter

from switchyard.shared import json_depth

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REFUSED = Counter(
    "switchyard_http_refused_total", "HTTP requests refused by the size and time limits, by status.", ["status"]
)


def detail_body(_status: int, detail: str) -> dict[str, Any]:
    """FastAPI's error shape (the API's)."""
    return {"detail": detail}


async def _reply(send: Send, status: int, detail: str, shape: Callable[[int, str], dict[str, Any]]) -> None:
    REFUSED.labels(str(status)).inc()
    body = json.dumps(shape(status, detail)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _too_deep(body: bytes, limit: int) -> bool:
    """True for JSON nested past `limit`; anything else (not JSON, or shallow) is the app's to judge."""
    if not json_depth.may_exceed(body, limit):
        return False
    try:
        json_depth.loads(body, limit)
    except json_depth.TooDeep:
        return True
    except ValueError:  # not JSON (UnicodeDecodeError included): the app answers as it would
        return False
    return False


class HttpLimits:
    """Wrap an ASGI app: `HttpLimits(app, max_body_bytes=..., body_timeout_s=...)`.

    `error_shape(status, detail)` makes the refusal's JSON body, so a client sees the error shape it knows.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int = 1 << 20,
        body_timeout_s: float = 10.0,
        error_shape: Callable[[int, str], dict[str, Any]] = detail_body,
        max_json_depth: int | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.error_shape = error_shape
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = self._declared_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _reply(send, 413, f"request body of {declared} bytes exceeds {self.max_body_bytes}", self.error_shape)
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        await _reply(send, 413, f"request body exceeds {self.max_body_bytes} bytes", self.error_shape)
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            detail = f"request body not received within {self.body_timeout_s:g} s"
            await _reply(send, 408, detail, self.error_shape)
            return
        body = b"".join(chunks)
        if self.max_json_depth is not None and _too_deep(body, self.max_json_depth):
            detail = f"request body is nested more than {self.max_json_depth} levels deep"
            await _reply(send, 400, detail, self.error_shape)
            return
        replayed = False

        async def buffered() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, buffered, send)

    @staticmethod
    def _declared_length(scope: Scope) -> int | None:
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None
