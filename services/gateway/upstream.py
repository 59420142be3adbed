"""Calls to engines over one pooled httpx client, each with its per-hop timeouts.

Failures that happen before the engine's first byte reaches the client raise `UpstreamError` (the caller may
retry on another engine); an engine's own 4xx answer is not a failure of the engine and is passed back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from switchyard.services.gateway.registry import Engine
from switchyard.services.gateway.settings import GatewaySettings


class UpstreamError(Exception):
    def __init__(self, engine: Engine, reason: str, detail: str = "") -> None:
        super().__init__(f"{engine.engine_id}: {reason}{': ' + detail if detail else ''}")
        self.engine, self.reason = engine, reason


@dataclass
class Opened:
    """A stream whose headers and first chunk have arrived (or an engine's 4xx answer, `first` its body)."""

    response: httpx.Response
    first: bytes
    chunks: AsyncIterator[bytes] | None


def _reason(exc: Exception) -> str:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return "connect"
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return "timeout"
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError):
        return "closed"
    return type(exc).__name__


class Upstream:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        limits = httpx.Limits(
            max_connections=settings.max_connections, max_keepalive_connections=settings.max_keepalive
        )
        self.client = httpx.AsyncClient(limits=limits, timeout=self._timeout(settings.first_byte_timeout_s))
        self.stream_timeout = self._timeout(settings.read_timeout_s)

    def _timeout(self, read_s: float) -> httpx.Timeout:
        s = self.settings
        return httpx.Timeout(
            connect=s.connect_timeout_s, read=read_s, write=s.connect_timeout_s, pool=s.connect_timeout_s
        )

    @staticmethod
    def headers(request_id: str, authorization: str | None) -> dict[str, str]:
        headers = {"content-type": "application/json", "x-request-id": request_id, "accept-encoding": "identity"}
        if authorization:
            headers["authorization"] = authorization
        return headers

    async def post(
        self, engine: Engine, path: str, content: bytes, headers: dict[str, str], deadline_s: float | None = None
    ) -> httpx.Response:
        """A non-streaming call: the whole answer, within `deadline_s` (default: the first-byte timeout)."""
        try:
            async with asyncio.timeout(deadline_s or self.settings.first_byte_timeout_s):
                response = await self.client.post(engine.base_url + path, content=content, headers=headers)
        except (httpx.HTTPError, TimeoutError) as exc:
            raise UpstreamError(engine, _reason(exc), str(exc)) from None
        if response.status_code >= 500:
            raise UpstreamError(engine, f"http_{response.status_code}", response.text[:200])
        return response

    async def open_stream(self, engine: Engine, path: str, content: bytes, headers: dict[str, str]) -> Opened:
        """Send a streaming call and wait for its first chunk (within the first-byte timeout)."""
        request = self.client.build_request(
            "POST", engine.base_url + path, content=content, headers=headers, timeout=self.stream_timeout
        )
        response: httpx.Response | None = None
        try:
            async with asyncio.timeout(self.settings.first_byte_timeout_s):
                response = await self.client.send(request, stream=True)
                if response.status_code >= 500:
                    raise UpstreamError(engine, f"http_{response.status_code}")
                if response.status_code >= 400:
                    body = await response.aread()
                    await response.aclose()
                    return Opened(response, body, None)
                chunks = response.aiter_raw()
                first = b""
                while not first:  # an empty read is not a first byte
                    first = await anext(chunks)
                return Opened(response, first, chunks)
        except UpstreamError:
            if response is not None:
                await response.aclose()
            raise
        except (httpx.HTTPError, TimeoutError, StopAsyncIteration) as exc:
            if response is not None:
                await response.aclose()
            reason = "empty" if isinstance(exc, StopAsyncIteration) else _reason(exc)
            raise UpstreamError(engine, reason, str(exc)) from None
        except BaseException:  # cancelled (client gone): close the connection so the engine aborts the request
            if response is not None:
                await asyncio.shield(response.aclose())
            raise

    async def close(self) -> None:
        await self.client.aclose()
