"""Session affinity shared across gateway replicas (issue 42 item 3): a session routed by one gateway sticks on
another, through the decisions they already share (`RouteDecisions.sessions`); what a peer says is bounded and
never pins a session on a saturated engine.

Real nats-server, stub engines as real HTTP servers, two in-process `GatewayService`s; the bounds alone on
`Sessions` and the wire schema.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.services.gateway.flow import Pressure
from switchyard.services.gateway.service import GatewayService
from switchyard.services.gateway.sessions import Sessions, session_key
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode, encode
from switchyard.shared.schemas import MAX_SHARED_DECISIONS, RouteDecisions
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import core_knows, metric, wait_for

BODY = {"model": "stub-model", "prompt": "hello there", "max_tokens": 4}


@contextlib.asynccontextmanager
async def _two_gateways(
    settings: SwitchyardSettings, bus: Bus
) -> AsyncIterator[tuple[list[GatewayService], dict[str, StubEngine]]]:
    stubs = {e: StubEngine(StubConfig(e), bus) for e in ("a", "b")}
    for stub in stubs.values():
        await stub.start()
    routing = RouterSettings(inflight_grace_s=0.0, fresh_load_s=5.0)
    gateways = [
        GatewayService(settings, GatewaySettings(port=0, gateway_id=f"g{i}", saturation_concurrency=2), routing)
        for i in range(2)
    ]
    for gateway in gateways:
        await gateway.start()
    try:
        for gateway in gateways:
            await wait_for(lambda g=gateway: core_knows(g.core, stubs) and len(g.registry.live()) == 2)
        yield gateways, stubs
    finally:
        for gateway in gateways:
            await gateway.stop()
        for stub in stubs.values():
            await stub.stop()


def _sessions(gateway: GatewayService) -> Sessions:
    assert gateway.ctx is not None and gateway.ctx.sessions is not None
    return gateway.ctx.sessions


async def _ask(client: httpx.AsyncClient, gateway: GatewayService, prompt: str, session: str | None = None) -> str:
    headers = {"x-session-id": session} if session else {}
    answer = await client.post(f"{gateway.url}/v1/completions", json={**BODY, "prompt": prompt}, headers=headers)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["served_by"])


async def test_a_session_routed_by_one_gateway_sticks_on_another(bus: Bus, settings: SwitchyardSettings) -> None:
    """s1 and s2 start on gateway 0; both engines then look alike to the cores except that the sessions' engine
    carries a prefill backlog, so the core sends elsewhere. Gateway 1 keeps s1 where gateway 0 put it; the
    controls: a request without a session id, and s2 with gateway 1 not learning (`on_sessions` off), go to the
    other engine."""
    async with _two_gateways(settings, bus) as ((g0, g1), stubs), httpx.AsyncClient(timeout=30) as client:
        home = await _ask(client, g0, "turn0", "s1")
        other = "b" if home == "a" else "a"
        await wait_for(lambda: session_key("s1") in _sessions(g1).learned)
        assert _sessions(g1).learned[session_key("s1")][0] == home
        stubs[home].config.waiting_prefill_tokens = 1_000_000  # the core now prefers the other engine
        for gateway in (g0, g1):
            core = gateway.core
            assert core is not None
            await wait_for(lambda c=core: c.fleet.waiting_prefill[c.fleet.index[home]] > 0)
        assert await _ask(client, g1, "no session") == other  # control: session ids removed
        assert await _ask(client, g1, "turn1", "s1") == home  # learned from gateway 0's decision
        # Control: gateway 1 not learning; gateway 0 pins s2 on `home` (it is the session's engine there) ...
        assert g1.feed is not None
        g1.feed.on_sessions = None
        _sessions(g0).served(session_key("s2"), g0.registry.engines[home])
        assert await _ask(client, g0, "s2 turn0", "s2") == home
        await asyncio.sleep(0.3)  # what sharing takes, several times over
        assert await _ask(client, g1, "s2 turn1", "s2") == other  # ... which gateway 1 never heard of
    assert metric("switchyard_gateway_session_routes_total", outcome="sticky") >= 2


async def test_a_forged_binding_never_pins_a_session_on_a_saturated_engine(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    """A peer (a leaked gateway password) publishes a binding of s9 to an engine the test saturates: gateway 0
    learns it, and routes s9 elsewhere while that engine has no room; bindings to unknown engines are refused."""
    async with _two_gateways(settings, bus) as ((g0, _g1), stubs), httpx.AsyncClient(timeout=30) as client:
        forged = RouteDecisions(
            replica_id="evil",
            kinds=["dp", "dp"],
            request_ids=["x1", "x2"],
            engine_ids=["a", "nowhere"],
            prompt_tokens=[1, 1],
            sessions=[session_key("s9"), session_key("s10")],
        )
        await bus.nc.publish(bus.subjects.decided("gateway", "evil"), encode(forged))
        await wait_for(lambda: session_key("s9") in _sessions(g0).learned)
        assert session_key("s10") not in _sessions(g0).learned
        assert _sessions(g0).refused.get("unknown_engine") == 1
        # Saturate "a": two requests held there, sent to the engine itself so no routing race decides where they
        # go; the gateway learns it from a's telemetry (running 2 of its limit 2). s9's forged binding to it is then
        # not used: the session table answers "saturated" and the request is routed as any other (where the
        # core's policy puts it: Gimbal's pressure does not count running requests, so possibly "a" too).
        stubs["a"].gate = asyncio.Event()
        at_a = f"{stubs['a'].base_url}/v1/completions"
        held = [asyncio.ensure_future(client.post(at_a, json={**BODY, "prompt": f"held{i}"})) for i in range(2)]
        saturated = metric("switchyard_gateway_session_routes_total", outcome="saturated")
        try:
            room = Pressure(g0.gateway, g0.core).room
            await wait_for(lambda: stubs["a"].running == 2 and room(g0.registry.engines["a"]) == 0)
            candidates = list(g0.registry.engines.values())
            assert _sessions(g0).sticky(session_key("s9"), candidates) is None  # known, but a has no room
            turn = asyncio.ensure_future(_ask(client, g0, "s9 turn", "s9"))
            await wait_for(
                lambda: metric("switchyard_gateway_session_routes_total", outcome="saturated") > saturated + 1
            )
        finally:
            stubs["a"].gate.set()
        assert all(a.status_code == 200 for a in await asyncio.gather(*held))
        assert await turn in ("a", "b")  # served, wherever the policy sent it
    assert metric("switchyard_gateway_session_routes_total", outcome="saturated") >= 1


class _Engine:
    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id


def _batch(sessions: list[str], engine: str = "a") -> RouteDecisions:
    n = len(sessions)
    return RouteDecisions(
        replica_id="peer",
        kinds=["dp"] * n,
        request_ids=[f"r{i}" for i in range(n)],
        engine_ids=[engine] * n,
        prompt_tokens=[1] * n,
        sessions=sessions,
    )


def test_peer_bindings_are_rate_bounded_and_never_push_out_own_ones() -> None:
    known: dict[str, Any] = {"a": _Engine("a"), "b": _Engine("b")}
    table = Sessions(lambda _e: 1, max_sessions=100, ttl_s=60.0, engines=known, learn_per_s=50.0)
    for i in range(100):
        table.served(session_key(f"own{i}"), known["b"], now=0.0)
    keys = [session_key(f"peer{i}") for i in range(MAX_SHARED_DECISIONS)]
    assert table.learn("gateway.peer", _batch(keys), now=1.0) == 50  # the burst, then the rate
    assert table.refused["rate"] == MAX_SHARED_DECISIONS - 50
    for second in range(2, 40):  # a flood at the rate, for long enough to fill the learned table many times
        table.learn("gateway.peer", _batch(keys[second * 50 : second * 50 + 50]), now=float(second))
    assert len(table.learned) == 100 and len(table.engines) == 100  # bounded, and own bindings all kept
    candidates: list[Any] = list(known.values())
    assert table.sticky(session_key("own0"), candidates, now=41.0) is known["b"]
    # A newer binding learned from a peer wins over an older own one (the session moved on the other replica).
    table.learn("gateway.other", _batch([session_key("own1")]), now=42.0)
    assert table.sticky(session_key("own1"), candidates, now=43.0) is known["a"]
    # Past the TTL, gone from both tables.
    assert table.sticky(session_key("own1"), candidates, now=200.0) is None


@pytest.mark.parametrize(
    "sessions",
    [
        ["x" * 10_000],  # huge
        ["séance0123456789"],  # non-ASCII
        ["ABCDEF0123456789"],  # not our hash's lowercase hex
        [session_key("s1"), session_key("s2")],  # more keys than decisions
        [session_key("s")] * (MAX_SHARED_DECISIONS + 1),  # past the column's bound
    ],
)
def test_hostile_session_keys_are_refused_at_the_door(sessions: list[str]) -> None:
    with pytest.raises(ValidationError):
        RouteDecisions(
            replica_id="peer", kinds=["dp"], request_ids=["r"], engine_ids=["a"], prompt_tokens=[1], sessions=sessions
        )


def test_the_session_column_is_optional_on_the_wire() -> None:
    """A router's decisions (no sessions) decode as before; a gateway's carry one key per decision, not the id."""
    plain = RouteDecisions(replica_id="r", kinds=["dp"], request_ids=["r"], engine_ids=["a"], prompt_tokens=[1])
    assert decode(encode(plain), RouteDecisions).sessions == []
    key = session_key("a very long session id " * 100 + "ü")
    assert len(key) == 16
    assert decode(encode(_batch([key, ""])), RouteDecisions).sessions == [key, ""]
