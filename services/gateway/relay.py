"""The last hop of every request: send it to an engine, retry once before the first byte, relay the answer.

Shared by both paths (a DP engine, or the decoder of a handoff). The client's disconnect aborts the upstream
call in every phase: before the first byte by racing the call against the ASGI disconnect message, while
streaming because Starlette cancels the relay, whose `finally` closes the upstream connection (vLLM aborts a
request whose connection closes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Send

from switchyard.services.gateway import metrics
from switchyard.services.gateway.body import error_response
from switchyard.services.gateway.choice import least_loaded
from switchyard.services.gateway.registry import GatewayRegistry, HttpEngine
from switchyard.services.gateway.routing import Routes
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.gateway.signatures import SignatureBox
from switchyard.services.gateway.upstream import Opened, Upstream, UpstreamError

if TYPE_CHECKING:
    import numpy as np
    from opentelemetry.trace import Span

    from switchyard.services.gateway.admission import Refusal, RequestClass
    from switchyard.services.gateway.prefix import PrefillPrefix
    from switchyard.services.gateway.prompt_keys import PromptKeyer
    from switchyard.services.gateway.sessions import Sessions
    from switchyard.shared.tracing import Tracing

T = TypeVar("T")


class FlowControl(Protocol):
    """What a request path asks flow control (`flow.Flow`, which needs this module: hence a protocol here)."""

    async def admit(
        self,
        request: Request | None,
        model: str | None,
        klass: RequestClass,
        cost: Callable[[], float],
        engines: list[HttpEngine],
        request_id: str = "",
        decoders: list[HttpEngine] | None = None,
    ) -> tuple[Refusal | None, Callable[[], None] | None]: ...

    def observe(self, request_id: str, signature: np.ndarray | None) -> None: ...


@dataclass
class Context:
    """What a request path needs: the gateway's parts, built once by the service."""

    settings: GatewaySettings
    registry: GatewayRegistry
    router: Routes
    upstream: Upstream
    signatures: SignatureBox
    #: Names each prompt's blocks (None: prefix keys off).
    keyer: PromptKeyer | None = None
    #: The prefill engines' prefix index (None: prefix keys off; the prefill choice is the hash alone).
    prefix: PrefillPrefix | None = None
    #: OpenTelemetry (`shared.tracing`; None: off, the default, and no request path makes a span).
    tracing: Tracing | None = None
    #: Flow control under saturation (`flow.Flow`; None: `admission` off).
    flow: FlowControl | None = None
    #: Session affinity, sticky until saturated (`sessions.Sessions`; None: off, or the remote shape).
    sessions: Sessions | None = None


class ClientGone(Exception):
    """The client disconnected before its answer started."""


class _ClientWatch:
    """Cancels the task that made it when the client disconnects: one task waiting on `receive` for ASGI's
    `http.disconnect`, started by `start` (at once, or later from a timer)."""

    def __init__(self, receive: Receive) -> None:
        current = asyncio.current_task()
        assert current is not None
        self.receive, self.current = receive, current
        self.gone = False
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self.current.cancel()

    def caused(self) -> bool:
        """In an `except CancelledError`: whether the cancellation was the client leaving (and so is spent),
        not the server's own."""
        return self.gone and self.current.uncancel() == 0

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()


#: How long an upstream call runs before a watcher listens for the client's disconnect. Most first bytes come
#: sooner, and then no watcher task is ever made (one costs ~50 µs of a cold request's TTFT); a client that
#: leaves earlier is noticed this late at most.
WATCH_AFTER_S = 0.02


async def until_disconnect(request: Request, call: Awaitable[T]) -> T:
    """`await call`, unless the client disconnects first: then cancel it (closing its connection) and raise.

    The watcher starts only once the call has run `WATCH_AFTER_S`; a disconnect before that is still seen
    then, since the server queues it.
    """
    watch = _ClientWatch(request.receive)
    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, watch.start)
    try:
        return await call
    except asyncio.CancelledError:
        if watch.caused():
            raise ClientGone from None
        raise
    finally:
        timer.cancel()
        watch.stop()


