"""The HTTP front door (Starlette): OpenAI's completion endpoints, models, health, readiness and metrics.

Besides its own probes (`/healthz`, `/readyz`) it answers what clients of `vllm serve` probe: `GET /health`
(200, empty body, as vLLM's; load harnesses such as GuideLLM check it before a run) and `GET /version`. Every error
it makes itself is OpenAI's error JSON, 404 and 405 included; OpenAI endpoints it does not serve (embeddings,
responses, ...) answer 501 saying so, not a bare 404.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from switchyard.services.gateway import metrics
from switchyard.services.gateway.admission import BANDS, BadClass, RequestClass, classify, request_cost
from switchyard.services.gateway.body import BadBody, Parsed, error_response, parse
from switchyard.services.gateway.disagg import serve_disagg
from switchyard.services.gateway.dp import serve_dp
from switchyard.services.gateway.registry import HttpEngine
from switchyard.services.gateway.relay import Context, ToClient
from switchyard.services.gateway.signatures import new_request_id
from switchyard.services.router.prefix import key_block_size
from switchyard.shared.tracing import Tracing

log = logging.getLogger(__name__)


def _fleet_unavailable(ctx: Context, model: str | None) -> Response:
    served = ctx.registry.models()
    if model is not None and served and model not in served:
        return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    return error_response(503, "no live engine can serve this request", "ServiceUnavailableError")


def _block_size(engines: list[HttpEngine]) -> int:
    """The block size most candidates announce (the router's core keys its match at the same one): one engine's
    odd hello cannot turn prefix routing off for the rest (issue 37, item 7); odd engines are counted."""
    first = engines[0].block_size
    if all(e.block_size == first for e in engines):
        return first
    size = key_block_size([e.block_size for e in engines])
    metrics.ODD_BLOCK_SIZE.inc(sum(e.block_size != size for e in engines))
    return size


async def _name_blocks(ctx: Context, parsed: Parsed, chat: bool, engines: list[HttpEngine]) -> None:
    """The prompt's block keys at the block size most candidates announce, and its exact token count when it was
    tokenized; a failure leaves the request without keys (counted), never fails it."""
    keyer = ctx.keyer
    if keyer is None:
        return
    try:
        keys = await keyer.keys(parsed.body, chat, parsed.model, _block_size(engines))
    except Exception:
        metrics.PROMPT_KEYS_FAILED.inc()
        log.debug("no block keys for a request", exc_info=True)
        return
    parsed.keys = keys
    if keys.tokens is not None:
        parsed.prompt_tokens = max(1, keys.tokens)


def _choices(parsed: Parsed) -> int:
    """The request's `n` (choices to generate); a malformed one is the engine's to refuse."""
    n = parsed.body.get("n", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) else 1


async def _body(receive: Receive) -> bytes:
    """The request body; `HttpLimits` has buffered it into one message (Starlette's `Request.body` iterates an
    async generator for it)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: what arrived is all there is
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _complete(ctx: Context, request: Request, path: str, chat: bool) -> ToClient:
    started = time.perf_counter()
    raw = await _body(request.receive)
    try:
        parsed = parse(raw, chat, ctx.settings.affinity_prefix_chars)
    except BadBody as exc:
        metrics.BAD_REQUESTS.labels(exc.reason).inc()
        return error_response(400, str(exc), param=exc.param)
    settings = ctx.settings
    try:
        klass = classify(request.scope["headers"], parsed.body, BANDS.index(settings.default_priority))
    except BadClass as exc:
        metrics.BAD_REQUESTS.labels("header").inc()
        return error_response(400, str(exc), param=exc.header)
    registry, mode = ctx.registry, settings.mode
    request_id = new_request_id()
    if mode == "auto":  # the model's fleet mode: a live fleet keeps it (registry.mode)
        mode = registry.mode(parsed.model)
    if mode == "dp":
        dp = registry.live("dp", parsed.model)
        if dp:
            return await _serve_dp(ctx, request, parsed, raw, path, chat, dp, klass, request_id, started)
    elif mode == "disagg":
        prefills, decoders = registry.live("prefill", parsed.model), registry.live("decode", parsed.model)
        if _choices(parsed) > 1:  # vLLM's P/D connectors hand one sequence's KV to the decoder, not n of them
            metrics.BAD_REQUESTS.labels("n").inc()
            return error_response(
                400,
                "n > 1 is not served on a prefill->decode fleet (each choice would need its own handoff); "
                "send one request per choice",
                param="n",
            )
        if prefills and decoders:
            fleet = (prefills, decoders)
            return await _serve_disagg(ctx, request, parsed, path, chat, fleet, klass, request_id, started)
    metrics.REQUESTS.labels("none", "unavailable").inc()
    return _fleet_unavailable(ctx, parsed.model)


async def _serve_dp(
    ctx: Context,
    request: Request,
    parsed: Parsed,
    raw: bytes,
    path: str,
    chat: bool,
    dp: list[HttpEngine],
    klass: RequestClass,
    request_id: str,
    started: float,
) -> ToClient:
    """The DP path behind flow control: while the fleet is saturated the request waits its turn (or is shed)."""
    flow, routed = ctx.flow, None
    if flow is not None:
        refused, routed = await flow.admit(request, parsed.model, klass, _cost(ctx, parsed), dp, request_id)
        if refused is not None:
            return refused.response()
        if routed is not None:  # it waited: engines may have come or gone meanwhile
            dp = ctx.registry.live("dp", parsed.model)
            if not dp:
                routed()
                metrics.REQUESTS.labels("none", "unavailable").inc()
                return _fleet_unavailable(ctx, parsed.model)
    try:
        await _name_blocks(ctx, parsed, chat, dp)
        return await serve_dp(ctx, request, parsed, raw, path, dp, request_id, started, routed, klass.session)
    finally:
        if routed is not None:
            routed()


async def _serve_disagg(
    ctx: Context,
    request: Request,
    parsed: Parsed,
    path: str,
    chat: bool,
    fleet: tuple[list[HttpEngine], list[HttpEngine]],
    klass: RequestClass,
    request_id: str,
    started: float,
) -> ToClient:
    """The prefill->decode path behind the same flow control: saturated when no prefill engine or no decoder has
    room; `routed()` once both engines are chosen (`serve_disagg`), and in any case when the request ends."""
    (prefills, decoders), flow, routed = fleet, ctx.flow, None
    if flow is not None:
        refused, routed = await flow.admit(
            request, parsed.model, klass, _cost(ctx, parsed), prefills, request_id, decoders=decoders
        )
        if refused is not None:
            return refused.response()
        if routed is not None:  # it waited: engines may have come or gone meanwhile
            prefills, decoders = ctx.registry.live("prefill", parsed.model), ctx.registry.live("decode", parsed.model)
            if not (prefills and decoders):
                routed()
                metrics.REQUESTS.labels("none", "unavailable").inc()
                return _fleet_unavailable(ctx, parsed.model)
    try:
        await _name_blocks(ctx, parsed, chat, prefills)
        return await serve_disagg(ctx, request, parsed, path, prefills, decoders, request_id, started, routed)
    finally:
        if routed is not None:
            routed()


def _cost(ctx: Context, parsed: Parsed) -> Callable[[], float]:
    """The request's weighted tokens for the queue, computed only if it is charged."""
    s = ctx.settings

    def cost() -> float:
        return request_cost(parsed.prompt_tokens, parsed.body, s.output_token_weight, s.default_output_tokens)

    return cost


COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
#: OpenAI (and vLLM) endpoints a client may try that the gateway does not serve: 501 with OpenAI's error JSON.
NOT_SERVED = (
    "/v1/embeddings",
    "/v1/responses",
    "/v1/moderations",
    "/v1/images/generations",
    "/v1/audio/speech",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/rerank",
    "/v1/score",
    "/tokenize",
    "/detokenize",
)
#: Starlette's own refusals, named as OpenAI's clients expect them.
_ERROR_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError"}


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("switchyard")
    except PackageNotFoundError:  # a checkout run without installing it
        return "unknown"


async def _http_error(_request: Request, exc: Exception) -> Response:
    """Starlette's 404/405 (and any other HTTPException) as OpenAI's error JSON, headers (Allow) kept."""
    if not isinstance(exc, HTTPException):  # registered for HTTPException only
        raise exc
    response = error_response(exc.status_code, str(exc.detail), _ERROR_TYPES.get(exc.status_code, "BadRequestError"))
    if exc.headers:
        response.headers.update(exc.headers)
    return response


class _Completions:
    """`POST` to one completions path as a bare ASGI app: the request path skips Starlette's middleware and
    routing (~0.1 ms of a cold request's TTFT); `GatewayApp` sends it here."""

    def __init__(self, ctx: Context, path: str, chat: bool) -> None:
        self.ctx, self.path, self.chat = ctx, path, chat
        self.attributes = {"http.request.method": "POST", "http.route": path, "url.path": path}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracing = self.ctx.tracing
        if tracing is None:
            metrics.INFLIGHT.inc()
            try:
                response = await _complete(self.ctx, Request(scope, receive), self.path, self.chat)
                await response(scope, receive, send)
            finally:
                metrics.INFLIGHT.dec()
            return
        metrics.INFLIGHT.inc()
        try:
            await self._traced(tracing, scope, receive, send)
        finally:
            metrics.INFLIGHT.dec()

    async def _traced(self, tracing: Tracing, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        # A server span for the whole request, streamed answer included; the client's `traceparent`, if any, is
        # its parent. The routing decision and each engine call are its children.
        with tracing.server(f"POST {self.path}", request.headers, self.attributes) as span:
            response = await _complete(self.ctx, request, self.path, self.chat)
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 500:
                tracing.failed(span, f"http_{response.status_code}")
            await response(scope, receive, send)


class GatewayApp:
    """A `POST` to a completions path straight to its handler; everything else (models, health, metrics, a wrong
    method) through the Starlette app, which routes the same handlers and answers 404 and 405 as usual."""

    def __init__(self, completions: dict[str, _Completions], rest: Starlette) -> None:
        self.completions, self.rest = completions, rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.completions.get(scope["path"])
            if handler is not None:
                await handler(scope, receive, send)
                return
        await self.rest(scope, receive, send)


def build_app(ctx: Context, is_connected: object = None) -> GatewayApp:
    """`is_connected()` tells readiness whether the bus is up (None: assume it is)."""
    completions = {path: _Completions(ctx, path, chat=path.endswith("/chat/completions")) for path in COMPLETIONS}

    async def models(_request: Request) -> Response:
        data = []
        for name in ctx.registry.models():
            card: dict[str, object] = {"id": name, "object": "model", "created": 0, "owned_by": "switchyard"}
            length = ctx.registry.max_model_len(name)
            if length is not None:  # as vLLM's /v1/models says it
                card["max_model_len"] = length
            data.append(card)
        return JSONResponse({"object": "list", "data": data})

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def health(_request: Request) -> Response:
        return Response(status_code=200)  # vLLM's /health: 200 and no body while the server is up

    version = {"version": _package_version()}

    async def version_info(_request: Request) -> Response:
        return JSONResponse(version)

    async def not_served(request: Request) -> Response:
        return error_response(
            501,
            f"{request.url.path} is not served by this gateway: it serves /v1/completions and /v1/chat/completions",
            "NotImplementedError",
        )

    async def readyz(_request: Request) -> Response:
        bus_up = is_connected() if callable(is_connected) else True
        engines = len(ctx.registry.live())
        ready = bool(bus_up) and engines > 0
        return JSONResponse({"ready": ready, "bus": bool(bus_up), "live_engines": engines}, 200 if ready else 503)

    async def prometheus(_request: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    rest = Starlette(
        routes=[
            *(Route(path, handler, methods=["POST"]) for path, handler in completions.items()),
            Route("/v1/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/version", version_info, methods=["GET"]),
            *(Route(path, not_served, methods=["GET", "POST"]) for path in NOT_SERVED),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error},
    )
    return GatewayApp(completions, rest)
