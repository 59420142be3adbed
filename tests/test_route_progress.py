"""The live exact ledger: the gateway's `sy.route.progress` reports settle the router's ledger.

What must hold: `RouteProgress` and `RouteDpRequest.progress` round-trip (an old request without the field reads
as no progress); the router counts a request routed with ``progress`` in its exact ledger until the first token
and end reports, and one routed without it by today's telemetry settlement; through a real NATS, after the
gateway's reporter sends an end, the router's ledger no longer counts the request; on a real nats-server with
the generated per-role configuration the gateway may publish progress and the router receives it, while an
engine's credential cannot publish it.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from switchyard.services.gateway.progress import ProgressReporter
from switchyard.services.router.core import RouterCore
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared import schemas as s
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode, encode, encode_unchecked
from switchyard.shared.nats_auth import engine_user
from switchyard.shared.settings import SwitchyardSettings
from tests import test_nats_permissions
from tests.gateway_helpers import wait_for
from tests.helpers import telemetry
from tests.test_nats_permissions import SecuredNats
from tests.test_prefix_router import FakeEngine

secured = test_nats_permissions.secured  # the real nats-server with the generated per-role configuration


def test_progress_messages_round_trip() -> None:
    message = s.RouteProgress(first=["a", "b"], done=["b"])
    assert decode(encode(message), s.RouteProgress) == message
    unchecked = encode_unchecked(s.RouteProgress, {"first": ["a", "b"], "done": ["b"]})
    assert decode(unchecked, s.RouteProgress) == message
    request = s.RouteDpRequest(request_id="r", prompt_tokens=5, progress=True)
    assert decode(encode(request), s.RouteDpRequest).progress is True
    old = encode_unchecked(s.RouteDpRequest, {"request_id": "r", "prompt_tokens": 5})  # a sender before the field
    assert decode(old, s.RouteDpRequest).progress is False
    with pytest.raises(ValueError):
        s.RouteProgress(first=[""], done=[])  # an empty id is no id


def _hello(engine_id: str) -> s.Hello:
    return s.Hello(
        engine_id=engine_id,
        role="dp",
        model=s.ModelShape(name="toy", num_layers=2, num_experts=4, top_k=1),
        ep_group=engine_id,
        gpus=["0"],
        capacity=s.Capacity(max_running=64, kv_blocks=4096, block_size=16),
        ts=time.time(),
        agent="sim",
    )


def _telemetry(engine_id: str, seq: int) -> s.Telemetry:
    return telemetry(engine_id, seq, ts=time.time())


def _core(dp_profile: str = "gimbal-exact") -> RouterCore:
    core = RouterCore(RouterSettings(dp_profile=dp_profile, inflight_grace_s=0.0, fresh_load_s=60.0))
    for engine_id in ("e0", "e1"):
        core.on_hello(_hello(engine_id), 0.0)
        core.on_telemetry(_telemetry(engine_id, 0), 0.0)
    return core


def _columns(core: RouterCore, engine_id: str) -> tuple[float, float, float]:
    f = core.fleet
    row = f.index[engine_id]
    return (
        float(f.exact.pending_prefill[row] + f.unreported.tokens[row]),
        float(f.exact.pending[row] + f.unreported.count[row]),
        float(f.exact.decoding[row]),
    )


def test_the_router_core_counts_reported_requests_until_their_end_and_others_until_telemetry() -> None:
    core = _core()
    reply, _ = core.route_dp(s.RouteDpRequest(request_id="a", prompt_tokens=500, progress=True, reporter="gw"), 1.0)
    first = reply.engine_id  # type: ignore[union-attr]
    assert _columns(core, first) == (500.0, 1.0, 0.0)
    other = "e1" if first == "e0" else "e0"
    reply, _ = core.route_dp(s.RouteDpRequest(request_id="b", prompt_tokens=300, progress=True, reporter="gw"), 1.0)
    assert reply.engine_id == other, "the 500 tokens still owed on the first engine"  # type: ignore[union-attr]
    core.on_telemetry(_telemetry(first, 1), 2.0)  # a report: the exact ledger does not settle by telemetry
    assert _columns(core, first) == (500.0, 1.0, 0.0)
    core.on_progress(s.RouteProgress(first=["a"], done=[]), "gw", 2.0)
    assert _columns(core, first) == (0.0, 0.0, 1.0), "past its first token: decode load"
    core.on_progress(s.RouteProgress(first=[], done=["a", "never-sent"]), "gw", 2.0)
    assert _columns(core, first) == (0.0, 0.0, 0.0)
    assert core.fleet.exact.unknown == 1
    # a client that never reports: counted until a telemetry report after it (today's settlement), never decoding
    reply, _ = core.route_dp(s.RouteDpRequest(request_id="c", prompt_tokens=200), 3.0)
    engine = reply.engine_id  # type: ignore[union-attr]
    assert _columns(core, engine)[0] >= 200.0
    before = _columns(core, engine)[0]
    core.on_telemetry(_telemetry(engine, 2), 4.0)
    assert _columns(core, engine)[0] == before - 200.0
    # the profile reads what the ledger holds: the snapshot it routes with follows a progress report
    snap = core.dp.prepare(5.0, 60.0, ("decoding", "pending", "pending_prefill"))
    i = snap.engine_ids.index(other)
    assert snap.columns["pending_prefill"][i] == 300.0
    core.on_progress(s.RouteProgress(first=["b"], done=[]), "gw", 5.0)
    snap = core.dp.prepare(5.0, 60.0, ("decoding", "pending", "pending_prefill"))
    assert snap.columns["pending_prefill"][i] == 0.0 and snap.columns["decoding"][i] == 1.0


def test_the_router_core_counts_recent_sends_of_every_decision_decaying_with_time() -> None:
    """``recent_sends`` (gimbal-exact): every decision, with or without progress, another replica's too, each
    weighing exp(-age / 20 ms) when a later decision reads the column."""
    core = _core()
    names = ("decoding", "pending", "pending_prefill", "recent_sends")
    reply, _ = core.route_dp(s.RouteDpRequest(request_id="a", prompt_tokens=500, progress=True, reporter="gw"), 1.0)
    first = reply.engine_id  # type: ignore[union-attr]
    other = s.RouteDecisions(replica_id="r2", kinds=["dp"], request_ids=["x"], engine_ids=[first], prompt_tokens=[10])
    core.on_decisions(other, 1.0)
    snap = core.dp.prepare(1.02, 60.0, names)
    i = snap.engine_ids.index(first)
    assert snap.columns["recent_sends"][i] == pytest.approx(2 * math.exp(-1))
    assert snap.columns["recent_sends"][1 - i] == 0.0
    snap = core.dp.prepare(2.0, 60.0, names)
    assert snap.columns["recent_sends"][i] < 1e-20, "decays with time alone, no report needed"


def test_only_a_router_whose_profile_reads_recent_sends_counts_them() -> None:
    """Counting a send decays every row: a router whose profiles do not read ``recent_sends`` (the default
    `switchyard`) does not pay for it on each decision."""
    for profile, counts in (("gimbal-exact", True), ("switchyard", False), ("switchyard-exact", False)):
        core = _core(profile)
        core.route_dp(s.RouteDpRequest(request_id="r", prompt_tokens=100, progress=True), 1.0)
        assert core.fleet.tracks_recent is counts
        assert bool(core.fleet.recent.column.sum() > 0) is counts, profile


async def test_after_the_gateway_reports_an_end_the_router_no_longer_counts_it(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    """Through a real NATS: the gateway's `Router` asks with progress, its `ProgressReporter` reports the first
    token and the end, and the router's exact ledger follows (pending → decoding → gone)."""
    from switchyard.services.gateway.routing import Router

    service = RouterService(settings, RouterSettings(dp_profile="gimbal-exact", inflight_grace_s=0.0, fresh_load_s=5.0))
    await service.start()
    try:
        engines = [FakeEngine(bus.nc, bus.subjects, e) for e in ("e0", "e1")]
        for engine in engines:
            await engine.hello()
            await engine.report()
        fleet = service.core.fleet
        await wait_for(lambda: all(e in fleet.index and fleet.last_seq[fleet.index[e]] >= 0 for e in ("e0", "e1")))
        gateway = Router(bus, timeout_s=5.0)
        assert gateway.progress is not None

        class Candidate:
            def __init__(self, engine_id: str) -> None:
                self.engine_id, self.inflight = engine_id, 0

        candidates = [Candidate("e0"), Candidate("e1")]
        chosen = await gateway.route_dp("req-1", 700, candidates)  # type: ignore[arg-type]
        assert chosen is not None
        row = fleet.index[chosen.engine_id]
        assert fleet.exact.pending_prefill[row] == 700 and "req-1" in fleet.exact
        gateway.progress.first("req-1")
        await wait_for(lambda: fleet.exact.decoding[row] == 1)
        assert fleet.exact.pending_prefill[row] == 0
        gateway.progress.done("req-1")
        await wait_for(lambda: "req-1" not in fleet.exact)
        assert fleet.exact.decoding[row] == 0 and fleet.exact.pending[row] == 0
        assert gateway.progress.batches >= 2
        await gateway.progress.close()
    finally:
        await service.stop()


