"""Issue 29, item 1: one engine's credential cannot take client traffic.

Each attack runs on a real nats-server with the generated per-role configuration: gateway, router and stub
engines each connect as their own user, and the attacker holds only `engine-e0`'s password, publishing raw
hellos that the server lets through (its own subjects). What must hold:

- a hello announcing `role: "dp"` and the attacker's `base_url` does not switch a live disaggregated fleet to
  DP (no manifest: the fleet keeps its mode; with a manifest: the hello is refused by gateway and router);
- an engine that announced a 60 s hello interval and died leaves the gateway after the operator's
  `SWITCHYARD_LIVENESS_MAX_SILENCE_S`, not after three of its own intervals;
- a fake prefill engine that black-holes its hops is ejected after `eject_after_failures` and comes back only
  when its own `/health` answers, whatever hellos it keeps sending.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import pytest

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.services.gateway.service import GatewayService
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared import schemas as s
from switchyard.shared.bus import Bus
from switchyard.shared.codec import encode
from switchyard.shared.engine_manifest import EngineEntry, EngineManifest
from switchyard.shared.liveness import Liveness
from switchyard.shared.nats_auth import engine_user
from tests import test_nats_permissions
from tests.gateway_helpers import metric, router_knows, wait_for
from tests.test_nats_permissions import SecuredNats

secured = test_nats_permissions.secured  # the real nats-server with the generated per-role configuration

BODY = {"model": "stub-model", "prompt": "hello there", "max_tokens": 2}


def _attacker_hello(role: str, base_url: str, interval_s: float = 60.0) -> s.Hello:
    return s.Hello(
        engine_id="e0",
        role=role,  # type: ignore[arg-type]
        model=s.ModelShape(name="stub-model", num_layers=2, num_experts=4, top_k=1),
        ep_group="e0",
        gpus=["0"],
        capacity=s.Capacity(max_running=256, kv_blocks=1000, block_size=16),
        ts=time.time(),
        agent="sim",
        hello_interval_s=interval_s,
        telemetry_interval_s=1.0,
        base_url=base_url,
    )


@contextlib.asynccontextmanager
async def _attacker(secured: SecuredNats) -> AsyncIterator[nats.NATS]:
    nc = await secured.raw(engine_user("e0"))
    try:
        yield nc
    finally:
        await nc.close()


async def _say(nc: nats.NATS, secured: SecuredNats, hello: s.Hello) -> None:
    await nc.publish(secured.subjects.hello("e0"), encode(hello.model_copy(update={"ts": time.time()})))
    await nc.flush()


@contextlib.asynccontextmanager
async def _disaggregated_fleet(
    secured: SecuredNats, tmp_path: Path, gateway: GatewaySettings, *, manifest_for_e0: EngineEntry | None = None
) -> AsyncIterator[tuple[GatewayService, RouterService, dict[str, StubEngine]]]:
    """A real prefill p0 and decoder d0 (stubs, each as its engine user), a router and a gateway (each as its
    own user); with `manifest_for_e0`, an engine manifest binding p0, d0 and e0 is written and enforced."""
    settings = secured.settings()
    engines: dict[str, StubEngine] = {}
    buses: list[Bus] = []
    for config in (StubConfig("p0", role="prefill"), StubConfig("d0", role="decode")):
        bus = await Bus.connect(settings, name=config.engine_id, role=engine_user(config.engine_id))
        buses.append(bus)
        engines[config.engine_id] = StubEngine(config, bus)
    for engine in engines.values():
        await engine.start()
    if manifest_for_e0 is not None:
        entries = {e: EngineEntry(role=engine.config.role, base_url=engine.base_url) for e, engine in engines.items()}  # type: ignore[arg-type]
        path = tmp_path / "engines.json"
        path.write_text(EngineManifest({**entries, "e0": manifest_for_e0}).to_json())
        settings = secured.settings(engine_manifest=path)
    router = RouterService(settings, RouterSettings(inflight_grace_s=0.0, fresh_load_s=5.0))
    service = GatewayService(settings, gateway)
    try:
        await router.start()
        await service.start()
        await wait_for(lambda: len(service.registry.live()) == 2)
        await wait_for(lambda: router_knows(router, ["p0", "d0"]))
        yield service, router, engines
    finally:
        await service.stop()
        await router.stop()
        for engine in engines.values():
            await engine.stop()
        for bus in buses:
            await bus.close()


def _gateway(**extra: object) -> GatewaySettings:
    return GatewaySettings(port=0, route_timeout_s=2.0, signature_wait_s=0.0, **extra)  # type: ignore[arg-type]


async def _served_by(service: GatewayService, n: int) -> list[str]:
    """`n` requests with distinct prompts (the prefill choice hashes the prompt), by who answered each."""
    async with httpx.AsyncClient(base_url=service.url, timeout=30) as client:
        answers = [await client.post("/v1/completions", json={**BODY, "prompt": f"hello {i}"}) for i in range(n)]
    return [
        a.json().get("served_by", f"status {a.status_code}") if a.status_code == 200 else f"status {a.status_code}"
        for a in answers
    ]


async def test_a_dp_hello_does_not_switch_a_live_disaggregated_fleet(secured: SecuredNats, tmp_path: Path) -> None:
    """No manifest: the attacker's engine joins (its id is its own), but the live prefill/decode fleet keeps
    its mode, so no client request (prompt included) reaches the attacker's URL. On the old code 61 of 61
    did."""
    thief = StubEngine(StubConfig("e0", role="dp"))  # the attacker's own HTTP server, answering 200
    await thief.start()
    try:
        async with _disaggregated_fleet(secured, tmp_path, _gateway()) as (service, _router, _engines):
            assert await _served_by(service, 2) == ["d0", "d0"]
            async with _attacker(secured) as nc:
                await _say(nc, secured, _attacker_hello("dp", thief.base_url))
                await wait_for(lambda: service.registry.get_live("e0") is not None)
                served = await _served_by(service, 12)
    finally:
        await thief.stop()
    assert thief.received == []
    assert served == ["d0"] * 12


async def test_with_a_manifest_a_hello_claiming_another_role_or_url_is_refused(
    secured: SecuredNats, tmp_path: Path
) -> None:
    """With a manifest e0 is a listed decoder at its own URL; its hello claiming `dp` (or its decoder role at
    another URL) is refused by the gateway and the router, counted, and takes no request."""
    thief = StubEngine(StubConfig("e0", role="dp"))
    await thief.start()
    refused_gateway = metric("switchyard_gateway_hellos_refused_total", reason="role")
    refused_router = metric("switchyard_router_hellos_refused_total", reason="role")
    refused_url = metric("switchyard_gateway_hellos_refused_total", reason="base_url")
    listed = EngineEntry(role="decode", base_url="http://127.0.0.1:9/")
    try:
        async with _disaggregated_fleet(secured, tmp_path, _gateway(), manifest_for_e0=listed) as (
            service,
            router,
            _engines,
        ):
            async with _attacker(secured) as nc:
                await _say(nc, secured, _attacker_hello("dp", thief.base_url))
                await _say(nc, secured, _attacker_hello("decode", thief.base_url))
                refusals = ("switchyard_gateway_hellos_refused_total", "switchyard_router_hellos_refused_total")
                await wait_for(lambda: metric(refusals[0], reason="base_url") > refused_url)
                await wait_for(lambda: metric(refusals[1], reason="role") > refused_router)
                served = await _served_by(service, 12)
            assert "e0" not in service.registry.engines
            assert "e0" not in router.core.fleet.index or router.core.fleet.role[router.core.fleet.index["e0"]] < 0
    finally:
        await thief.stop()
    assert metric("switchyard_gateway_hellos_refused_total", reason="role") > refused_gateway
    assert thief.received == []
    assert served == ["d0"] * 12


async def test_the_gateway_bounds_staleness_by_its_own_setting(
    secured: SecuredNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that announced a 60 s hello interval and then went silent is dropped after the operator's
    `max_silence_s` (`SWITCHYARD_LIVENESS_MAX_SILENCE_S`, here 1 s; the gateway's own override is gone), not
    after 3 x 60 s of its own choosing (the old code kept it 181 s)."""
    monkeypatch.setenv("SWITCHYARD_LIVENESS_MAX_SILENCE_S", "1")
    async with _disaggregated_fleet(secured, tmp_path, _gateway()) as (service, _router, _engines):
        async with _attacker(secured) as nc:
            await _say(nc, secured, _attacker_hello("prefill", "http://127.0.0.1:9"))
            await wait_for(lambda: service.registry.get_live("e0") is not None)
            said_at = time.monotonic()
        await wait_for(lambda: service.registry.get_live("e0") is None, timeout_s=20)
        assert time.monotonic() - said_at < 20  # bounded by the gateway's 1 s, far below the sender's 180 s
        assert {e.engine_id for e in service.registry.live()} == {"p0", "d0"}  # the real ones stayed


