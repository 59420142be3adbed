"""Calls to engines over one pooled aiohttp session, each with its per-hop timeouts.

aiohttp rather than httpx: under concurrency httpx's connection pool costs 1.5-5.6 ms of CPU per request on
this machine against aiohttp's 0.2 ms (`bench/bench_gateway.py` measures both as pass-through proxies;
encode/httpx#3215), and the gateway's throughput budget is 500 requests/s on one process.

Failures that happen before the engine's first byte reaches the client raise `UpstreamError` (the caller may
retry on another engine); an engine's own 4xx answer is not a failure of the engine and is passed back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from switchyard.services.gateway.registry import Engine
from switchyard.services.gateway.settings import GatewaySettings


class UpstreamError(Exception):
    def __init__(self, engine: Engine, reason: str, detail: str = "") -> None:
        super().__init__(f"{engine.engine_id}: {reason}{': ' + detail if detail else ''}")
        self.engine, self.reason = engine, reason


@dataclass
class Answer:
    """A whole (non-streaming) answer."""

    status: int
    content: bytes
    content_type: str


@dataclass
class Opened:
    """A stream whose headers and first chunk have arrived; `chunks` None for an engine's 4xx (`first` its body)."""

    status: int
    content_type: str
    first: bytes
    chunks: AsyncIterator[bytes] | None
    response: aiohttp.ClientResponse

    def close(self) -> None:
        """Close the connection (not back to the pool): the engine sees the client go and aborts the request."""
        self.response.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError is one too
        return "timeout"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | aiohttp.ClientOSError):
        return "closed"
    return type(exc).__name__


def _content_type(response: aiohttp.ClientResponse, default: str) -> str:
    return response.headers.get("content-type", default)


class Upstream:
    """Create inside the running event loop (aiohttp binds its session to it)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        connector = aiohttp.TCPConnector(limit=settings.max_connections, limit_per_host=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        s = settings
        self.post_timeout = aiohttp.ClientTimeout(total=s.first_byte_timeout_s, sock_connect=s.connect_timeout_s)
        self.stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=s.connect_timeout_s, sock_read=s.read_timeout_s
        )

    @staticmethod
    def headers(request_id: str, authorization: str | None) -> dict[str, str]:
        headers = {"content-type": "application/json", "x-request-id": request_id, "accept-encoding": "identity"}
        if authorization:
            headers["authorization"] = authorization
        return headers

    async def post(
        self, engine: Engine, path: str, content: bytes, headers: dict[str, str], deadline_s: float | None = None
    ) -> Answer:
        """A non-streaming call: the whole answer, within `deadline_s` (default: the first-byte timeout)."""
        timeout = self.post_timeout
        if deadline_s is not None:
            timeout = aiohttp.ClientTimeout(total=deadline_s, sock_connect=self.settings.connect_timeout_s)
        try:
            async with self.session.post(engine.url(path), data=content, headers=headers, timeout=timeout) as r:
                body = await r.read()
                status, content_type = r.status, _content_type(r, "application/json")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(engine, _reason(exc), str(exc)) from None
        if status >= 500:
            raise UpstreamError(engine, f"http_{status}", body[:200].decode("utf-8", "replace"))
        return Answer(status, body, content_type)

    async def open_stream(self, engine: Engine, path: str, content: bytes, headers: dict[str, str]) -> Opened:
        """Send a streaming call and wait for its first chunk (within the first-byte timeout)."""
        response: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(self.settings.first_byte_timeout_s):
                response = await self.session.post(
                    engine.url(path), data=content, headers=headers, timeout=self.stream_timeout
                )
                status = response.status
                if status >= 500:
                    raise UpstreamError(engine, f"http_{status}")
                if status >= 400:
                    body = await response.read()
                    response.release()
                    return Opened(status, _content_type(response, "application/json"), body, None, response)
                first = await response.content.readany()
                if not first:
                    raise UpstreamError(engine, "empty")
                chunks = response.content.iter_any()
                return Opened(status, _content_type(response, "text/event-stream"), first, chunks, response)
        except UpstreamError:
            if response is not None:
                response.close()
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            if response is not None:
                response.close()
            raise UpstreamError(engine, _reason(exc), str(exc)) from None
        except BaseException:  # cancelled (the client went away): close, so the engine aborts the request
            if response is not None:
                response.close()
            raise

    async def healthy(self, engine: Engine, timeout_s: float) -> bool:
        """Whether the engine's own `GET /health` answers 2xx within `timeout_s` (vLLM's health endpoint)."""
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self.session.get(engine.url("/health"), timeout=timeout) as r:
                return 200 <= r.status < 300
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def close(self) -> None:
        await self.session.close()