async def test_only_the_gateway_may_publish_progress(secured: SecuredNats) -> None:
    """On the generated per-role configuration: the gateway's progress reaches the router's ledger; an engine's
    credential publishing a forged end for the same request is refused by the server (a violation logged),
    so the request stays counted."""
    settings = secured.settings()
    service = RouterService(settings, RouterSettings(dp_profile="gimbal-exact", inflight_grace_s=0.0, fresh_load_s=5.0))
    gateway = await Bus.connect(settings, name="gateway", role="gateway")
    engine_nc = await secured.raw(engine_user("e0"))
    await service.start()
    try:
        engine = FakeEngine(engine_nc, secured.subjects, "e0")
        await engine.hello()
        await engine.report()
        fleet = service.core.fleet
        await wait_for(lambda: "e0" in fleet.index and fleet.last_seq[fleet.index["e0"]] >= 0)
        for rid in ("kept", "ended"):
            request = s.RouteDpRequest(request_id=rid, prompt_tokens=100, progress=True, reporter="gateway")
            await gateway.request(gateway.subjects.route_dp, request, s.RouteDpReply, timeout=5)
        forged = encode(s.RouteProgress(first=[], done=["kept"]))
        await engine_nc.publish(secured.subjects.progress("gateway"), forged)
        await engine_nc.flush()
        reporter = ProgressReporter(gateway)  # the gateway's own report, after the forged one
        reporter.done("ended")
        await wait_for(lambda: "ended" not in fleet.exact)
        await asyncio.sleep(0.1)
        assert "kept" in fleet.exact, "the engine's forged end was refused"
        await reporter.close()
    finally:
        await service.stop()
        await gateway.close()
        await engine_nc.close()
    assert any(secured.subjects.progress("gateway") in line for line in secured.violations())
    assert not [line for line in secured.violations() if "route.progress" in line and "user:gateway" in line]