class _BlackHole:
    """An HTTP server that accepts connections and never answers, until `healthy` (then 200 to anything)."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []  # request lines
        self.healthy = False
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            self.requests.append(await reader.readline())
            while not self.healthy:
                if reader.at_eof():
                    return
                await asyncio.sleep(0.05)
            await reader.readuntil(b"\r\n\r\n")  # the rest of the headers
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
        writer.close()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


async def test_a_failing_prefill_engine_is_ejected_and_back_only_on_its_own_health(
    secured: SecuredNats, tmp_path: Path
) -> None:
    """No manifest: e0 joins as a prefill engine whose URL takes connections and never answers. It is tried
    at most `eject_after_failures` times (each costing the client a prefill timeout), then out of rotation
    while it keeps saying hello; when its `/health` answers it is put back. On the old code it drew about
    half of the prefill hops for as long as it said hello."""
    hole = _BlackHole()
    url = await hole.start()
    gateway = _gateway(prefill_timeout_s=0.5, eject_after_failures=2, health_check_interval_s=0.2)
    try:
        async with (
            _disaggregated_fleet(secured, tmp_path, gateway) as (service, _router, engines),
            _attacker(secured) as nc,
        ):
            hello = _attacker_hello("prefill", url, interval_s=0.5)
            await _say(nc, secured, hello)
            await wait_for(lambda: service.registry.get_live("e0") is not None)
            keep_saying = asyncio.create_task(_keep_saying(nc, secured, hello))
            try:
                served = await _served_by(service, 16)
                ejected = [e.engine_id for e in service.registry.ejected()]
                tried = sum(line.startswith(b"POST") for line in hole.requests)
                await asyncio.sleep(1.0)  # hellos keep coming, health checks keep failing
                still_out = service.registry.get_live("e0") is None
                hole.healthy = True
                await wait_for(lambda: service.registry.get_live("e0") is not None)
            finally:
                keep_saying.cancel()
    finally:
        await hole.stop()
    assert served == ["d0"] * 16  # every client was answered (the failed hops retried on p0)
    assert ejected == ["e0"] and still_out
    assert tried <= 2, f"the black hole drew {tried} prefill hops of 16"
    assert len(engines["p0"].received) >= 16


async def _keep_saying(nc: nats.NATS, secured: SecuredNats, hello: s.Hello) -> None:
    while True:
        await _say(nc, secured, hello)
        await asyncio.sleep(0.2)


def test_a_fleet_keeps_its_mode_and_the_incumbents_win() -> None:
    """The mode rule itself (pure): a live fleet keeps its mode whatever joins; it changes only when the
    current mode has no live engines; where both can serve from the start, the longer-live engines win."""
    from switchyard.services.gateway.registry import GatewayRegistry

    def hello(engine_id: str, role: str) -> s.Hello:
        return _attacker_hello(role, f"http://{engine_id}", interval_s=1.0).model_copy(update={"engine_id": engine_id})

    registry = GatewayRegistry(liveness=Liveness(3.0, 3.0))
    registry.on_hello(hello("p0", "prefill"), now=0.0)
    registry.on_hello(hello("d0", "decode"), now=0.0)
    assert registry.mode("stub-model", now=0.1) == "disagg"
    registry.on_hello(hello("x", "dp"), now=1.0)
    assert registry.mode("stub-model", now=1.1) == "disagg"
    registry.on_hello(hello("x", "dp"), now=3.5)  # p0 and d0 went silent at 0: stale at 3
    assert registry.mode("stub-model", now=3.6) == "dp"
    fresh = GatewayRegistry(liveness=Liveness(3.0, 3.0))
    fresh.on_hello(hello("x", "dp"), now=0.0)
    fresh.on_hello(hello("p0", "prefill"), now=0.5)
    fresh.on_hello(hello("d0", "decode"), now=0.5)
    assert fresh.mode("stub-model", now=0.6) == "dp"
    assert fresh.mode("other-model", now=0.6) is None


@pytest.mark.parametrize(
    ("spec", "error"),
    [("e0:gpu:http://x", "expected ID"), ("e0:g0:0,e0", "given twice"), ("e 0", "engine id")],
)
def test_engine_specs_are_checked(spec: str, error: str) -> None:
    from switchyard.shared.engine_manifest import parse_engine_specs

    with pytest.raises(ValueError, match=error):
        parse_engine_specs(spec)


def _nats_config(tmp_path: Path, engines: str, *more: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    argv = [sys.executable, "-m", "switchyard.cli", "nats-config", "--out", str(tmp_path / "conf")]
    return subprocess.run([*argv, "--engines", engines, *more], capture_output=True, text=True, env=env)


def test_nats_config_binds_role_and_url_and_refuses_a_bad_spec_in_one_line(tmp_path: Path) -> None:
    done = _nats_config(tmp_path, "p0:prefill:http://10.0.0.5:8100,d0:decode:http://10.0.0.6:8200:g1:3,x")
    assert done.returncode == 0, done.stderr
    manifest = EngineManifest.load(tmp_path / "conf" / "engines.json")
    assert manifest.entries["p0"] == EngineEntry(role="prefill", base_url="http://10.0.0.5:8100")
    d0 = EngineEntry(role="decode", base_url="http://10.0.0.6:8200", ep_group="g1", dp_rank=3)
    assert manifest.entries["d0"] == d0
    assert manifest.entries["x"] == EngineEntry()  # listed, nothing bound
    warned = [line for line in done.stderr.splitlines() if line.startswith("warning: engine ")]
    assert len(warned) == 1 and "engine x is given without ROLE:URL" in warned[0], done.stderr  # d0, p0 bound
    bad = _nats_config(tmp_path, "p0:gpu:http://x")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "--engines" in bad.stderr


def test_nats_config_lists_every_engine_it_is_given_and_warns_on_bare_ids(tmp_path: Path) -> None:
    """Issue 37, item 12: bare ids (and a simulated fleet's ids) are listed too, so strict mode takes exactly
    them; each `--engines` id without ROLE:URL gets a warning (it binds nothing but the id). On the old code
    no engines.json was written for bare ids: every service then either took any engine or, strict, none."""
    done = _nats_config(tmp_path, "a,b:g0:1", "--fleet-engines", "sim-p0,sim-d0")
    assert done.returncode == 0, done.stderr
    manifest = EngineManifest.load(tmp_path / "conf" / "engines.json")
    assert set(manifest.entries) == {"a", "b", "sim-p0", "sim-d0"}
    assert manifest.entries["b"] == EngineEntry(ep_group="g0", dp_rank=1)
    assert manifest.entries["sim-p0"] == EngineEntry()
    warned = sorted(line.split()[2] for line in done.stderr.splitlines() if line.startswith("warning: engine "))
    assert warned == ["a", "b"], done.stderr
