"""Calls to engines over one pooled client (`engine_http.EngineHttp`), each with its per-hop timeouts.

Not httpx: under concurrency httpx's connection pool cost 1.5-5.6 ms of CPU per request on this machine
(`bench/bench_gateway.py` measures it as a pass-through proxy; encode/httpx#3215). Not aiohttp, which served
here until issue 27: `engine_http`'s docstring says why.

Failures that happen before the engine's first byte reaches the client raise `UpstreamError` (the caller may
retry on another engine); an engine's own 4xx answer is not a failure of the engine and is passed back.

Every answer read whole (a non-streaming one, a prefill's, an engine's 4xx body, `/health`) is bounded in bytes
(`max_answer_bytes`; `HEALTH_MAX_BYTES`), every head in bytes and time (`max_answer_head_bytes`,
`head_timeout_s`): an answer past a bound is a failure whose reason is in `HOSTILE`, and the caller ejects the
engine at once (`GatewayRegistry.hop_failed`), since no honest engine sends one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from switchyard.services.gateway.engine_http import EngineHttp, EngineHttpError, Response
from switchyard.services.gateway.registry import HttpEngine
from switchyard.services.gateway.settings import GatewaySettings

#: Failure reasons no honest engine causes: an answer past a bound (`engine_http`) or one that is not the JSON it
#: must be (`disagg`, nested deeper than `shared.json_depth` allows). Each ejects its engine at once.
HOSTILE = frozenset({"too_large", "head_too_large", "head_timeout", "not_json", "too_deep"})
#: An engine's `/health` answer is empty (vLLM); more than this is not a health answer.
HEALTH_MAX_BYTES = 64 * 1024


class UpstreamError(Exception):
    def __init__(self, engine: HttpEngine, reason: str, detail: str = "") -> None:
        super().__init__(f"{engine.engine_id}: {reason}{': ' + detail if detail else ''}")
        self.engine, self.reason = engine, reason

    @property
    def hostile(self) -> bool:
        """The answer broke a bound no honest engine breaks (`HOSTILE`)."""
        return self.reason in HOSTILE


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
    response: Response

    def close(self) -> None:
        """Close the connection (not back to the pool): the engine sees the client go and aborts the request."""
        self.response.close()


class Upstream:
    """Create inside the running event loop."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.http = EngineHttp(
            settings.connect_timeout_s,
            settings.max_connections,
            max_head_bytes=settings.max_answer_head_bytes,
            head_timeout_s=settings.head_timeout_s,
        )

    @staticmethod
    def headers(request_id: str, authorization: str | None) -> dict[str, str]:
        headers = {"content-type": "application/json", "x-request-id": request_id, "accept-encoding": "identity"}
        if authorization:
            headers["authorization"] = authorization
        return headers

    async def post(
        self, engine: HttpEngine, path: str, content: bytes, headers: dict[str, str], deadline_s: float | None = None
    ) -> Answer:
        """A non-streaming call: the whole answer, within `deadline_s` (default: the first-byte timeout)."""
        http = self.http
        deadline = http.loop.time() + (self.settings.first_byte_timeout_s if deadline_s is None else deadline_s)
        try:
            response = await http.request(engine.url(path), "POST", headers, content, deadline)
            body = await response.read(deadline, self.settings.max_answer_bytes)
        except EngineHttpError as exc:
            raise UpstreamError(engine, exc.reason, str(exc)) from None
        status, content_type = response.status, response.content_type or "application/json"
        if status >= 500:
            raise UpstreamError(engine, f"http_{status}", body[:200].decode("utf-8", "replace"))
        return Answer(status, body, content_type)

    async def open_stream(self, engine: HttpEngine, path: str, content: bytes, headers: dict[str, str]) -> Opened:
        """Send a streaming call and wait for its first chunk (within the first-byte timeout)."""
        http = self.http
        deadline = http.loop.time() + self.settings.first_byte_timeout_s
        try:
            response = await http.request(engine.url(path), "POST", headers, content, deadline)
        except EngineHttpError as exc:
            raise UpstreamError(engine, exc.reason, str(exc)) from None
        try:
            status = response.status
            if status >= 500:
                raise UpstreamError(engine, f"http_{status}")
            if status >= 400:
                body = await response.read(deadline, self.settings.max_answer_bytes)
                return Opened(status, response.content_type or "application/json", body, None, response)
            first = await response.chunk(deadline)
            if not first:
                raise UpstreamError(engine, "empty")
        except EngineHttpError as exc:
            response.close()
            raise UpstreamError(engine, exc.reason, str(exc)) from None
        except BaseException:  # an UpstreamError, or cancelled (the client went away): the engine aborts it
            response.close()
            raise
        chunks = response.chunks(self.settings.read_timeout_s)
        return Opened(status, response.content_type or "text/event-stream", first, chunks, response)

    async def healthy(self, engine: HttpEngine, timeout_s: float) -> bool:
        """Whether the engine's own `GET /health` answers 2xx within `timeout_s` (vLLM's health endpoint)."""
        http = self.http
        deadline = http.loop.time() + timeout_s
        try:
            response = await http.request(engine.url("/health"), "GET", {}, b"", deadline)
            await response.read(deadline, HEALTH_MAX_BYTES)
        except EngineHttpError:
            return False
        return 200 <= response.status < 300

    async def close(self) -> None:
        await self.http.close()
