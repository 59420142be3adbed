"""Issue 37, item 10: a gateway SIGKILLed with streams in flight; the engine side must abort every one.

A killed gateway cuts its clients' streams (SIGTERM drains them; SIGKILL cannot), and nothing lets a client
resume one: the client retries, and a retried completion is a new generation (docs/reliability.md). What must
not happen is the engine generating on for a client that is gone: vLLM aborts a request when its HTTP
connection closes, so every upstream connection of the dead gateway must close. Here `switchyard gateway` runs
as a process of its own in front of a raw HTTP engine (its hello and telemetry from a stub engine's agent whose
`base_url` names the raw server) that streams SSE chunks until its client's connection closes, and records
each close. The kernel closes a killed process's sockets, so this holds today: the test guards it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.shared.bus import Bus
from switchyard.shared.embedded import free_port
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import wait_for
from tests.helpers import eventually
from tests.migration_processes import start_service

pytestmark = pytest.mark.slow

STREAMS = 6  # as in the issue: SIGTERM drained 6 of 6, SIGKILL cut 6 of 6
#: The engine stops streaming after this many chunks even if its client never closes (the test then fails).
MAX_CHUNKS = 600


class StreamingEngine:
    """A raw HTTP engine: `/v1/completions` answers an SSE stream, a chunk every 50 ms, until its client's
    connection closes (it reads EOF or a write fails); counts the streams begun and the connections closed."""

    def __init__(self) -> None:
        self.begun = self.closed = 0
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:  # one connection may carry several requests (the gateway keeps connections alive)
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(v)
                        for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
                        if k.lower() == b"content-length"
                    ),
                    0,
                )
                await reader.readexactly(length)
                if not head.startswith(b"POST /v1/completions"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                self.begun += 1
                if await self._stream(reader, writer):
                    self.closed += 1
                return
        writer.close()

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """SSE chunks until the peer closes (True: `reader.read` gave EOF or a write failed), or False after
        `MAX_CHUNKS` with the connection still open (what vLLM would see as a client still reading)."""
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        eof = asyncio.ensure_future(reader.read(1))
        try:
            for i in range(MAX_CHUNKS):
                event = b"data: " + json.dumps({"choices": [{"text": f"t{i} ", "index": 0}]}).encode() + b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(asyncio.shield(eof), 0.05) == b"":
                        return True
            return False
        except ConnectionError:
            return True
        finally:
            eof.cancel()


class _Fronted(StubEngine):
    """A stub engine's agent (hello, telemetry) whose hello names the raw engine's URL."""

    def __init__(self, config: StubConfig, bus: Bus, url: str) -> None:
        super().__init__(config, bus)
        self._url = url

    @property
    def base_url(self) -> str:
        return self._url


@contextlib.asynccontextmanager
async def _engine(bus: Bus) -> AsyncIterator[StreamingEngine]:
    engine = StreamingEngine()
    await engine.start()
    agent = _Fronted(StubConfig("e0"), bus, engine.url)
    await agent.start()
    try:
        yield engine
    finally:
        await agent.stop()
        await engine.stop()


async def _stream(client: httpx.AsyncClient, url: str, first: asyncio.Event) -> str:
    """One streamed completion through the gateway: how it ended (`cut` when the connection broke)."""
    body = {"model": "stub-model", "prompt": "hello there", "max_tokens": 1000, "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
            async for _chunk in answer.aiter_bytes():
                first.set()
    except httpx.HTTPError:
        return "cut"
    return "ended"


async def test_a_sigkilled_gateway_closes_every_in_flight_streams_engine_connection(
    bus: Bus, settings: SwitchyardSettings, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "gateway.log"
    async with _engine(bus) as engine:
        gateway = start_service("gateway", settings, None, log, "--port", str(port), SWITCHYARD_GATEWAY_GATEWAY_ID="g1")
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0)) as client:

                async def ready() -> bool:
                    with contextlib.suppress(httpx.HTTPError):
                        models = await client.get(f"{url}/v1/models")
                        return "stub-model" in {m.get("id") for m in models.json().get("data", [])}
                    return False

                await eventually(ready, timeout=90, every=0.2)
                firsts = [asyncio.Event() for _ in range(STREAMS)]
                streams = [asyncio.create_task(_stream(client, url, first)) for first in firsts]
                await wait_for(lambda: engine.begun == STREAMS and all(f.is_set() for f in firsts), timeout_s=30)
                assert engine.closed == 0  # all six in flight, streaming to their clients
                gateway.send_signal(signal.SIGKILL)
                await asyncio.to_thread(gateway.wait, 30)
                endings = await asyncio.gather(*streams)
                with contextlib.suppress(TimeoutError):  # the bound only stops a broken run from hanging
                    await wait_for(lambda: engine.closed == STREAMS, timeout_s=20)
                closed = engine.closed  # before the clean-up below closes anything itself
        finally:
            if gateway.poll() is None:
                gateway.kill()
                gateway.wait(30)
    tail = log.read_text(errors="replace")[-2000:]
    assert endings == ["cut"] * STREAMS, tail  # the clients saw their streams break: they must retry
    assert (engine.begun, closed) == (STREAMS, STREAMS), tail  # every engine-side request aborted
