"""Issue 37's hostile engines for `make chaos` (`engine-bigbody`, `engine-hugeheader`): the parts a chaos run needs.

A hostile engine is a manifest-listed DP engine (its credentials and its place in the fleet are valid: what a
compromised engine has) whose HTTP answers no honest engine sends:

- `bigbody`: `200` with `content-length: 2^30`, then junk (issue 37 item 1: the gateway went to 5-6 GiB RSS);
- `hugeheader`: a header `x-a: aaaa...` that never ends, in 64 KiB writes (item 4: 96 % CPU, honest p50 ~21 s).

`/health` answers 200 every time (the issue's engine came back every second). Its hello and telemetry come from
the engine-agent core (`HostileAgent`, a stub whose `base_url` names the raw server), so the gateway routes to it
as to any engine. The server counts the hops it got and the most bytes it wrote on one before the gateway
closed it: with the bounds in place that is `max_answer_bytes` (or `max_answer_head_bytes`) plus the kernel's
socket buffers, and each hop is a `too_large` / `head_too_large` upstream error that ejects the engine.

Wiring into `bench/chaos.py` (owned elsewhere): give the engine id credentials (`nats-config --engines`), list
it in `_write_manifest` with `manifest_entry`, start `HostileServer` and `HostileAgent` when the fault begins
(`start_hostile`), stop both when it ends (`stop_hostile`), and add `HostileServer.note()` and `counts()` to the
fault's line; a 5xx seen by the probes during the fault is lost, as for any fault (the hostile hop is retried on
another engine, so there should be none), and the gateway's RSS before and after goes beside it.
"""

from __future__ import annotations

import asyncio
import contextlib

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.shared.bus import Bus

MODES = ("bigbody", "hugeheader")
#: The server stops writing one answer past this many bytes (and waits for the close): far past any bound.
CAP_BYTES = 256 << 20
_HEADS = {
    "bigbody": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1073741824\r\n\r\n",
    "hugeheader": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-a: ",
}


class HostileServer:
    """The raw HTTP server of one hostile engine (`mode` one of `MODES`)."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown hostile mode {mode!r}; choose from {', '.join(MODES)}")
        self.mode = mode
        self.hops = self.health = self.most_sent = 0
        self.server: asyncio.Server | None = None

    async def start(self, port: int = 0) -> str:
        """Listen on `port` (0: any); returns the base URL."""
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", port)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            lengths = [
                line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")
            ]
            await reader.readexactly(int(lengths[0]) if lengths else 0)
            if head.startswith(b"GET /health"):
                self.health += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                await writer.drain()
            else:
                self.hops += 1
                writer.write(_HEADS[self.mode])
                await self._junk(writer, (b"x" if self.mode == "bigbody" else b"a") * 65536)
        writer.close()

    async def _junk(self, writer: asyncio.StreamWriter, piece: bytes) -> None:
        writer.transport.set_write_buffer_limits(high=0)  # drain returns once the kernel took it: counts what left
        sent = 0
        while sent < CAP_BYTES:
            writer.write(piece)
            await writer.drain()
            sent += len(piece)
            self.most_sent = max(self.most_sent, sent)
        await asyncio.sleep(600)  # past any timeout: the gateway closes

    def counts(self) -> dict[str, int]:
        return {"hostile_hops": self.hops, "hostile_most_bytes": self.most_sent}

    def note(self) -> str:
        return (
            f"; engine-{self.mode}: {self.hops} hops reached it, the most bytes written on one before the gateway "
            f"closed it {self.most_sent / 2**20:.1f} MiB, {self.health} health checks answered"
        )


class HostileAgent(StubEngine):
    """A stub engine whose hello names the hostile server's URL: hello and telemetry as an honest engine's."""

    def __init__(self, config: StubConfig, bus: Bus, url: str) -> None:
        super().__init__(config, bus)
        self._url = url

    @property
    def base_url(self) -> str:
        return self._url


def manifest_entry(engine_id: str, port: int, model: str) -> dict[str, object]:
    """The hostile engine's manifest entry: listed, as a compromised engine is."""
    return {"role": "dp", "base_url": f"http://127.0.0.1:{port}", "model": model, "ep_group": engine_id, "dp_rank": 0}


async def start_hostile(
    mode: str, engine_id: str, bus: Bus, model: str, port: int = 0
) -> tuple[HostileServer, HostileAgent]:
    """The server on `port` (the manifest's) and its agent on `bus` (connected as `engine_user(engine_id)`)."""
    server = HostileServer(mode)
    url = await server.start(port)
    agent = HostileAgent(StubConfig(engine_id=engine_id, role="dp", model=model), bus, url)
    await agent.start(0)
    return server, agent


async def stop_hostile(server: HostileServer, agent: HostileAgent) -> None:
    await agent.stop()
    await server.stop()
