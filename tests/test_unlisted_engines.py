"""Issue 37, item 12: an engine no manifest lists gets no client traffic on the production path.

Without a manifest, a new prefill engine (a valid engine credential, its own HTTP server) took its share of the
prefill hops, prompts included: 10 of 30 with a 2P fleet. Per-role NATS credentials now make strict mode the
default (`SWITCHYARD_ENGINE_STRICT`): the gateway, the router and the fleet view (placement, migration, the API)
refuse the hello of every engine no manifest lists, and with no manifest at all that is every engine (nothing
is routed rather than prompts sent to whoever holds an engine password) until the operator gives a manifest or
opts out (`SWITCHYARD_ENGINE_STRICT=false`). Each test runs on a real nats-server with the generated per-role
configuration; the attacker holds only `engine-e0`'s password and serves its own HTTP.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.services.fleet_view import FleetView
from switchyard.services.gateway.service import GatewayService
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.engine_manifest import EngineEntry, EngineManifest
from switchyard.shared.nats_auth import engine_user
from switchyard.shared.settings import SwitchyardSettings
from tests import test_nats_permissions
from tests.gateway_helpers import metric, wait_for
from tests.test_engine_binding import BODY, _attacker, _attacker_hello, _gateway, _say
from tests.test_nats_permissions import SecuredNats

secured = test_nats_permissions.secured  # the real nats-server with the generated per-role configuration

REQUESTS = 30


@contextlib.asynccontextmanager
async def _two_engines(secured: SecuredNats) -> AsyncIterator[dict[str, StubEngine]]:
    """A real prefill p0 and decoder d0 (stubs, each as its own engine user)."""
    settings = secured.settings()
    engines: dict[str, StubEngine] = {}
    buses: list[Bus] = []
    try:
        for config in (StubConfig("p0", role="prefill"), StubConfig("d0", role="decode")):
            bus = await Bus.connect(settings, name=config.engine_id, role=engine_user(config.engine_id))
            buses.append(bus)
            engines[config.engine_id] = StubEngine(config, bus)
            await engines[config.engine_id].start()
        yield engines
    finally:
        for engine in engines.values():
            await engine.stop()
        for bus in buses:
            await bus.close()


@contextlib.asynccontextmanager
async def _control_plane(settings: SwitchyardSettings) -> AsyncIterator[tuple[GatewayService, RouterService, Bus]]:
    """A router, a gateway and a fleet view (the API's, on the API's own user), each as its own user."""
    router = RouterService(settings, RouterSettings(inflight_grace_s=0.0, fresh_load_s=5.0))
    service = GatewayService(settings, _gateway())
    api = await Bus.connect(settings, name="api", role="api")
    try:
        await router.start()
        await service.start()
        yield service, router, api
    finally:
        await service.stop()
        await router.stop()
        await api.close()


async def _answers(service: GatewayService, n: int) -> list[str]:
    """`n` requests with distinct prompts (the prefill choice hashes the prompt): who answered, or the status."""
    async with httpx.AsyncClient(base_url=service.url, timeout=30) as client:
        answers = [await client.post("/v1/completions", json={**BODY, "prompt": f"hello {i}"}) for i in range(n)]
    return [a.json().get("served_by", "?") if a.status_code == 200 else f"status {a.status_code}" for a in answers]


def _refused(reason: str = "unlisted") -> tuple[float, float, float]:
    return (
        metric("switchyard_gateway_hellos_refused_total", reason=reason),
        metric("switchyard_router_hellos_refused_total", reason=reason),
        metric("switchyard_fleet_hellos_refused_total", reason=reason),
    )


def test_strict_mode_is_the_default_with_per_role_credentials(tmp_path: Path) -> None:
    """Per-role credentials are the production shape: strict unless the operator opts out; an open bus is not."""
    creds = tmp_path / "credentials.json"
    assert SwitchyardSettings(nats_credentials=creds).strict_engines
    assert SwitchyardSettings(nats_credentials=creds).engine_manifest_entries().entries == {}  # type: ignore[union-attr]
    assert not SwitchyardSettings(nats_credentials=creds, engine_strict=False).strict_engines
    assert SwitchyardSettings(nats_credentials=creds, engine_strict=False).engine_manifest_entries() is None
    assert not SwitchyardSettings().strict_engines
    assert SwitchyardSettings(engine_strict=True).engine_manifest_entries().entries == {}  # type: ignore[union-attr]


async def test_with_credentials_and_no_manifest_a_new_prefill_engine_takes_no_prompt(secured: SecuredNats) -> None:
    """The production default (per-role credentials, no manifest, no opt-out): the attacker's prefill hello is
    refused by gateway, router and fleet view (`unlisted`), and no prompt reaches its server; nothing is listed,
    so clients get 503 rather than an unbound engine. On the old code the attacker took 10 of 30 prefill hops."""
    thief = StubEngine(StubConfig("e0", role="prefill"))
    await thief.start()
    settings = secured.settings(engine_strict=None)  # the default, as deployed: strict with per-role users
    before = _refused()
    try:
        async with _two_engines(secured), _control_plane(settings) as (service, _router, api):
            view = FleetView(manifest=settings.engine_manifest_entries())
            await view.subscribe(api, "unlisted-test", telemetry=False)
            async with _attacker(secured) as nc:
                await _say(nc, secured, _attacker_hello("prefill", thief.base_url))
                await wait_for(lambda: all(a > b for a, b in zip(_refused(), before, strict=True)))
                answers = await _answers(service, REQUESTS)
            assert "e0" not in service.registry.engines and "e0" not in view.engines
            assert service.registry.live() == []  # nothing listed, nothing routed
    finally:
        await thief.stop()
    assert thief.received == []
    assert answers == ["status 503"] * REQUESTS


async def test_with_a_manifest_an_unlisted_prefill_engine_takes_no_prompt(secured: SecuredNats, tmp_path: Path) -> None:
    """A manifest listing p0 and d0, strict mode explicitly off (the manifest alone refuses the unlisted): the
    attacker's prefill hello is refused everywhere and all 30 requests go p0 -> d0. (This held before issue 37
    too: a guard.)"""
    thief = StubEngine(StubConfig("e0", role="prefill"))
    await thief.start()
    before = _refused()
    try:
        async with _two_engines(secured) as engines:
            path = tmp_path / "engines.json"
            entries = {e: EngineEntry(role=x.config.role, base_url=x.base_url) for e, x in engines.items()}  # type: ignore[arg-type]
            path.write_text(EngineManifest(entries).to_json())
            settings = secured.settings(engine_manifest=path, engine_strict=False)
            async with _control_plane(settings) as (service, _router, api):
                view = FleetView(manifest=settings.engine_manifest_entries())
                await view.subscribe(api, "unlisted-test", telemetry=False)
                await wait_for(lambda: len(service.registry.live()) == 2 and {"p0", "d0"} <= set(view.engines))
                async with _attacker(secured) as nc:
                    await _say(nc, secured, _attacker_hello("prefill", thief.base_url))
                    await wait_for(lambda: all(a > b for a, b in zip(_refused(), before, strict=True)))
                    answers = await _answers(service, REQUESTS)
                assert "e0" not in service.registry.engines and "e0" not in view.engines
    finally:
        await thief.stop()
    assert thief.received == []
    assert answers == ["d0"] * REQUESTS


@pytest.mark.parametrize("listed", [False, True], ids=["no-manifest", "bare-id-listed"])
async def test_opting_out_or_listing_an_id_lets_a_new_prefill_engine_take_prompts(
    secured: SecuredNats, tmp_path: Path, listed: bool
) -> None:
    """What the opt-out (`engine_strict=False`, no manifest), or a manifest entry binding nothing but the id
    (what `nats-config` now warns about), costs: the new prefill engine takes prefill hops, prompts included."""
    thief = StubEngine(StubConfig("e0", role="prefill"))
    await thief.start()
    extra: dict[str, object] = {"engine_strict": False}
    if listed:
        path = tmp_path / "engines.json"
        path.write_text(EngineManifest(dict.fromkeys(["p0", "d0", "e0"], EngineEntry())).to_json())
        extra = {"engine_manifest": path, "engine_strict": True}
    try:
        async with _two_engines(secured), _control_plane(secured.settings(**extra)) as (service, _router, _api):
            await wait_for(lambda: len(service.registry.live()) == 2)
            async with _attacker(secured) as nc:
                await _say(nc, secured, _attacker_hello("prefill", thief.base_url))
                await wait_for(lambda: service.registry.get_live("e0") is not None)
                answers = await _answers(service, REQUESTS)
    finally:
        await thief.stop()
    assert answers == ["d0"] * REQUESTS
    assert 0 < len(thief.received) < REQUESTS
