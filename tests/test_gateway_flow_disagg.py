"""Flow control on the prefill->decode path (issue 42 item 1): the same bands, shedding, disconnects and
expert-load charges as on the DP path, on a real nats-server with stub engines as real HTTP servers.

The fleet is one prefill engine (two in the first test) and one decoder at concurrency 1; the decoder's `gate`
holds one request's decode, so the fleet is saturated by its decoders while its prefill engines are idle (a request
holds a decoder for its whole decode): a queue gated, or let out, by the prefill engines' room would let requests
through.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import numpy as np
import pytest

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.services.gateway.service import GatewayService
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import FLOW_BODY, deployment, leave_queue, metric, prompts, queued, send, wait_for

BODY = FLOW_BODY
#: One expert of four in each layer: a footprint of 1/4.
NARROW = np.array([[3, 0, 0, 0], [0, 5, 0, 0]], dtype=np.uint16)


def _settings(**update: Any) -> GatewaySettings:
    return GatewaySettings(port=0, saturation_concurrency=1, signature_wait_s=2.0, **update)


Saturated = tuple[GatewayService, list[StubEngine], StubEngine, httpx.AsyncClient, asyncio.Task[httpx.Response]]


@asynccontextmanager
async def _saturated(
    settings: SwitchyardSettings,
    bus: Bus,
    gateway: GatewaySettings,
    signature_via: str = "response",
    prefills: int = 1,
) -> AsyncIterator[Saturated]:
    """Prefill engines ("p", then "p1", ...) and a decoder (concurrency 1), the decoder holding one request behind
    its closed gate."""
    stubs = [StubConfig("p", role="prefill", signature_via=signature_via), StubConfig("d", role="decode")]
    stubs += [StubConfig(f"p{i}", role="prefill", signature_via=signature_via) for i in range(1, prefills)]
    async with (
        deployment(settings, bus, stubs, gateway=gateway, shape="inprocess") as (gw, engines),
        httpx.AsyncClient(base_url=gw.url, timeout=30) as client,
    ):
        prefill, decoder = [e for e in engines.values() if e.config.role == "prefill"], engines["d"]
        decoder.gate = asyncio.Event()
        blocker = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "prompt": "blocker"}))
        await wait_for(lambda: decoder.running == 1)
        try:
            yield gw, prefill, decoder, client, blocker
        finally:
            decoder.gate.set()
            await blocker


async def test_a_high_band_overtakes_queued_low_ones_on_a_saturated_pd_fleet(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    """Two prefill engines with room and one busy decoder: the queue lets a request out only when both roles have
    room (the lesser of their free slots), so the low ones wait for the decoder, and the high one overtakes them."""
    async with _saturated(settings, bus, _settings(), prefills=2) as (gw, prefills, decoder, client, blocker):
        low = [send(client, f"low{i}", **{"x-switchyard-priority": "low"}) for i in range(2)]
        await wait_for(lambda: queued(gw) == 2)
        high = send(client, "high", **{"x-switchyard-priority": "high"})
        await wait_for(lambda: queued(gw) == 3)
        # The prefill engines had room all along: the decoder's saturation held them before their prefill.
        assert prompts(*prefills) == ["blocker"] and prompts(decoder) == ["blocker"]
        assert decoder.gate is not None
        decoder.gate.set()
        answers = await asyncio.gather(blocker, high, *low)
    assert [a.status_code for a in answers] == [200] * 4  # nothing admitted is lost
    decoded = prompts(decoder)
    assert decoded[:2] == ["blocker", "high"] and sorted(decoded[2:]) == ["low0", "low1"], decoded
    assert sorted(prompts(*prefills)) == ["blocker", "high", "low0", "low1"]
    assert metric("switchyard_gateway_queue_depth", band="low") == 0


async def test_past_the_bound_a_pd_request_is_shed_with_retry_after(bus: Bus, settings: SwitchyardSettings) -> None:
    gateway = _settings(queue_max_requests=2, queue_max_per_tenant=2, retry_after_s=3)
    async with _saturated(settings, bus, gateway) as (gw, (prefill,), decoder, client, _blocker):
        low = [send(client, f"low{i}", **{"x-switchyard-priority": "low"}) for i in range(2)]
        await wait_for(lambda: queued(gw) == 2)
        high = send(client, "high", **{"x-switchyard-priority": "high", "x-switchyard-tenant": "t"})
        shed = await low[1]  # the newest of the lowest band gave its place
        assert shed.status_code == 429 and shed.headers["retry-after"] == "3"
        assert shed.json()["error"]["type"] == "RateLimitError"
        refused = await client.post("/v1/completions", json=BODY, headers={"x-switchyard-priority": "low"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
        assert decoder.gate is not None
        decoder.gate.set()
        assert (await high).status_code == 200 and (await low[0]).status_code == 200
    assert "low1" not in prompts(prefill) and "low1" not in prompts(decoder)


async def test_a_client_that_disconnects_leaves_the_pd_queue(bus: Bus, settings: SwitchyardSettings) -> None:
    async with _saturated(settings, bus, _settings()) as (gw, (prefill,), decoder, client, _blocker):
        left_before = metric("switchyard_gateway_queue_abandoned_total", band="normal")
        aborts_before = metric("switchyard_gateway_client_aborts_total", kind="disagg")
        await leave_queue(gw)
        assert metric("switchyard_gateway_queue_abandoned_total", band="normal") == left_before + 1
        assert metric("switchyard_gateway_client_aborts_total", kind="disagg") == aborts_before + 1
        stays = send(client, "stays")
        await wait_for(lambda: queued(gw) == 1)
        assert decoder.gate is not None
        decoder.gate.set()
        assert (await stays).status_code == 200
    assert prompts(prefill) == ["blocker", "stays"] and prompts(decoder) == ["blocker", "stays"]


async def test_with_admission_off_nothing_queues_on_a_pd_fleet(bus: Bus, settings: SwitchyardSettings) -> None:
    """The control: the same saturated fleet without flow control sends the request straight through."""
    async with _saturated(settings, bus, _settings(admission=False)) as (gw, (prefill,), decoder, client, _blocker):
        assert gw.ctx is not None and gw.ctx.flow is None
        through = send(client, "through")
        await wait_for(lambda: decoder.running == 2)  # past the decoder's concurrency limit: nothing held it
        assert prompts(prefill) == ["blocker", "through"]
        assert decoder.gate is not None
        decoder.gate.set()
        assert (await through).status_code == 200


@pytest.mark.parametrize("via", ["bus", "response"])
async def test_a_queued_pd_request_is_charged_its_prefill_signature(
    bus: Bus, settings: SwitchyardSettings, via: str
) -> None:
    """Expert-load fairness (the default policy): the blocker's full signature teaches the fleet's mean (1), so
    the queued request is charged its weighted tokens x 1 as it leaves; its narrow signature (1/4 of the experts),
    from the prefill engine on the bus or in its answer, corrects its tenant's attained service to a quarter.
    Untracked, it would stay charged its full weighted tokens."""
    async with _saturated(settings, bus, _settings(), signature_via=via) as (gw, (prefill,), decoder, client, _):
        assert gw.ctx is not None and gw.ctx.flow is not None
        flow = gw.ctx.flow
        assert flow.expert_load and flow.footprints.fleet == pytest.approx(1.0)  # the blocker's signature
        prefill.config.signature = NARROW
        narrow = send(client, "narrow", **{"x-switchyard-tenant": "narrow"})
        await wait_for(lambda: queued(gw) == 1)
        (entry,) = [e for e in flow.tracked.values() if e.tenant == "narrow"]
        assert entry.share == pytest.approx(1.0)  # the estimate it will be charged: the fleet's mean
        assert decoder.gate is not None
        decoder.gate.set()
        assert (await narrow).status_code == 200
        await wait_for(lambda: entry not in flow.tracked.values())
        (state,) = flow.models.values()
        assert state.queue.attained["narrow"] == pytest.approx(entry.weighted * 0.25)
        assert flow.footprints.estimate("narrow") == pytest.approx(0.25)
