"""A stub OpenAI engine for tests and the benchmark: real HTTP (Starlette on uvicorn), fake tokens.

It is the engine, not infrastructure, so a stub is fair: it answers `/v1/completions` and
`/v1/chat/completions` as vLLM does (SSE chunks then `data: [DONE]`, or one JSON answer with `usage`), acts
as a prefill engine when asked for `do_remote_decode` (returns `kv_transfer_params`, with the signature inside
or published on the bus as a `PrefillSignature`), can fail its first requests, and records what it received
and which streams the client abandoned. With a bus it is an engine agent: its hello, announce replies and
telemetry are the engine-agent core's (`engine_agents.core.EngineAgent`), as for every engine kind.

It lives in `engine_agents/`, not beside the gateway it serves in tests, because it is an engine: services do not
import engine agents (`tests/test_layering.py`); tests and benchmarks import it from here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import signal
import socket
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from switchyard.engine_agents.core.agent import EngineAgent
from switchyard.shared.bus import Bus
from switchyard.shared.schemas import Capacity, Hello, ModelShape, PrefillSignature
from switchyard.shared.signature_json import SIGNATURE_KEY, signature_to_json
from switchyard.shared.tracing import Tracing
from switchyard.shared.tracing import start as start_tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

#: Larger `max_tokens` are refused with 400, as an engine refuses a request beyond its context.
MAX_TOKENS = 100_000


@dataclass
class StubConfig:
    engine_id: str = "stub0"
    role: str = "dp"
    model: str = "stub-model"
    tokens: int = 4
    token_interval_s: float = 0.0
    #: Delay of a non-streaming answer (None: as long as its tokens would take to stream).
    answer_delay_s: float | None = None
    #: Delay of a prefill answer (a prefill takes a while: the gateway's load bound then sees it in flight).
    prefill_delay_s: float = 0.0
    #: Answer this many requests with HTTP 500 before working normally.
    fail_first: int = 0
    #: Where a prefill answer's signature goes: "response" (kv_transfer_params), "bus", or "none".
    signature_via: str = "response"
    signature: np.ndarray = field(default_factory=lambda: np.ones((2, 4), dtype=np.uint16))
    #: Set: every DP completion publishes its prefill signature on the bus as it arrives (as a vLLM agent with
    #: signature capture does when the prefill ends), this function of the request's body giving it.
    dp_signature: Callable[[dict[str, Any]], np.ndarray] | None = None
    #: 1 s: an engine leaves the gateway after 3 silent intervals, and a test on a loaded machine must not see
    #: a stub leave because its event loop lagged (tests that check leaving set a short interval themselves).
    hello_interval_s: float = 1.0
    #: Reported in telemetry, so a test can make the router prefer one engine.
    waiting_prefill_tokens: int = 0
    telemetry_interval_s: float = 0.05


class StubEngine:
    def __init__(self, config: StubConfig, bus: Bus | None = None, host: str = "127.0.0.1") -> None:
        self.config, self.bus, self.host = config, bus, host
        self.received: list[tuple[str, str, dict[str, Any]]] = []  # (path, x-request-id, body)
        #: Each completion request's `traceparent` header (None: it had none), in arrival order.
        self.traceparents: list[str | None] = []
        #: Each completion request's `Authorization` header (None: it had none), in arrival order.
        self.authorizations: list[str | None] = []
        #: OpenTelemetry (`shared.tracing`), started with the server; None: off (the default).
        self.tracing: Tracing | None = None
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.running = 0  # completions being answered (not prefill hops)
        #: While set and not yet open, non-streaming completions wait for it (still noticing a client that left):
        #: a test holds the engine busy for as long as it needs, with no timing in it.
        self.gate: asyncio.Event | None = None
        self.port = 0
        self._served = itertools.count()
        self.agent: EngineAgent | None = None
        self._saying_hello = True
        self._switching: list[asyncio.Task[None]] = []
        self.server: uvicorn.Server | None = None
        self._serving: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ----- HTTP -----

    async def _complete(self, request: Request) -> Response:
        """A completion; with tracing on, inside a server span continuing the caller's `traceparent`, as vLLM
        does when started with `--otlp-traces-endpoint` (ended when the answer, or its stream, ends)."""
        self.traceparents.append(request.headers.get("traceparent"))
        self.authorizations.append(request.headers.get("authorization"))
        tracing = self.tracing
        if tracing is None:
            return await self._completion(request)
        attributes = {"http.request.method": "POST", "url.path": request.url.path, "engine.id": self.config.engine_id}
        span = tracing.open(f"POST {request.url.path}", "server", attributes, carrier=request.headers)
        try:
            response = await self._completion(request)
        except BaseException as exc:
            tracing.end(span, type(exc).__name__)
            raise
        span.set_attribute("http.response.status_code", response.status_code)
        if isinstance(response, StreamingResponse):
            response.body_iterator = _ending(response.body_iterator, tracing, span)
        else:
            tracing.end(span)
        return response

    async def _completion(self, request: Request) -> Response:
        body = json.loads(await request.body())
        request_id = request.headers.get("x-request-id", "")
        self.received.append((request.url.path, request_id, body))
        if next(self._served) < self.config.fail_first:
            return JSONResponse({"error": {"message": "stub failure", "type": "InternalError", "code": 500}}, 500)
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > MAX_TOKENS:  # as vLLM refuses one
            message = f"max_tokens {body['max_tokens']} exceeds the context ({MAX_TOKENS})"
            return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": 400}}, 400)
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            return await self._prefill(body, request_id)
        if self.config.dp_signature is not None and self.bus is not None:
            await self._publish_signature(request_id, self.config.dp_signature(body))
        chat = request.url.path.endswith("chat/completions")
        self.running += 1  # until its answer ends (reported in telemetry as `num_running`)
        if body.get("stream"):
            return StreamingResponse(self._stream(request_id, chat), media_type="text/event-stream")
        try:
            delay = self.config.answer_delay_s
            wait = self.config.token_interval_s * self.config.tokens if delay is None else delay
            deadline = time.monotonic() + wait
            while self.gate is not None and not self.gate.is_set():
                if await request.is_disconnected():
                    self.aborted.append(request_id)
                    return Response(status_code=499)
                await asyncio.sleep(0.01)
            while (left := deadline - time.monotonic()) > 0:  # as vLLM does, notice a client that went away
                if await request.is_disconnected():
                    self.aborted.append(request_id)
                    return Response(status_code=499)
                await asyncio.sleep(min(left, 0.01))
            self.finished.append(request_id)
            return JSONResponse(self._answer(request_id, chat, "tok" * self.config.tokens))
        finally:
            self.running -= 1

    def _answer(self, request_id: str, chat: bool, text: str) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": f"cmpl-{request_id}",
            "object": "chat.completion" if chat else "text_completion",
            "model": self.config.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": 7,
                "completion_tokens": self.config.tokens,
                "total_tokens": 7 + self.config.tokens,
            },
            "served_by": self.config.engine_id,
        }

    async def _publish_signature(self, request_id: str, signature: np.ndarray) -> None:
        """A `PrefillSignature` for `request_id`, keyed as vLLM keys it (`cmpl-<X-Request-Id>-0`)."""
        assert self.bus is not None
        engine_id = self.config.engine_id
        message = PrefillSignature(
            engine_id=engine_id, request_id=f"cmpl-{request_id}-0", ts=time.time(), prompt_tokens=7, signature=signature
        )
        await self.bus.publish(self.bus.subjects.signature(engine_id), message)

    async def _prefill(self, body: dict[str, Any], request_id: str) -> Response:
        cfg = self.config
        if cfg.prefill_delay_s > 0:
            await asyncio.sleep(cfg.prefill_delay_s)
        kv: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": cfg.engine_id,
            "remote_block_ids": [1, 2, 3],
            "remote_host": self.host,
            "remote_port": self.port,
        }
        if cfg.signature_via == "response":
            kv[SIGNATURE_KEY] = signature_to_json(cfg.signature)
        elif cfg.signature_via == "bus" and self.bus is not None:
            await self._publish_signature(request_id, cfg.signature)
        answer = self._answer(request_id, "messages" in body, "t")
        answer["kv_transfer_params"] = kv
        return JSONResponse(answer)

    async def _stream(self, request_id: str, chat: bool) -> AsyncIterator[bytes]:
        try:
            for i in range(self.config.tokens):
                if self.config.token_interval_s:
                    await asyncio.sleep(self.config.token_interval_s)
                delta = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
                chunk = {"id": f"cmpl-{request_id}", "choices": [{"index": 0, **delta, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"
            self.finished.append(request_id)
        except BaseException:
            self.aborted.append(request_id)
            raise
        finally:
            self.running -= 1

    async def _models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.config.model, "object": "model"}]})

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", lambda _r: Response(), methods=["GET"]),
            ]
        )

    # ----- bus (the engine agent's part: the engine-agent core's hello, announce and telemetry) -----

    def hello(self) -> Hello:
        """The engine's hello as its config says now (a test may change its intervals while it runs)."""
        cfg = self.config
        return Hello(
            engine_id=cfg.engine_id,
            role=cfg.role,  # type: ignore[arg-type]
            model=ModelShape(name=cfg.model, num_layers=2, num_experts=4, top_k=1),
            ep_group=cfg.engine_id,
            gpus=["0"],
            capacity=Capacity(max_running=256, kv_blocks=1000, block_size=16, max_model_len=4096),
            ts=time.time(),
            agent="sim",
            hello_interval_s=cfg.hello_interval_s,
            telemetry_interval_s=cfg.telemetry_interval_s,
            base_url=self.base_url,
        )

    def telemetry(self) -> dict[str, float | int | bool]:
        """What the stub reports every interval: the completions it is answering as running, the configured
        prefill backlog, nothing waiting."""
        return {
            "kv_usage": 0.1,
            "num_running": self.running,
            "num_waiting": 0,
            "waiting_prefill_tokens": self.config.waiting_prefill_tokens,
            "remaining_prefill_tokens": 0,
            "step_time_ema": 0.01,
        }

    @property
    def saying_hello(self) -> bool:
        """False: the engine falls silent (no hello, no announce reply, no telemetry), as a vanished engine does,
        while its HTTP server keeps answering; True again: it says hello again."""
        return self._saying_hello

    @saying_hello.setter
    def saying_hello(self, on: bool) -> None:
        if on == self._saying_hello:
            return
        self._saying_hello = on
        if self.agent is not None:
            switch = self.agent.start() if on else self.agent.stop()
            self._switching.append(asyncio.get_running_loop().create_task(switch))

    # ----- lifecycle -----

    async def start(self, port: int = 0) -> None:
        self.tracing = start_tracing("switchyard-stub-engine")
        # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP; with
        # proto 0, Nagle plus delayed ACKs add ~40 ms to every answer written in two parts.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._serving = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._serving.done():
                await self._serving
            await asyncio.sleep(0.01)
        if self.bus is not None:
            self.agent = _StubAgent(self)
            if self._saying_hello:
                await self.agent.start()

    async def stop(self) -> None:
        for task in self._switching:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.agent is not None:
            with contextlib.suppress(Exception):
                await self.agent.stop()
        if self.server is not None and self._serving is not None:
            self.server.should_exit = True
            with contextlib.suppress(Exception):
                await self._serving
        if self.tracing is not None:
            self.tracing.close()
            self.tracing = None


