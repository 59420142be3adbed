"""Issue 37, items 5 and 8: what one replica's credentials can make the others count is bounded by what an honest
replica could decide, and a gateway's progress settles only the requests it asked for.

On a real nats-server with the generated per-role configuration (`secured`): engines report on their own
credentials, an in-process gateway `g1`'s core (`RouterCore` fed by `CoreFeed`) or a `RouterService` routes, and
an attacker holds a leaked password (`gateway-g2`, or the shared `gateway` user).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator

import nats
from prometheus_client import REGISTRY

from switchyard.services.gateway.progress import ProgressReporter
from switchyard.services.router.ask import LocalDpAsk
from switchyard.services.router.core import RouterCore
from switchyard.services.router.feed import CoreFeed
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared import schemas as s
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode, encode, encode_unchecked
from switchyard.shared.nats_auth import engine_user, gateway_user
from tests import test_nats_permissions
from tests.gateway_helpers import wait_for
from tests.helpers import repeating
from tests.test_nats_permissions import SecuredNats
from tests.test_prefix_router import FakeEngine

secured = test_nats_permissions.secured  # the real nats-server with the generated per-role configuration

ENGINES = ("e0", "e1", "p0")  # engine users the `secured` fixture has
PROMPT = 1000  # the honest requests' prompt tokens


@contextlib.asynccontextmanager
async def reporting_engines(secured: SecuredNats) -> AsyncIterator[list[FakeEngine]]:
    """Three DP engines on their own credentials: a hello, then telemetry every 100 ms (as engines report)."""
    connections = [await secured.raw(engine_user(e)) for e in ENGINES]
    engines = [FakeEngine(nc, secured.subjects, e) for nc, e in zip(connections, ENGINES, strict=True)]

    async def report() -> None:
        for n in itertools.count():
            for engine in engines:
                if n % 10 == 0:  # a hello every second: a core started later learns them (no announce answered)
                    await engine.hello()
                await engine.report()
            await asyncio.sleep(0.1)

    task = asyncio.create_task(report())
    try:
        yield engines
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for nc in connections:
            await nc.close()


@contextlib.asynccontextmanager
async def gateway_core(secured: SecuredNats, **peer: float) -> AsyncIterator[tuple[RouterCore, CoreFeed]]:
    """Gateway g1's in-process core on its own user, fed from the bus, with the three engines live."""
    settings = secured.settings()
    core = RouterCore(RouterSettings(replica_id="g1", fresh_load_s=60.0, **peer))  # type: ignore[arg-type]
    bus = await Bus.connect(settings, name="g1", role=gateway_user("g1"), no_echo=True)
    feed = CoreFeed(core, settings, "g1", artifact_poll_s=1.0)
    await feed.start(bus, bus, None)
    try:
        fleet = core.fleet
        await wait_for(lambda: all(e in fleet.index and fleet.role[fleet.index[e]] >= 0 for e in ENGINES))
        yield core, feed
    finally:
        await feed.stop()
        await bus.close()


def decisions(replica_id: str, engine_id: str, count: int, prompt_tokens: int, start: int) -> bytes:
    ids = [f"x{start + i}" for i in range(count)]
    columns = {"kinds": ["dp"] * count, "request_ids": ids, "engine_ids": [engine_id] * count}
    return encode_unchecked(
        s.RouteDecisions, {"replica_id": replica_id, **columns, "prompt_tokens": [prompt_tokens] * count}
    )


