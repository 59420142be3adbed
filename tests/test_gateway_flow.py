"""Flow control in the gateway (issue 42 item 1): priority bands, tenant fairness, shedding, disconnects and
hostile header values, on a real nats-server with stub engines as real HTTP servers; the queue's order alone in
`FairQueue` tests.

The stub engine's `gate` holds every completion until the test opens it, so "saturated" is a state the test
sets (one engine, concurrency 1, one request held there), not a race against a timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
import pytest

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.services.gateway.admission import BadClass, classify
from switchyard.services.gateway.service import GatewayService
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings
from switchyard.solver.fairness import FairQueue, Full, Waiter
from tests.gateway_helpers import FLOW_BODY, deployment, leave_queue, metric, prompts, queued, send, wait_for

BODY = FLOW_BODY


def _settings(**update: Any) -> GatewaySettings:
    return GatewaySettings(port=0, saturation_concurrency=1, **update)


@asynccontextmanager
async def _saturated(
    settings: SwitchyardSettings, bus: Bus, gateway: GatewaySettings
) -> AsyncIterator[tuple[GatewayService, StubEngine, httpx.AsyncClient, asyncio.Task[httpx.Response]]]:
    """One engine (concurrency 1) holding one request behind its closed gate: the fleet is saturated."""
    async with (
        deployment(settings, bus, [StubConfig("a")], gateway=gateway, shape="inprocess") as (gw, engines),
        httpx.AsyncClient(base_url=gw.url, timeout=30) as client,
    ):
        engine = engines["a"]
        engine.gate = asyncio.Event()
        blocker = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "prompt": "blocker"}))
        await wait_for(lambda: engine.running == 1)
        try:
            yield gw, engine, client, blocker
        finally:
            engine.gate.set()
            await blocker


async def test_a_high_band_overtakes_a_queued_low_band(bus: Bus, settings: SwitchyardSettings) -> None:
    async with _saturated(settings, bus, _settings()) as (gw, engine, client, blocker):
        low = [send(client, f"low{i}", **{"x-switchyard-priority": "low"}) for i in range(2)]
        await wait_for(lambda: queued(gw) == 2)
        high = send(client, "high", **{"x-switchyard-priority": "high"})
        await wait_for(lambda: queued(gw) == 3)
        assert prompts(engine) == ["blocker"]  # nothing passed the saturated fleet
        assert engine.gate is not None
        engine.gate.set()
        answers = await asyncio.gather(blocker, high, *low)
    assert [a.status_code for a in answers] == [200] * 4  # nothing admitted is lost
    assert metric("switchyard_gateway_queue_depth", band="low") == 0
    assert metric("switchyard_gateway_prompt_tokens_total", model_name="stub-model") > 0
    assert prompts(engine) == ["blocker", "high", "low0", "low1"]


async def test_two_tenants_stay_within_one_request_of_each_other(bus: Bus, settings: SwitchyardSettings) -> None:
    async with _saturated(settings, bus, _settings()) as (gw, engine, client, _blocker):
        first = [send(client, f"A{i}", **{"x-switchyard-tenant": "tenant-a"}) for i in range(6)]
        await wait_for(lambda: queued(gw) == 6)
        # The second tenant names itself by OpenAI's `user` field (no header): the fallback.
        late = [
            asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "prompt": f"B{i}", "user": "tenant-b"}))
            for i in range(3)
        ]
        await wait_for(lambda: queued(gw) == 9)
        assert engine.gate is not None
        engine.gate.set()
        answers = await asyncio.gather(*first, *late)
    assert all(a.status_code == 200 for a in answers)
    order = [p[0] for p in prompts(engine)[1:]]
    assert sorted(order) == ["A"] * 6 + ["B"] * 3
    # Equal costs: while both are queued, neither tenant gets more than one request ahead (first come, first
    # served would send all six of A's first).
    for n in range(1, 7):
        assert abs(order[:n].count("A") - order[:n].count("B")) <= 1, order
    assert order[6:] == ["A"] * 3


async def test_past_the_bounds_lower_bands_are_shed_first_with_retry_after(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    gateway = _settings(queue_max_requests=2, queue_max_per_tenant=2, retry_after_s=3)
    async with _saturated(settings, bus, gateway) as (gw, engine, client, _blocker):
        low = [send(client, f"low{i}", **{"x-switchyard-priority": "low"}) for i in range(2)]
        await wait_for(lambda: queued(gw) == 2)
        shed_before = metric("switchyard_gateway_shed_total", band="low", reason="shed")
        high = send(client, "high", **{"x-switchyard-priority": "high", "x-switchyard-tenant": "t"})
        shed = await low[1]  # the newest of the lowest band gave its place
        assert shed.status_code == 429 and shed.headers["retry-after"] == "3"
        assert shed.json()["error"]["type"] == "RateLimitError"
        assert metric("switchyard_gateway_shed_total", band="low", reason="shed") == shed_before + 1
        # Full, and nothing lower than the newcomer's band to shed: the newcomer is refused.
        refused = await client.post("/v1/completions", json=BODY, headers={"x-switchyard-priority": "low"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
        assert engine.gate is not None
        engine.gate.set()
        assert (await high).status_code == 200 and (await low[0]).status_code == 200
    assert "low1" not in prompts(engine)


async def test_a_request_waiting_too_long_is_answered_429(bus: Bus, settings: SwitchyardSettings) -> None:
    async with _saturated(settings, bus, _settings(queue_max_wait_s=0.2)) as (gw, engine, client, _blocker):
        answer = await client.post("/v1/completions", json=BODY)
        assert answer.status_code == 429 and "retry-after" in answer.headers
        assert queued(gw) == 0 and len(engine.received) == 1


async def test_a_client_that_disconnects_leaves_the_queue_at_once(bus: Bus, settings: SwitchyardSettings) -> None:
    async with _saturated(settings, bus, _settings()) as (gw, engine, client, _blocker):
        left_before = metric("switchyard_gateway_queue_abandoned_total", band="normal")
        await leave_queue(gw)
        assert metric("switchyard_gateway_queue_abandoned_total", band="normal") == left_before + 1
        stays = send(client, "stays")
        await wait_for(lambda: queued(gw) == 1)
        assert engine.gate is not None
        engine.gate.set()
        assert (await stays).status_code == 200
    assert prompts(engine) == ["blocker", "stays"]  # the one that left never reached the engine


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-switchyard-tenant", "t" * 5000),  # huge
        ("x-switchyard-tenant", "t\u00e9nant"),  # not ASCII
        ("x-switchyard-tenant", "two words"),
        ("x-switchyard-priority", "urgent"),
        ("x-switchyard-priority", "99"),
        ("x-session-id", "s" * 200),
    ],
)
async def test_hostile_header_values_get_a_clear_400(
    bus: Bus, settings: SwitchyardSettings, header: str, value: str
) -> None:
    async with (
        deployment(settings, bus, [StubConfig("a")], shape="inprocess") as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        answer = await client.post("/v1/completions", json=BODY, headers={header: value.encode()})
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == header
        # A long or non-ASCII OpenAI `user` is a valid body: served, its tenant a digest of it.
        served = await client.post("/v1/completions", json={**BODY, "user": "\u00fc" * 5000})
        assert served.status_code == 200
    assert len(engines["a"].received) == 1


def test_classify_reads_headers_then_the_user_field() -> None:
    headers = [(b"x-switchyard-priority", b"HIGH"), (b"x-session-affinity", b"s2"), (b"x-switchyard-session", b"s1")]
    klass = classify(headers, {"user": "u1"}, 1)
    assert (klass.band, klass.tenant, klass.session) == (2, "u1", "s1")  # Switchyard's own session header wins
    assert classify([(b"x-switchyard-tenant", b"t")], {"user": "u1"}, 0).tenant == "t"
    assert classify([], {"user": "ü" * 300}, 1).tenant.startswith("user#")
    assert len(classify([], {"user": "ü" * 300}, 1).tenant) < 64
    assert classify([(b"session_id", b"s3")], {"prompt_cache_key": "k"}, 1).session == "s3"
    assert classify([], {"prompt_cache_key": "k"}, 1).session == "k"
    with pytest.raises(BadClass):
        classify([(b"x-switchyard-priority", b"-1")], {}, 1)


def test_thousands_of_tenants_cost_bounded_memory() -> None:
    queue = FairQueue(max_queued=100, max_per_tenant=1, max_tenants=50)
    for i in range(5000):
        waiter = Waiter(i % 3, f"tenant-{i}", 1.0, float(i))
        with suppress(Full):
            queue.push(waiter)
        if i % 2:
            queue.pop()
        assert len(queue) <= 100 and len(queue.attained) <= max(50, len(queue) + 1)
    with pytest.raises(Full):  # one tenant, one queued request at most here
        queue.push(Waiter(0, "again", 1.0, 0.0))
        queue.push(Waiter(0, "again", 1.0, 0.0))


def test_an_idle_tenant_saves_no_credit() -> None:
    """A tenant that comes back after the other was served a lot starts level with it, not far behind."""
    queue = FairQueue(max_queued=100, max_per_tenant=100, max_tenants=10)
    for i in range(10):
        queue.push(Waiter(1, "busy", 10.0, float(i)))
    for _ in range(5):
        assert queue.pop().tenant == "busy"  # type: ignore[union-attr]
    for i in range(5):
        queue.push(Waiter(1, "back", 10.0, 100.0 + i))
    order = [queue.pop().tenant for _ in range(10)]  # type: ignore[union-attr]
    assert order[:4].count("back") <= 2, order


async def test_a_session_sticks_to_its_engine_until_that_engine_is_saturated(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    gateway = GatewaySettings(port=0, saturation_concurrency=2)
    stubs = [StubConfig("a"), StubConfig("b")]
    async with (
        deployment(settings, bus, stubs, gateway=gateway, shape="inprocess") as (gw, engines),
        httpx.AsyncClient(base_url=gw.url, timeout=30) as client,
    ):

        async def ask(prompt: str, session: str | None = None) -> str:
            headers = {"x-session-id": session} if session else {}
            answer = await client.post("/v1/completions", json={**BODY, "prompt": prompt}, headers=headers)
            assert answer.status_code == 200
            return str(answer.json()["served_by"])

        home = await ask("turn0", "s1")
        other = "b" if home == "a" else "a"
        # The core now prefers the other engine (a prefill backlog on the session's): a request without a session
        # goes there (the control), the session's next turns stay home.
        engines[home].config.waiting_prefill_tokens = 1_000_000
        assert gw.core is not None
        core = gw.core
        await wait_for(lambda: core.fleet.waiting_prefill[core.fleet.index[home]] > 0)
        assert await ask("no session") == other
        row = core.fleet.index[home]

        async def settled() -> None:
            """Home's telemetry has caught up with the turns sent there (the core counts each decision as
            outstanding until the engine's next report): its load is its own word again."""
            await wait_for(lambda: core.fleet.inflight[row] == 0 and core.fleet.num_running[row] == 0)

        turns = []
        for i in range(1, 4):
            await settled()
            turns.append(await ask(f"turn{i}", "s1"))
        assert turns == [home] * 3
        # Saturate home (two requests held there): the session's next request moves, and stays where it moved.
        await settled()
        engines[home].gate = asyncio.Event()
        held = [send(client, f"held{i}", **{"x-session-id": "s1"}) for i in range(2)]
        await wait_for(lambda: engines[home].running == 2)
        assert await ask("moved", "s1") == other
        engines[home].gate.set()
        assert all(a.status_code == 200 for a in await asyncio.gather(*held))
        assert await ask("after", "s1") == other
    assert metric("switchyard_gateway_session_routes_total", outcome="saturated") >= 1