async def _ending(chunks: AsyncIterable[Any], tracing: Tracing, span: Span) -> AsyncIterator[Any]:
    """A stream's chunks, then the end of its span (failed if the stream was cut)."""
    error = "aborted"
    try:
        async for chunk in chunks:
            yield chunk
        error = None
    finally:
        tracing.end(span, error)


class _StubAgent(EngineAgent):
    """The core's agent, with the hello read from the stub's config each time it is sent (so a test that
    changes `hello_interval_s` while the stub runs sees the next hello carry it, and the loops follow it)."""

    def __init__(self, stub: StubEngine) -> None:
        assert stub.bus is not None
        self._stub = stub
        super().__init__(stub.bus, stub.hello(), stub.telemetry)

    @property  # type: ignore[override]
    def hello(self) -> Hello:
        return self._stub.hello()

    @hello.setter
    def hello(self, _value: Hello) -> None:  # the core's constructor stores the first one; the config rules
        pass


def main() -> None:
    """`python -m switchyard.engine_agents.stub --port N`: a stand-alone stub engine (the benchmark's).

    With `--nats-url` it also says hello and sends telemetry as `--engine-id`, so a gateway finds it (chaos)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--token-interval-s", type=float, default=0.0)
    parser.add_argument("--engine-id", default="stub0")
    parser.add_argument("--role", default="dp", choices=["dp", "prefill", "decode"])
    parser.add_argument("--nats-url", default=None, help="NATS URL(s), comma-separated")
    parser.add_argument("--telemetry-interval-s", type=float, default=0.1)
    args = parser.parse_args()

    async def run() -> None:
        bus = None
        if args.nats_url:
            from switchyard.shared.nats_auth import engine_user
            from switchyard.shared.settings import SwitchyardSettings

            settings = SwitchyardSettings(nats_servers=args.nats_url.split(","))  # a cluster: every node's URL
            bus = await Bus.connect(settings, name=args.engine_id, role=engine_user(args.engine_id))
        config = StubConfig(
            engine_id=args.engine_id,
            role=args.role,
            tokens=args.tokens,
            token_interval_s=args.token_interval_s,
            telemetry_interval_s=args.telemetry_interval_s,
        )
        engine = StubEngine(config, bus, host=args.host)
        await engine.start(args.port)
        print(engine.base_url, flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)  # exit 0 when asked to
        await stop.wait()
        await engine.stop()
        if bus is not None:
            await bus.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