def honest_wave(core: RouterCore, feed: CoreFeed, wave: int, size: int) -> list[str]:
    """`size` requests routed at once by g1 (each in flight until the wave ends), then all done."""
    chosen, ids = [], []
    for i in range(size):
        request_id = f"w{wave}-{i}"
        reply, decided = core.route_dp(LocalDpAsk(request_id, PROMPT, None, None, "tokens", True), time.monotonic())
        assert decided is not None, reply
        chosen.append(decided.engine_id)
        ids.append(request_id)
    feed.settle((), ids)
    return chosen


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_phantom_decisions_of_a_leaked_gateway_password_do_not_steer_the_split(secured: SecuredNats) -> None:
    """64 phantom decisions on e0 every 50 ms, with any prompt_tokens, under `gateway-g2`: before, g1's split went
    to 0 on e0 (the issue's 45/0/45). Now g2 counts on e0 at most `peer_inflight_per_engine` decisions of at most
    `peer_max_prompt_tokens` (set here to this test's honest scale: 4 in flight, 1000-token prompts), so every
    engine keeps a fair share of g1's traffic."""
    attacker = await secured.raw(gateway_user("g2"))
    subject = secured.subjects.decided("gateway", "g2")
    counter = itertools.count(step=64)

    async def phantom() -> None:
        await attacker.publish(subject, decisions("g2", "e0", 64, 10_000_000, next(counter)))

    bounds = {"peer_inflight_per_engine": 4, "peer_decisions_per_s": 40.0, "peer_max_prompt_tokens": PROMPT}
    async with reporting_engines(secured), gateway_core(secured, **bounds) as (core, feed):
        try:
            async with repeating(phantom, 0.05):
                await asyncio.sleep(0.3)
                split: Counter[str] = Counter()
                for wave in range(10):
                    split.update(honest_wave(core, feed, wave, 30))
                    await asyncio.sleep(0.06)
        finally:
            await attacker.close()
    total = sum(split.values())
    assert total == 300
    assert min(split[e] for e in ENGINES) >= 0.15 * total, f"an engine starved by phantom decisions: {split}"
    dropped = core.bounds.dropped
    assert dropped.get("inflight", 0) + dropped.get("rate", 0) > 0, dropped
    assert dropped.get("prompt_tokens", 0) > 0, dropped


async def test_a_flood_of_max_size_batches_is_dropped_unread_and_honest_requests_are_answered(
    secured: SecuredNats,
) -> None:
    """4,096-entry batches as fast as one client publishes, under `gateway-g2` (default bounds): all but
    `peer_decision_bytes_per_s` of them are dropped before decoding (counted), and g1 answers every honest
    request meanwhile."""
    attacker = await secured.raw(gateway_user("g2"))
    subject = secured.subjects.decided("gateway", "g2")
    payload = decisions("g2", "e0", s.MAX_SHARED_DECISIONS, 1_000_000, 0)
    before = sample("switchyard_router_peer_messages_dropped_total", reason="bytes")
    sent = 0
    async with reporting_engines(secured), gateway_core(secured) as (core, feed):
        start = time.monotonic()
        answered: Counter[str] = Counter()
        for wave in range(10):
            for _ in range(40):
                await attacker.publish(subject, payload)
                sent += 1
            await attacker.flush()
            answered.update(honest_wave(core, feed, wave, 10))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # what is on its way is delivered (counted either way)
        elapsed = time.monotonic() - start
        admitted = core.bounds.admitted_bytes
    await attacker.close()
    dropped = sample("switchyard_router_peer_messages_dropped_total", reason="bytes") - before
    assert dropped > 0, "the flood was decoded in full"
    assert sum(answered.values()) == 100, "every honest request got an engine"
    budget = core.settings.peer_decision_bytes_per_s
    assert admitted <= budget * (elapsed + 1.0), f"decoded {admitted} bytes in {elapsed:.1f} s"
    assert admitted // len(payload) < sent / 2, f"{admitted // len(payload)} of {sent} batches decoded"


