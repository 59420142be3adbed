"""The last hop of every request: send it to an engine, retry once before the first byte, relay the answer.

Shared by both paths (a DP engine, or the decoder of a handoff). The client's disconnect aborts the upstream
call in every phase: before the first byte by racing the call against the ASGI disconnect message, while
streaming because Starlette cancels the relay, whose `finally` closes the upstream connection (vLLM aborts a
request whose connection closes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from switchyard.services.gateway import metrics
from switchyard.services.gateway.body import error_response
from switchyard.services.gateway.choice import least_loaded
from switchyard.services.gateway.registry import Engine, EngineRegistry
from switchyard.services.gateway.routing import Router
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.gateway.signatures import SignatureBox
from switchyard.services.gateway.upstream import Opened, Upstream, UpstreamError

T = TypeVar("T")


@dataclass
class Context:
    """What a request path needs: the gateway's parts, built once by the service."""

    settings: GatewaySettings
    registry: EngineRegistry
    router: Router
    upstream: Upstream
    signatures: SignatureBox


class ClientGone(Exception):
    """The client disconnected before its answer started."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, call: Awaitable[T]) -> T:
    """`await call`, unless the client disconnects first: then cancel it (closing its connection) and raise.

    One watcher task per call, which cancels this task when the disconnect arrives (cheaper than racing two
    tasks with `asyncio.wait` on a path every request takes).
    """
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(request)
        gone = True
        current.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await call
    except asyncio.CancelledError:
        if gone and current.uncancel() == 0:  # our own cancellation, not the server's
            raise ClientGone from None
        raise
    finally:
        watcher.cancel()


def other_engine(failed: Engine, candidates: list[Engine], turn: int) -> Engine | None:
    others = [e for e in candidates if e is not failed]
    index = least_loaded([e.inflight for e in others], turn)
    return others[index] if index >= 0 else None


async def final_hop(
    ctx: Context,
    request: Request,
    *,
    kind: str,
    hop: str,
    engine: Engine,
    candidates: list[Engine],
    path: str,
    content: bytes,
    stream: bool,
    request_id: str,
    started: float,
) -> Response:
    headers = ctx.upstream.headers(request_id, request.headers.get("authorization"))
    for attempt in (0, 1):
        engine.inflight += 1
        try:
            if stream:
                opened = await until_disconnect(request, ctx.upstream.open_stream(engine, path, content, headers))
            else:
                answer = await until_disconnect(request, ctx.upstream.post(engine, path, content, headers))
        except UpstreamError as exc:
            engine.inflight -= 1
            metrics.UPSTREAM_ERRORS.labels(engine.engine_id, hop, exc.reason).inc()
            retry = other_engine(engine, candidates, attempt) if attempt == 0 else None
            if retry is None:
                metrics.REQUESTS.labels(kind, "upstream_error").inc()
                return error_response(502, f"upstream engine failed: {exc}", "BadGatewayError")
            metrics.RETRIES.labels(hop).inc()
            engine = retry
            continue
        except ClientGone:
            engine.inflight -= 1
            metrics.CLIENT_ABORTS.labels(kind).inc()
            metrics.REQUESTS.labels(kind, "aborted").inc()
            return Response(status_code=499)
        except BaseException:
            engine.inflight -= 1
            raise
        if not stream:
            engine.inflight -= 1
            elapsed = time.perf_counter() - started
            metrics.TTFT.labels(engine.engine_id, kind).observe(elapsed)
            metrics.E2E.labels(engine.engine_id, kind).observe(elapsed)
            metrics.REQUESTS.labels(kind, "ok" if answer.status < 400 else "client_error").inc()
            return Response(
                answer.content, answer.status, headers={"x-request-id": request_id}, media_type=answer.content_type
            )
        return _stream_back(opened, engine, kind, request_id, started)
    raise AssertionError("unreachable")


class _Relayed(StreamingResponse):
    """A streaming response that always runs `finish`, even when the client left before the first chunk was
    pulled (an async generator never started has no `finally` to run)."""

    def __init__(self, content: AsyncIterator[bytes], finish: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.finish = finish

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.finish("aborted")


def _stream_back(opened: Opened, engine: Engine, kind: str, request_id: str, started: float) -> Response:
    headers = {"x-request-id": request_id}
    if opened.chunks is None:  # the engine refused the request (4xx): its answer, as it gave it
        engine.inflight -= 1
        metrics.REQUESTS.labels(kind, "client_error").inc()
        return Response(opened.first, opened.status, headers=headers, media_type=opened.content_type)
    itl = metrics.ITL.labels(engine.engine_id, kind)
    chunks = opened.chunks
    finished = False

    def finish(outcome: str) -> None:
        """Once per request: counts, in-flight, and the upstream connection (pooled, or closed to abort)."""
        nonlocal finished
        if finished:
            return
        finished = True
        engine.inflight -= 1
        if outcome == "aborted":
            metrics.CLIENT_ABORTS.labels(kind).inc()
        metrics.REQUESTS.labels(kind, outcome).inc()
        metrics.E2E.labels(engine.engine_id, kind).observe(time.perf_counter() - started)
        if outcome == "ok":
            opened.response.release()  # read to the end: the connection goes back to the pool
        else:
            opened.close()  # closing the connection is what aborts the request upstream

    async def relay() -> AsyncIterator[bytes]:
        outcome = "aborted"
        try:
            last = time.perf_counter()
            metrics.TTFT.labels(engine.engine_id, kind).observe(last - started)
            yield opened.first
            async for chunk in chunks:
                now = time.perf_counter()
                itl.observe(now - last)
                last = now
                yield chunk
            outcome = "ok"
        except Exception:  # the engine failed mid-stream: nothing to retry once bytes reached the client
            outcome = "upstream_error"
            metrics.UPSTREAM_ERRORS.labels(engine.engine_id, "stream", "mid_stream").inc()
        finally:
            finish(outcome)

    return _Relayed(relay(), finish, status_code=opened.status, headers=headers, media_type=opened.content_type)
