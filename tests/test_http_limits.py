"""HTTP limits (services/http_limits.py) on a real uvicorn server, spoken to over raw sockets as a hostile
client would: oversized bodies, bodies that never finish, and what an honest request still gets."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from switchyard.engine_agents.stub import StubConfig
from switchyard.services.api.settings import ApiSettings
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.http_limits import HttpLimits
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import deployment, read_body, serving_asgi


async def echo_length(scope, receive, send) -> None:
    """Answers with the length of the body it was given (what the wrapped app sees)."""
    if scope["type"] != "http":
        return
    body = await read_body(receive)
    payload = json.dumps({"received": len(body)}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


@contextlib.asynccontextmanager
async def serving(max_body_bytes: int = 1024, body_timeout_s: float = 0.5) -> AsyncIterator[int]:
    async with serving_asgi(HttpLimits(echo_length, max_body_bytes, body_timeout_s)) as port:
        yield port


async def _exchange(port: int, head: str, body_parts: list[bytes], pause_s: float = 0.0) -> tuple[int, bytes]:
    """Send a request (head, then each body part after `pause_s`); return the status and the response body.

    The response is read concurrently: a server that answers early and closes may reset the connection under a
    client still sending, and what it answered before counts."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = bytearray()

    async def read_all() -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                received.extend(chunk)

    reading = asyncio.create_task(read_all())
    try:
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode())
            await writer.drain()
            for part in body_parts:
                await asyncio.sleep(pause_s)
                if reading.done():
                    break
                writer.write(part)
                await writer.drain()
        await asyncio.wait_for(reading, 10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    response = bytes(received)
    status = int(response.split(b" ", 2)[1])
    return status, response.split(b"\r\n\r\n", 1)[1]


def _head(length: int | None = None, chunked: bool = False, path: str = "/") -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/octet-stream", "Connection: close"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return "\r\n".join(lines) + "\r\n\r\n"


async def test_an_honest_body_reaches_the_app_whole() -> None:
    async with serving() as port:
        status, body = await _exchange(port, _head(100), [b"x" * 60, b"y" * 40], pause_s=0.01)
    assert status == 200 and json.loads(body) == {"received": 100}


async def test_a_declared_oversized_body_is_refused_without_being_read() -> None:
    async with serving(max_body_bytes=1024) as port:
        status, body = await _exchange(port, _head(10**9), [])  # 1 GB declared, nothing sent
    assert status == 413 and b"exceeds 1024" in body


async def test_a_chunked_body_growing_past_the_limit_is_refused() -> None:
    chunk = b"400\r\n" + b"z" * 1024 + b"\r\n"
    async with serving(max_body_bytes=1500) as port:
        status, _ = await _exchange(port, _head(chunked=True), [chunk, chunk, chunk, b"0\r\n\r\n"])
    assert status == 413


async def test_a_body_sent_one_byte_at_a_time_is_cut_off() -> None:
    """The slowloris body: 100 bytes declared, one sent every 0.2 s; the whole body must arrive in 0.5 s."""
    async with serving(body_timeout_s=0.5) as port:
        status, body = await _exchange(port, _head(100), [b"a"] * 100, pause_s=0.2)
    assert status == 408 and b"not received within" in body


def test_the_api_binds_loopback_and_limits_by_default() -> None:
    config = ApiSettings(_env_file=None)  # type: ignore[call-arg]
    assert config.host == "127.0.0.1"
    assert config.max_body_bytes <= 1 << 20 and config.body_timeout_s <= 30 and config.max_connections <= 1024
    assert config.header_timeout_s <= 30


async def test_the_gateway_refuses_oversized_and_slow_bodies_in_openai_shape(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    """The gateway under the same limits: 413 for a body declared past the limit (not read), 408 for a body sent
    one byte every 0.2 s, both as OpenAI error objects; an honest request still reaches an engine."""
    limits = GatewaySettings(port=0, route_timeout_s=0.5, max_body_bytes=1024, body_timeout_s=0.5)
    async with deployment(settings, bus, [StubConfig("a")], router=False, gateway=limits) as (gw, engines):
        port = gw.port
        assert port is not None
        path = "/v1/completions"
        too_big, big_answer = await _exchange(port, _head(10**9, path=path), [])
        slow, slow_answer = await _exchange(port, _head(100, path=path), [b" "] * 100, pause_s=0.2)
        body = json.dumps({"model": "stub-model", "prompt": "x" * 900, "max_tokens": 2}).encode()
        honest, honest_answer = await _exchange(port, _head(len(body), path=path), [body])
    assert too_big == 413 and json.loads(big_answer)["error"]["code"] == 413
    assert slow == 408 and "not received within" in json.loads(slow_answer)["error"]["message"]
    assert honest == 200 and json.loads(honest_answer)["served_by"] == "a"
    assert len(engines["a"].received) == 1  # only the honest request reached the engine


def test_the_gateway_binds_loopback_and_limits_by_default() -> None:
    config = GatewaySettings(_env_file=None)  # type: ignore[call-arg]
    assert config.host == "127.0.0.1"
    assert config.max_body_bytes <= 64 << 20 and config.body_timeout_s <= 60
    assert config.header_timeout_s <= 30 and config.max_client_connections <= 16384
