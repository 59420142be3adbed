"""Issue 25, item 6 and the bus rules: engines' KV-cache events on a real nats-server with the generated
per-role configuration (router, gateway and each engine as its own user; attackers publish raw bytes).

What must hold: the router reads `sy.engine.*.kv` under its own user and routes by it; one engine's credential
cannot publish on another's KV subject (the server refuses), and a message on its own subject naming another
engine is rejected and counted; a flood of stored keys from one engine leaves the index at `max_blocks` for
that engine and the other engine's blocks intact; events at a block size not the engine's hello's, or from an
engine without a hello, are refused and counted; the gateway may read KV events (its prefill choice), a
dashboard may not.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
import numpy as np

from switchyard.services.router.service import RouterService
from switchyard.shared.bus import Bus, rejected_count
from switchyard.shared.codec import encode
from switchyard.shared.nats_auth import engine_user
from switchyard.shared.prefix_keys import block_keys
from tests import test_nats_permissions
from tests.gateway_helpers import metric, wait_for
from tests.test_nats_permissions import SecuredNats, _received
from tests.test_prefix_router import KEYS, FakeEngine, route, router_settings, stored

secured = test_nats_permissions.secured  # the real nats-server with the generated per-role configuration


@dataclass
class Secured:
    router: RouterService
    engines: dict[str, FakeEngine]
    gateway: Bus  # asks route.dp, as the gateway does

    def blocks(self, engine_id: str) -> int:
        return self.router.core.prefix.blocks.blocks(engine_id)


@contextlib.asynccontextmanager
async def secured_fleet(secured: SecuredNats, **router: object) -> AsyncIterator[Secured]:
    """A router as `router`, engines e0 and e1 each on a raw connection as their own user, a gateway user."""
    settings = secured.settings()
    service = RouterService(settings, router_settings(**router))
    connections: list[nats.NATS] = []
    gateway = await Bus.connect(settings, name="gateway", role="gateway")
    await service.start()
    try:
        engines = {}
        for engine_id in ("e0", "e1"):
            nc = await secured.raw(engine_user(engine_id))
            connections.append(nc)
            engines[engine_id] = engine = FakeEngine(nc, secured.subjects, engine_id)
            await engine.hello()
            await engine.report()
        fleet = service.core.fleet
        await wait_for(lambda: all(e in fleet.index and fleet.role[fleet.index[e]] >= 0 for e in engines))
        await wait_for(lambda: all(fleet.last_seq[fleet.index[e]] >= 0 for e in engines))
        yield Secured(service, engines, gateway)
    finally:
        await service.stop()
        await gateway.close()
        for nc in connections:
            await nc.close()


def _kv_violations(secured: SecuredNats) -> list[str]:
    return [line for line in secured.violations() if ".kv" in line]


async def test_the_router_reads_kv_events_under_its_own_user(secured: SecuredNats) -> None:
    """Positive control for the rest: e1's own events reach the router (its `router` user may subscribe to
    `sy.engine.*.kv`), and the keyed request goes to e1 (by pressure alone it goes to e0). Old code: the
    router neither subscribed nor may it (a subscription violation), so e0."""
    async with secured_fleet(secured) as fleet:
        await fleet.engines["e1"].kv(stored(KEYS))
        await wait_for(lambda: fleet.blocks("e1") == len(KEYS))
        assert await route(fleet.gateway) == "e1"
    assert not [line for line in _kv_violations(secured) if "router" in line]


async def test_an_engine_cannot_publish_on_another_engines_kv_subject(secured: SecuredNats) -> None:
    """e0's credential publishing e1's events on e1's subject (raw bytes): the server refuses them, so the
    router indexes only what e1 itself sends. Held already by the engine grant (`<p>.engine.<own id>.>`)."""
    forged = block_keys(np.arange(4096) + 777, 16)  # 256 blocks e1 never stored
    async with secured_fleet(secured) as fleet:
        e0, e1 = fleet.engines["e0"], fleet.engines["e1"]
        message = e1.events(stored(forged), seq=0)
        await e0.nc.publish(secured.subjects.kv_events("e1"), encode(message))
        await e0.nc.flush()
        await e1.kv(stored(KEYS[:8]), seq=1)  # the real e1 (its seq follows the forged one's)
        await wait_for(lambda: fleet.blocks("e1") == 8)
        await asyncio.sleep(0.2)
        assert fleet.blocks("e1") == 8 and fleet.blocks("e0") == 0
        assert fleet.router.core.prefix.blocks.match(forged[:4].tolist(), ["e0", "e1"]).tolist() == [0, 0]
    assert any(secured.subjects.kv_events("e1") in line for line in _kv_violations(secured))


async def test_a_message_on_its_own_subject_naming_another_engine_is_rejected(secured: SecuredNats) -> None:
    """e0, on its own subject, claims to be e1: rejected by the router's subscription and counted
    (`switchyard_bus_rejected_total{code="engine_id_mismatch"}`); e1's index is untouched. Old code: nothing
    read KV events, so nothing was counted."""
    subscription = secured.subjects.all_kv_events
    before = rejected_count(subscription, "engine_id_mismatch")
    async with secured_fleet(secured) as fleet:
        e0 = fleet.engines["e0"]
        await e0.kv(stored(KEYS), engine_id="e1")
        await e0.kv(stored(KEYS[:1]))  # e0's own, after it on the same connection: the marker
        await wait_for(lambda: fleet.blocks("e0") == 1)
        assert fleet.blocks("e1") == 0
        assert rejected_count(subscription, "engine_id_mismatch") == before + 1
        assert await route(fleet.gateway) == "e0"  # what e0 holds (1 block) is all it attracts: the tie's pick


async def test_a_flood_of_stored_keys_stays_within_the_engines_share(secured: SecuredNats) -> None:
    """e0 stores 80,000 distinct keys in 20 messages; the router holds `prefix_max_blocks` (64) of them, its
    newest, and e1's 64 blocks are intact and still draw e1's prompt. Old code: no index (and no bound)."""
    dropped = metric("switchyard_router_prefix_dropped_total")
    async with secured_fleet(secured, prefix_max_blocks=64) as fleet:
        e0, e1 = fleet.engines["e0"], fleet.engines["e1"]
        await e1.kv(stored(KEYS))
        await wait_for(lambda: fleet.blocks("e1") == len(KEYS))
        rng = np.random.default_rng(7)
        for _ in range(20):
            await e0.kv(stored(rng.integers(1, 2**63, size=4000, dtype=np.uint64)))
        last = e0.kv_seq - 1
        prefix = fleet.router.core.prefix
        await wait_for(lambda: prefix.applier.last("e0") == last, timeout_s=30)
        assert fleet.blocks("e0") == 64 and fleet.blocks("e1") == len(KEYS)
        assert prefix.blocks.match(KEYS.tolist(), ["e0", "e1"]).tolist() == [0, len(KEYS)]
        assert len(prefix.blocks) == 128
        assert await route(fleet.gateway) == "e1"
        fleet.router.core.housekeeping(asyncio.get_running_loop().time())
    assert metric("switchyard_router_prefix_dropped_total") - dropped == 80_000 - 64


async def test_events_at_another_block_size_or_without_a_hello_are_refused(secured: SecuredNats) -> None:
    """e0 announced 16-token blocks: its events at 32 are refused (their keys name other blocks); p0 has a
    credential but said no hello: its events are refused too. Both counted. Old code: nothing was checked."""
    wrong = metric("switchyard_router_kv_rejected_total", reason="block_size")
    unknown = metric("switchyard_router_kv_rejected_total", reason="unknown_engine")
    async with secured_fleet(secured) as fleet:
        e0 = fleet.engines["e0"]
        await e0.kv(stored(KEYS), block_size=32)
        stranger = FakeEngine(await secured.raw(engine_user("p0")), secured.subjects, "p0")
        try:
            await stranger.kv(stored(KEYS))
        finally:
            await stranger.nc.close()
        await e0.kv(stored(KEYS[:3]))  # the marker, at the right size
        await wait_for(lambda: fleet.blocks("e0") == 3)
        await wait_for(lambda: metric("switchyard_router_kv_rejected_total", reason="unknown_engine") == unknown + 1)
        assert metric("switchyard_router_kv_rejected_total", reason="block_size") == wrong + 1
        assert fleet.blocks("p0") == 0


async def test_the_gateway_may_read_kv_events_a_dashboard_may_not(secured: SecuredNats) -> None:
    """The gateway's prefill choice reads the engines' KV events; `readonly` gets none (a subscription
    violation). Old code: the gateway's subscription was refused too."""
    gateway, readonly = await secured.raw("gateway"), await secured.raw("readonly")
    e1 = await secured.raw(engine_user("e1"))
    engine = FakeEngine(e1, secured.subjects, "e1")
    marker = encode(engine.events(stored(KEYS[:2])))

    async def send() -> None:
        await e1.publish(secured.subjects.kv_events("e1"), marker)
        await e1.flush()

    try:
        assert await _received(gateway, secured.subjects.all_kv_events, send, until=marker) == [marker]
        assert await _received(readonly, secured.subjects.all_kv_events, send) == []
    finally:
        for nc in (gateway, readonly, e1):
            await nc.close()
    refused = [line for line in _kv_violations(secured) if "Subscription" in line]
    assert any("readonly" in line for line in refused)
    assert not any("gateway" in line for line in refused)