async def test_through_the_gateway_every_routed_request_leaves_the_ledger(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    """End to end (real NATS, router service, gateway, stub engines over HTTP): streamed and whole answers are
    reported (first token of the streamed one, the end of both), and the router's exact ledger empties."""
    import httpx

    from switchyard.engine_agents.stub import StubConfig
    from tests.gateway_helpers import deployment

    seen: list[s.RouteProgress] = []
    await bus.subscribe(bus.subjects.route_progress, s.RouteProgress, lambda message, _msg: seen.append(message))
    router = RouterService(settings, RouterSettings(dp_profile="gimbal-exact", inflight_grace_s=0.0, fresh_load_s=5.0))
    await router.start()
    body = {"model": "stub-model", "prompt": "hello there", "max_tokens": 4}
    try:
        stubs = [StubConfig("a", tokens=5), StubConfig("b", tokens=5)]
        async with deployment(settings, bus, stubs, router=False) as (gw, _), httpx.AsyncClient(base_url=gw.url) as c:
            await wait_for(lambda: len(router.core.fleet.index) == 2)
            whole = await c.post("/v1/completions", json=body)
            streamed = await c.post("/v1/completions", json={**body, "stream": True})
            assert whole.status_code == streamed.status_code == 200
            ids = {whole.headers["x-request-id"], streamed.headers["x-request-id"]}
            await wait_for(lambda: ids <= {rid for m in seen for rid in m.done})
            await wait_for(lambda: router.core.fleet.exact.open == 0)
        assert streamed.headers["x-request-id"] in {rid for m in seen for rid in m.first}
        assert router.core.fleet.exact.unknown == 0, "every report named a request the router held"
        assert router.core.fleet.unreported.count.sum() == 0, "the gateway asked with progress"
    finally:
        await router.stop()
