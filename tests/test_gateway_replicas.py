"""Gateways deciding in-process, as replicas behind a load balancer: they count each other's decisions
(`sy.route.decided.gateway.<id>`), so N of them split load like one (issue 27, item 2).

Real nats-server, stub engines as real HTTP servers, two `GatewayService`s in their default in-process shape and
no router. The engines' telemetry is stopped once the gateways know them (they stay live by the liveness rule
for a few seconds): what a gateway knows of the other's requests then comes from the shared decisions alone, so
the outcome does not depend on when a telemetry message happens to land.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.services.gateway.service import GatewayService
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import core_knows, wait_for

ENGINES = ("a", "b", "c", "d")
HOLD_S = 4.0  # each request stays in flight this long: longer than any burst below takes to route
BODY = {"model": "stub-model", "prompt": "hello there", "max_tokens": 4}


@contextlib.asynccontextmanager
async def replicas(settings: SwitchyardSettings, bus: Bus, n: int) -> AsyncIterator[list[GatewayService]]:
    stubs = [StubEngine(StubConfig(e, answer_delay_s=HOLD_S, telemetry_interval_s=1.0), bus) for e in ENGINES]
    for stub in stubs:
        await stub.start()
    routing = RouterSettings(fresh_load_s=10.0)
    gateways = [GatewayService(settings, GatewaySettings(port=0, gateway_id=f"g{i}"), routing) for i in range(n)]
    for gateway in gateways:
        await gateway.start()
    try:
        for gateway in gateways:
            assert gateway.core is not None  # the in-process shape is the default
            await wait_for(lambda g=gateway: core_knows(g.core, ENGINES) and len(g.registry.live()) == len(ENGINES))
        for stub in stubs:  # silent from here: no telemetry can tell a gateway what the other sent
            stub.saying_hello = False
        yield gateways
    finally:
        for gateway in gateways:
            await gateway.stop()
        for stub in stubs:
            await stub.stop()


async def _send(client: httpx.AsyncClient, url: str) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(client.post(f"{url}/v1/completions", json=BODY))


async def _own_decisions(gateway: GatewayService, n: int) -> None:
    """Wait until `gateway`'s core holds `n` decisions in flight (its own and those shared with it)."""
    core = gateway.core
    assert core is not None
    await wait_for(lambda: int(core.fleet.ledger.count.sum()) >= n)


@pytest.mark.parametrize("shared", [True, False])
async def test_a_second_gateway_sends_where_the_first_did_not(
    bus: Bus, settings: SwitchyardSettings, shared: bool
) -> None:
    """Three requests through gateway 0, then one through gateway 1: shared decisions send the fourth to the
    one idle engine. The control (gateway 0's decisions not shared) herds: gateway 1 sees four idle engines
    and puts its request on one gateway 0 already loaded."""
    async with replicas(settings, bus, 2) as (g0, g1), httpx.AsyncClient(timeout=30) as client:
        if not shared:
            g0.ctx.router.sharer = None  # type: ignore[union-attr]
        first = [await _send(client, g0.url) for _ in range(3)]
        await _own_decisions(g0, 3)
        if shared:
            await _own_decisions(g1, 3)  # gateway 0's batch has reached gateway 1
        else:
            await asyncio.sleep(0.2)  # what sharing takes, several times over
        last = await _send(client, g1.url)
        answers = await asyncio.gather(*first, last)
    assert all(a.status_code == 200 for a in answers)
    engines = [a.json()["served_by"] for a in answers]
    per_engine = Counter(engines)
    if shared:
        assert sorted(per_engine.values()) == [1, 1, 1, 1], engines
    else:
        assert max(per_engine.values()) == 2, engines  # the herd the sharing prevents


async def test_two_gateways_split_a_burst_like_one(bus: Bus, settings: SwitchyardSettings) -> None:
    """A burst of 16 requests alternating over two gateways lands as evenly as through one gateway.

    Tolerance: each engine within one request of its share (16 / 4 = 4), and the spread (most − fewest per
    engine) at most one more than one gateway's: decisions made while the other gateway's batch is still on the
    wire (≤ a few ms) may not have seen it."""
    burst = 16
    share = math.ceil(burst / len(ENGINES))

    async def spread(n_gateways: int) -> Counter[str]:
        async with replicas(settings, bus, n_gateways) as gateways, httpx.AsyncClient(timeout=30) as client:
            tasks = [await _send(client, gateways[i % n_gateways].url) for i in range(burst)]
            answers = await asyncio.gather(*tasks)
        assert all(a.status_code == 200 for a in answers)
        return Counter(a.json()["served_by"] for a in answers)

    one = await spread(1)
    two = await spread(2)
    assert set(two) == set(ENGINES)
    assert max(two.values()) <= share + 1 and min(two.values()) >= share - 1, two
    assert max(two.values()) - min(two.values()) <= max(one.values()) - min(one.values()) + 1, (one, two)