def hop_span(
    tracing: Tracing, engine: HttpEngine, path: str, hop: str, headers: dict[str, str]
) -> tuple[Span, dict[str, str]]:
    """A client span for one call to an engine (one attempt), and the call's headers naming it as the parent
    (`traceparent`): vLLM started with `--otlp-traces-endpoint` continues the trace."""
    attributes = {
        "http.request.method": "POST",
        "url.full": str(engine.url(path)),
        "switchyard.engine_id": engine.engine_id,
        "switchyard.hop": hop,
    }
    span = tracing.open(f"POST {path}", "client", attributes)
    return span, {**headers, **tracing.headers(span)}


def end_hop_span(tracing: Tracing, span: Span, answer: ToClient) -> None:
    """End a hop's span with its answer: at once for a whole one, when the relay finishes for a stream."""
    span.set_attribute("http.response.status_code", answer.status_code)
    if not isinstance(answer, StreamedAnswer):
        tracing.end(span, None if answer.status_code < 500 else f"http_{answer.status_code}")
        return
    finish = answer.finish

    def finished(outcome: str, first_at: float) -> None:
        finish(outcome, first_at)
        span.set_attribute("switchyard.outcome", outcome)
        tracing.end(span, "mid_stream" if outcome == "upstream_error" else None)

    answer.finish = finished


def _failed(tracing: Tracing | None, span: Span | None, error: str) -> None:
    """End a hop's span (when tracing) as failed."""
    if tracing is not None and span is not None:
        tracing.end(span, error)


def other_engine(failed: HttpEngine, candidates: list[HttpEngine], turn: int) -> HttpEngine | None:
    """The least loaded candidate but `failed`, among those still in rotation (not ejected nor busy on trial)."""
    others = [e for e in candidates if e is not failed and not e.ejected and not e.trial_busy]
    index = least_loaded([e.inflight for e in others], turn)
    return others[index] if index >= 0 else None


def client_authorization(request: Request) -> str | None:
    """The client's `Authorization` header, forwarded to the engine (read from the ASGI scope, whose names are
    lower case: Starlette's `Request.headers` builds a mapping of every header for it)."""
    for name, value in request.scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


async def final_hop(
    ctx: Context,
    request: Request,
    *,
    kind: str,
    hop: str,
    engine: HttpEngine,
    candidates: list[HttpEngine],
    path: str,
    content: bytes,
    stream: bool,
    request_id: str,
    started: float,
    prompt_tokens: int = 0,
) -> ToClient:
    """Send the request to `engine` (once more to another candidate if the call fails before the first byte) and
    relay its answer; `prompt_tokens` (the gateway's own count) is what the token counter adds when the engine's
    answer gives no usage."""
    headers = ctx.upstream.headers(request_id, client_authorization(request))
    tracing = ctx.tracing
    if engine.ejected or engine.trial_busy:  # out since it was chosen (a list taken earlier): not this one
        engine = other_engine(engine, candidates, 0) or engine
    for attempt in (0, 1):
        span, sent = None, headers
        if tracing is not None:
            span, sent = hop_span(tracing, engine, path, hop, headers)
        engine.inflight += 1
        ctx.registry.hop_begun(engine)
        try:
            if stream:
                opened = await until_disconnect(request, ctx.upstream.open_stream(engine, path, content, sent))
            else:
                answer = await until_disconnect(request, ctx.upstream.post(engine, path, content, sent))
        except UpstreamError as exc:
            engine.inflight -= 1
            _failed(tracing, span, exc.reason)
            ctx.registry.hop_failed(engine, exc.hostile)
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
            ctx.registry.hop_abandoned(engine)
            _failed(tracing, span, "client_gone")
            metrics.CLIENT_ABORTS.labels(kind).inc()
            metrics.REQUESTS.labels(kind, "aborted").inc()
            return Response(status_code=499)
        except BaseException as exc:
            engine.inflight -= 1
            ctx.registry.hop_abandoned(engine)
            _failed(tracing, span, type(exc).__name__)
            raise
        ctx.registry.hop_succeeded(engine)
        if not stream:
            engine.inflight -= 1
            elapsed = time.perf_counter() - started
            metrics.TTFT.labels(engine.model, engine.engine_id, kind).observe(elapsed)
            metrics.E2E.labels(engine.model, engine.engine_id, kind).observe(elapsed)
            metrics.REQUESTS.labels(kind, "ok" if answer.status < 400 else "client_error").inc()
            if answer.status < 400:
                metrics.count_answer(engine.model, answer.content, prompt_tokens)
            whole = Response(
                answer.content, answer.status, headers={"x-request-id": request_id}, media_type=answer.content_type
            )
            if span is not None:
                end_hop_span(tracing, span, whole)  # type: ignore[arg-type]
            return whole
        relayed = _stream_back(opened, engine, kind, request_id, started, prompt_tokens)
        if span is not None:
            end_hop_span(tracing, span, relayed)  # type: ignore[arg-type]
        return relayed
    raise AssertionError("unreachable")


