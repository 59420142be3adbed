"""One simulated engine's OpenAI-compatible HTTP server (Starlette on uvicorn, inside the fleet's event loop).

Routes, as `vllm serve` has them: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as SSE
and not), `GET /v1/models`, `GET /health`. The engine behind it (`ServedEngine`) turns a parsed request into
a `TokenStream`; this module only speaks HTTP. The socket is bound before the engine says hello, so the
`base_url` it announces is already listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from switchyard.engine_agents.sim.live.openai_wire import (
    BadRequest,
    Kind,
    ParsedRequest,
    chunk_body,
    error_body,
    parse_request,
    response_body,
    sse,
    token_text,
    usage_chunk,
)
from switchyard.engine_agents.sim.live.token_stream import StreamFailed, TokenStream

log = logging.getLogger(__name__)


class ServedEngine(Protocol):
    engine_id: str

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    def open(self, request: ParsedRequest) -> TokenStream:
        """Queue the request (raises `BadRequest`); the stream fills as the engine generates."""
        ...


def _error(exc: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(str(exc), exc.status, exc.param), status_code=exc.status)


def create_app(engine: ServedEngine) -> Starlette:
    created = int(time.time())

    async def models(_: Request) -> Response:
        card = {
            "id": engine.model_name,
            "object": "model",
            "created": created,
            "owned_by": "switchyard-sim",
            "root": engine.model_name,
            "parent": None,
            "max_model_len": engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    def endpoint(kind: Kind) -> Any:
        async def handle(request: Request) -> Response:
            try:
                parsed = parse_request(await request.body(), kind, request.headers.get("x-request-id"))
                if parsed.model != engine.model_name:
                    raise BadRequest(f"The model `{parsed.model}` does not exist.", "model", status=404)
                stream = engine.open(parsed)
            except BadRequest as exc:
                return _error(exc)
            if parsed.stream:
                return StreamingResponse(_sse(parsed, stream), media_type="text/event-stream")
            try:
                tokens = await stream.done()
            except StreamFailed as exc:
                return JSONResponse(error_body(str(exc), 503), status_code=503)
            finally:
                if not stream.finished:  # the handler was cancelled (client gone)
                    stream.cancel()
            body = response_body(parsed, token_text(0, tokens), tokens, stream.kv_transfer_params)
            return JSONResponse(body)

        return handle

    return Starlette(
        routes=[
            Route("/v1/completions", endpoint("completion"), methods=["POST"]),
            Route("/v1/chat/completions", endpoint("chat"), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]
    )


async def _sse(request: ParsedRequest, stream: TokenStream) -> AsyncIterator[bytes]:
    """The stream as server-sent events; a client that goes away cancels the request in the engine."""
    try:
        first = True
        async for start, count, last in stream.chunks():
            kv = stream.kv_transfer_params if last else None
            yield sse(chunk_body(request, token_text(start, count), last, first=first, kv_transfer_params=kv))
            first = False
        if request.include_usage:
            yield sse(usage_chunk(request, stream.generated))
        yield sse("[DONE]")
    except StreamFailed as exc:  # headers are gone already: an error event, as vLLM sends one
        yield sse(error_body(str(exc), 503))
        yield sse("[DONE]")
    finally:
        if not stream.finished:
            stream.cancel()


class _InProcessServer(uvicorn.Server):
    """uvicorn without its own signal handling: the fleet's owner decides when to stop."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host:port` (0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP; with proto 0
    # Nagle and delayed ACKs hold a small answer (the prefill hop's) for ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class EngineHttpServer:
    """Serves one engine's app on an already bound socket until `stop`."""

    def __init__(self, engine: ServedEngine, sock: socket.socket) -> None:
        self.sock = sock
        host, port = sock.getsockname()[:2]
        self.base_url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        self._server = _InProcessServer(
            uvicorn.Config(
                create_app(engine),
                log_config=None,
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=2,
                timeout_keep_alive=30,
            )
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]))
        while not self._server.started:
            if self._task.done():
                await self._task  # raises what stopped it
                raise RuntimeError(f"{self.base_url}: the HTTP server stopped at start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, SystemExit):
                await self._task
        self.sock.close()