async def test_the_shared_gateway_user_cannot_end_a_replicas_requests(secured: SecuredNats) -> None:
    """The remote shape: gateway g1 (its own user) asks the router with progress. The shared `gateway` user reads
    the routers' request ids on `sy.route.decided.>` and forges `done` for all of them, on every progress subject
    it can name: the server refuses it the old shared subject and g1's, and its own subject settles nothing of
    g1's (ignored, counted). g1's own report still settles its request."""
    settings = secured.settings()
    service = RouterService(settings, RouterSettings(fresh_load_s=60.0))
    g1 = await Bus.connect(settings, name="g1", role=gateway_user("g1"))
    attacker = await secured.raw("gateway")
    seen: set[str] = set()

    async def read(msg: nats.aio.msg.Msg) -> None:
        seen.update(decode(msg.data, s.RouteDecisions).request_ids)

    await attacker.subscribe(secured.subjects.route_decided, cb=read)
    await service.start()
    ids = [f"g1-req-{i}" for i in range(20)]
    try:
        async with reporting_engines(secured):
            fleet = service.core.fleet
            await wait_for(lambda: all(e in fleet.index and fleet.role[fleet.index[e]] >= 0 for e in ENGINES))
            for rid in ids:
                ask = s.RouteDpRequest(request_id=rid, prompt_tokens=100, progress=True, reporter=gateway_user("g1"))
                await g1.request(g1.subjects.route_dp, ask, s.RouteDpReply, timeout=5)
            await wait_for(lambda: set(ids) <= seen)
            forged = encode(s.RouteProgress(first=[], done=sorted(seen)))
            subjects = secured.subjects
            legacy = f"{subjects.prefix}.route.progress"
            for subject in (legacy, subjects.progress("gateway"), subjects.progress(gateway_user("g1"))):
                await attacker.publish(subject, forged)
            # a last report on its own subject: once the router has it, it has had everything sent before it
            await attacker.publish(subjects.progress("gateway"), encode(s.RouteProgress(first=[], done=["last"])))
            await attacker.flush()
            await wait_for(lambda: fleet.exact.unknown >= 1)
            assert all(rid in fleet.exact for rid in ids), "a forged end settled g1's request"
            assert fleet.exact.foreign >= len(ids)  # its own subject: read, and ignored (counted)
            reporter = ProgressReporter(g1, gateway_user("g1"))
            reporter.done(ids[0])
            await wait_for(lambda: ids[0] not in fleet.exact)
            assert all(rid in fleet.exact for rid in ids[1:])
            await reporter.close()
    finally:
        await service.stop()
        await g1.close()
        await attacker.close()
    refused = secured.refused("gateway")
    assert legacy in refused and subjects.progress(gateway_user("g1")) in refused
    assert subjects.progress("gateway") not in refused  # its own: allowed, and settles only its own asks


def test_a_request_whose_gateway_never_reports_expires_from_the_exact_ledger() -> None:
    """An ask with progress whose reporter never reports (a dead gateway, or one asking in another's name) leaves
    the exact ledger after `progress_ttl_s`, counted; an ask from before `reporter` is counted by telemetry."""
    from tests.test_route_progress import _hello, _telemetry

    core = RouterCore(RouterSettings(fresh_load_s=600.0, progress_ttl_s=30.0))
    for engine_id in ENGINES:
        core.on_hello(_hello(engine_id), 0.0)
        core.on_telemetry(_telemetry(engine_id, 0), 0.0)
    before = sample("switchyard_router_exact_expired_total", stage="pending")
    core.route_dp(s.RouteDpRequest(request_id="silent", prompt_tokens=50, progress=True, reporter="gw"), 1.0)
    core.route_dp(s.RouteDpRequest(request_id="old", prompt_tokens=50, progress=True), 1.0)  # no reporter
    assert "silent" in core.fleet.exact and "old" not in core.fleet.exact
    core.housekeeping(30.0)
    assert "silent" in core.fleet.exact, "within the TTL it stays"
    core.housekeeping(31.5)
    assert "silent" not in core.fleet.exact and core.fleet.exact.pending.sum() == 0
    assert sample("switchyard_router_exact_expired_total", stage="pending") - before == 1