class StreamedAnswer:
    """A streamed answer whose first chunk is already in hand, as an ASGI app: sent at once, then the rest as it
    comes.

    Starlette's `StreamingResponse` races the body against a disconnect listener in an anyio task group (under
    ASGI spec 2.3, which uvicorn speaks), ~0.3 ms of a cold request's TTFT before the first byte. Here the
    first chunk leaves first; only then does one task listen for the disconnect, cancelling the relay when the
    client goes (so `finish` closes the engine's connection, which aborts the request there). `finish` runs
    exactly once, whatever happens, with the outcome. The headers are the engine's content type, as it sent it,
    and the request id; no content-length, so uvicorn sends the body chunked.
    """

    def __init__(
        self,
        opened: Opened,
        finish: Callable[[str, float], None],
        relay: Callable[[Send], Awaitable[bool]],
        request_id: str,
    ) -> None:
        self.status_code = opened.status
        self.raw_headers = [
            (b"content-type", opened.content_type.encode("latin-1")),
            (b"x-request-id", request_id.encode("latin-1")),
        ]
        self.first, self.finish, self.relay = opened.first, finish, relay

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        outcome, first_at = "aborted", 0.0
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
            first_at = time.perf_counter()
            watch = _ClientWatch(receive)
            watch.start()
            try:
                outcome = "ok" if await self.relay(send) else "upstream_error"
            except asyncio.CancelledError:
                if not watch.caused():
                    raise
            finally:
                watch.stop()
        finally:
            self.finish(outcome, first_at)


def _stream_back(
    opened: Opened, engine: HttpEngine, kind: str, request_id: str, started: float, prompt_tokens: int
) -> ToClient:
    if opened.chunks is None:  # the engine refused the request (4xx): its answer, as it gave it
        engine.inflight -= 1
        metrics.REQUESTS.labels(kind, "client_error").inc()
        headers = {"x-request-id": request_id}
        return Response(opened.first, opened.status, headers=headers, media_type=opened.content_type)
    chunks = opened.chunks
    tokens = metrics.StreamTokens()
    tokens.see(opened.first)

    async def relay(send: Send) -> bool:
        """The chunks after the first; False when the engine failed mid-stream (nothing left to retry). A gap is
        observed for chunks carrying a choice event (a token), not for the usage chunk nor `[DONE]`."""
        itl = metrics.ITL.labels(engine.model, engine.engine_id, kind)
        last = time.perf_counter()
        try:
            async for chunk in chunks:
                if tokens.see(chunk):
                    now = time.perf_counter()
                    itl.observe(now - last)
                    last = now
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Exception:  # the engine failed mid-stream (bytes reached the client: nothing to retry)
            metrics.UPSTREAM_ERRORS.labels(engine.engine_id, "stream", "mid_stream").inc()
            return False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True

    def finish(outcome: str, first_at: float) -> None:
        """Once per request: counts, in-flight, and the upstream connection (pooled, or closed to abort)."""
        engine.inflight -= 1
        if first_at:  # the first chunk was handed to the server: TTFT as the client sees it
            metrics.TTFT.labels(engine.model, engine.engine_id, kind).observe(first_at - started)
        if outcome == "aborted":
            metrics.CLIENT_ABORTS.labels(kind).inc()
        metrics.REQUESTS.labels(kind, outcome).inc()
        metrics.E2E.labels(engine.model, engine.engine_id, kind).observe(time.perf_counter() - started)
        tokens.count(engine.model, prompt_tokens)
        if outcome == "ok":
            opened.response.release()  # read to the end: the connection goes back to the pool
        else:
            opened.close()  # closing the connection is what aborts the request upstream

    return StreamedAnswer(opened, finish, relay, request_id)


#: What a request path answers with (either is an ASGI app): a whole response, or a relayed stream.
ToClient = Response | StreamedAnswer
