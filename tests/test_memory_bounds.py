"""Structures keyed by values a peer controls stay bounded (issue 29, item 7: "Memory").

Each test feeds one structure many distinct hostile values over a real nats-server, the way the probe did, and
asserts the number of entries it holds afterwards (not RSS): the router's engine rows and in-flight FIFOs, and
the fleet view's engines, slots and group index (the API's, placement's and migration's view of the engines).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import httpx
import nats
import numpy as np
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import event

from switchyard.engine_agents.stub import StubConfig
from switchyard.services.api.app import create_app
from switchyard.services.api.settings import ApiSettings
from switchyard.services.fleet_view import FleetView
from switchyard.services.gateway.registry import GatewayRegistry
from switchyard.services.gateway.signatures import SignatureBox
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared import schemas as s
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode_reply, encode
from switchyard.shared.db import Engine, create_async_db, upgrade
from switchyard.shared.settings import SwitchyardSettings
from tests.fleet_helpers import hello
from tests.gateway_helpers import deployment
from tests.helpers import eventually, telemetry
from tests.test_nats_permissions import SecuredNats, secured  # noqa: F401  (the module-scoped fixture)

#: The fleet view's default bounds (`services.fleet_view`), as the API, placement and migration build it.
MAX_ENGINES = 4096
MAX_HELLO_BYTES = 64 * 1024 * 1024


def _refused_hellos(reason: str = "max_engines") -> float:
    return REGISTRY.get_sample_value("switchyard_fleet_engines_refused_total", {"reason": reason}) or 0.0


def _telemetry(engine_id: str, seq: int = 1) -> s.Telemetry:
    return telemetry(engine_id, seq, ts=time.time())


async def _flood(nc: nats.NATS, messages: list[tuple[str, bytes]]) -> None:
    for i, (subject, payload) in enumerate(messages):
        await nc.publish(subject, payload)
        if i % 500 == 499:
            await nc.flush()
    await nc.flush()


@pytest.fixture
async def router(settings: SwitchyardSettings) -> AsyncIterator[RouterService]:
    service = RouterService(settings, RouterSettings(policy="jsq", max_engines=32, fresh_load_s=1.0))
    await service.start()
    yield service
    await service.stop()


async def test_the_router_holds_at_most_max_engines_whatever_ids_arrive(bus: Bus, router: RouterService) -> None:
    """A bus without credentials: 400 hellos and 400 telemetry messages, each from a new engine id. The router
    keeps at most `max_engines` rows (old code: one per id, 801, until `forget_after_s` = 5 min, and its
    columns never shrink), a live engine keeps its row and its traffic, and a newcomer gets in once the flood's
    ids are stale."""
    subjects = bus.subjects
    await bus.publish(subjects.hello("d0"), hello("d0", "g0", ["gpu0"], role="dp"))
    await bus.publish(subjects.telemetry("d0"), _telemetry("d0", 1))
    fleet = router.core.fleet
    await until(lambda: "d0" in fleet.index)
    flood = [(subjects.hello(f"x{i}"), encode(hello(f"x{i}", f"g{i}", [f"gpu{i}"], role="decode"))) for i in range(400)]
    flood += [(subjects.telemetry(f"t{i}"), encode(_telemetry(f"t{i}"))) for i in range(400)]
    await _flood(bus.nc, flood)
    # Markers after the flood on both subjects (one publisher's order holds per subscription).
    await bus.publish(subjects.hello("d0"), hello("d0", "marker", ["gpu0"], role="dp"))
    await bus.publish(subjects.telemetry("d0"), _telemetry("d0", 2))

    def row() -> int:
        return fleet.index.get("d0", -1)

    await until(lambda: len(fleet) > 32 or (fleet.ep_group[row()] == "marker" and fleet.last_seq[row()] == 2))
    assert len(fleet) <= 32, f"{len(fleet)} engine rows for a limit of 32"
    assert len(fleet.role) <= 64 and len(fleet.ledger) <= 64  # the columns' capacity too
    assert fleet.counters.engines_refused > 0
    reply = await bus.request(
        subjects.route_dp, s.RouteDpRequest(request_id="after", prompt_tokens=1), s.RouteDpReply, timeout=2
    )
    assert reply.engine_id == "d0"
    for seq in range(3, 9):  # the flood's ids die (3 of their 0.2 s hello intervals) while d0 keeps reporting
        await bus.publish(subjects.telemetry("d0"), _telemetry("d0", seq))
        await asyncio.sleep(0.2)
    await bus.publish(subjects.hello("n0"), hello("n0", "g1", ["gpu1"], role="dp"))
    await until(lambda: "n0" in fleet.index)
    assert "d0" in fleet.index and len(fleet) <= 32


async def test_an_engine_that_never_reports_holds_a_bounded_in_flight_count(
    secured: SecuredNats,  # noqa: F811
) -> None:
    """Per-role credentials: `engine-e0` says hello and never sends telemetry, `gateway` asks for 3,000 routes.
    Each decision waits in e0's in-flight FIFO until a report settles it; the FIFO holds at most
    `max_inflight_per_engine` (old code: all 3,000, for as long as the hellos keep coming)."""
    settings = secured.settings()
    router = RouterService(settings, RouterSettings(policy="jsq", max_inflight_per_engine=100, fresh_load_s=5.0))
    await router.start()
    engine, gateway = await secured.raw("engine-e0"), await secured.raw("gateway")
    try:
        subjects = secured.subjects
        await engine.publish(subjects.hello("e0"), encode(hello("e0", "g0", ["gpu0"], role="dp")))
        fleet = router.core.fleet
        await until(lambda: "e0" in fleet.index)
        sent = 0
        for _ in range(15):
            # e0 stays live on hellos alone: one before each burst, so a slow machine cannot outlast `fresh_load_s`
            await engine.publish(subjects.hello("e0"), encode(hello("e0", "g0", ["gpu0"], role="dp")))
            requests = [
                gateway.request(
                    subjects.route_dp, encode(s.RouteDpRequest(request_id=uuid.uuid4().hex, prompt_tokens=7)), timeout=5
                )
                for _ in range(200)
            ]
            replies = await asyncio.gather(*requests)
            sent += sum(decode_reply(r.data, s.RouteDpReply).engine_id == "e0" for r in replies)
        assert sent == 3000  # every request was routed to e0
        row = fleet.index["e0"]
        held = len(fleet.ledger.entries(row))
        assert held <= 100, f"{held} decisions held in flight for a limit of 100"
        assert fleet.inflight[row] == held and fleet.inflight_tokens[row] == 7 * held
        assert fleet.ledger.dropped == 3000 - held
    finally:
        await engine.close()
        await gateway.close()
        await router.stop()


async def test_the_fleet_view_holds_at_most_max_engines(bus: Bus) -> None:
    """A bus without credentials: hellos from `MAX_ENGINES` + 300 distinct ids into a fleet view as the API
    builds it (defaults). It holds at most `MAX_ENGINES` (old code: every id, each with its hello of up to 256 KiB,
    for an hour), a live engine keeps its place, and a newcomer takes the place of a stale one."""
    view = FleetView()
    await view.subscribe(bus)
    subjects = bus.subjects
    await bus.publish(subjects.hello("real"), hello("real", "g0", ["gpu0"]).model_copy(update={"hello_interval_s": 60}))
    await until(lambda: "real" in view.engines)

    def fake(i: int) -> tuple[str, bytes]:
        message = hello(f"x{i}", f"g{i}", [f"gpu{i}"]).model_copy(update={"hello_interval_s": 0.05})
        return subjects.hello(message.engine_id), encode(message)

    refused = _refused_hellos()
    await _flood(bus.nc, [fake(i) for i in range(MAX_ENGINES + 300)])
    marker = hello("real", "g0", ["gpu0"]).model_copy(update={"hello_interval_s": 60, "agent_version": "marker"})
    await bus.publish(subjects.hello("real"), marker)  # after the flood, in its order
    await until(lambda: view.engines["real"].hello.agent_version == "marker", within=30)
    assert len(view.engines) <= MAX_ENGINES, f"{len(view.engines)} engines for a limit of {MAX_ENGINES}"
    assert len(view._slots) <= MAX_ENGINES and len(view._members) <= MAX_ENGINES
    assert _refused_hellos() - refused >= 300
    assert view.coordinator("g0") == "real"
    await asyncio.sleep(0.2)  # the flood's ids go stale (3 hello intervals of 50 ms); "real" stays live
    await bus.publish(subjects.hello("n0"), hello("n0", "gn", ["gpun"]))
    await until(lambda: "n0" in view.engines)
    assert "real" in view.engines and len(view.engines) <= MAX_ENGINES


async def test_the_fleet_view_holds_at_most_max_hello_bytes_of_hellos(bus: Bus) -> None:
    """A bus without credentials: 300 hellos from distinct ids, each listing 1,024 GPU names of 200 characters
    (~210 KB on the wire, ~270 KB held). The fleet view as the API builds it keeps at most `MAX_HELLO_BYTES`
    (64 MiB) of them (old code: all 300, ~80 MiB, and 4,096 would be over a GiB), and refuses the rest while
    they are live."""
    view = FleetView()
    await view.subscribe(bus)
    subjects = bus.subjects
    refused = _refused_hellos("max_hello_bytes")
    for i in range(300):
        heavy = hello(f"h{i}", f"g{i}", [f"{i:04d}-{g:04d}-" + "x" * 190 for g in range(1024)])
        heavy = heavy.model_copy(update={"hello_interval_s": 60.0})  # live throughout: none can be evicted
        await bus.publish(subjects.hello(heavy.engine_id), heavy)
        await bus.nc.flush()
        await asyncio.sleep(0.002)  # paced: a subscriber cut off as a slow consumer would make this pass on its own
    await bus.publish(subjects.hello("marker"), hello("marker", "gm", ["gpum"]))
    await until(lambda: "marker" in view.engines or len(view.engines) > 300, within=60)
    held = sum(2048 + sum(64 + len(g) for g in s.hello.gpus) for s in view.engines.values() if s.hello is not None)
    assert held <= MAX_HELLO_BYTES, f"{held / 2**20:.1f} MiB of hellos held for a limit of 64 MiB"
    heavy_held = sum(engine_id.startswith("h") for engine_id in view.engines)
    assert _refused_hellos("max_hello_bytes") - refused == 300 - heavy_held
    assert "marker" in view.engines  # a small hello still fits


async def test_an_engine_moving_from_place_to_place_leaves_no_trail(
    secured: SecuredNats,  # noqa: F811
) -> None:
    """`engine-e0`'s own credentials: 300 hellos, each naming a new (group, rank), each after the last went
    stale (a hello interval of 1 ms). The fleet view keeps one slot and one group for it (old code: every place
    it ever named stayed in the slot and group indexes, for as long as e0 kept talking)."""
    api = await Bus.connect(secured.settings(), name="api-ingest", role="api")
    engine = await secured.raw("engine-e0")
    view = FleetView()
    try:
        await view.subscribe(api)
        subjects = secured.subjects
        for i in range(300):
            message = hello("e0", f"hop{i}", ["gpu0"], dp_rank=i % 7)
            message = message.model_copy(update={"hello_interval_s": 0.001, "telemetry_interval_s": 0.001})
            await engine.publish(subjects.hello("e0"), encode(message))
            await engine.flush()
            await asyncio.sleep(0.005)
        await until(lambda: view.engines.get("e0") and view.engines["e0"].hello.ep_group == "hop299")
        assert len(view._slots) <= 1, f"{len(view._slots)} slots held for one engine"
        assert len(view._members) <= 1, f"{len(view._members)} groups indexed for one engine"
    finally:
        await engine.close()
        await api.close()


async def until(condition: Callable[[], object], within: float = 20.0) -> None:
    """`eventually` for a plain read."""

    async def probe() -> bool:
        return bool(condition())

    await eventually(probe, timeout=within)


@pytest.fixture
def db_settings(settings: SwitchyardSettings, database_url: str) -> SwitchyardSettings:
    upgrade(database_url)
    return settings.model_copy(update={"database_url": database_url})


async def test_a_page_of_engines_loads_only_that_page(bus: Bus, db_settings: SwitchyardSettings) -> None:
    """3,000 engines known only from the database (the rows placement writes for every id that ever said hello,
    kept 7 days) and 20 live ones. A page of 10 loads at most those 10 rows (old code: all 3,000 as ORM objects
    and all 3,020 as response models, per request, ~90 MB at once for 20,000 rows), in the same order and with
    the same total as before."""
    engine, sessions = create_async_db(db_settings.resolved_database_url())
    async with sessions() as session, session.begin():
        session.add_all(
            Engine(
                engine_id=f"old{i:04d}",
                role="decode",
                ep_group=f"g{i % 7}",
                agent="sim",
                model_name="m",
                num_layers=2,
                num_experts=8,
                top_k=2,
                hello={"dp_rank": i % 5, "gpus": [f"gpu{i}-{g}" for g in range(8)]},
            )
            for i in range(3000)
        )
    await engine.dispose()
    loaded: list[str] = []

    def on_load(target: Engine, _context: object) -> None:
        loaded.append(target.engine_id)

    app = create_app(db_settings, ApiSettings())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://api") as api:
        for i in range(20):
            live = hello(f"live{i:02d}", f"g{i % 7}", [f"a{i}"], dp_rank=i)
            await bus.publish(bus.subjects.hello(live.engine_id), live)
        fleet = app.state.switchyard.fleet
        await until(lambda: len(fleet.engines) == 20)
        event.listen(Engine, "load", on_load)
        try:
            page = await api.get("/v1/engines", params={"limit": 10, "offset": 1000})
        finally:
            event.remove(Engine, "load", on_load)
    assert page.status_code == 200 and page.headers["X-Total-Count"] == "3020"
    assert len(loaded) <= 10, f"{len(loaded)} engine rows loaded for a page of 10"
    everyone = [(f"g{i % 7}", i % 5, f"old{i:04d}") for i in range(3000)]
    everyone += [(f"g{i % 7}", i, f"live{i:02d}") for i in range(20)]
    assert [e["engine_id"] for e in page.json()] == [key[2] for key in sorted(everyone)[1000:1010]]


async def test_early_prefill_signatures_are_bounded_in_bytes(secured: SecuredNats) -> None:  # noqa: F811
    """`engine-p0`'s own credentials: 100 prefill signatures of 1 MiB each (a real one is tens of KB), each for a
    new gateway request id nobody waits for. The gateway's signature box (on its ingest, as the gateway role)
    keeps at most `KEEP_BYTES` (64 MiB) of them (old code: all 100 MiB, and up to 4,096 × 8 MiB for 30 s)."""
    ingest = await Bus.connect(secured.settings(), name="gateway-ingest", role="gateway")
    engine = await secured.raw("engine-p0")
    box = SignatureBox()
    try:
        await ingest.subscribe(secured.subjects.all_signatures, s.PrefillSignature, box.on_signature)
        await ingest.nc.flush()
        counts = np.ones((256, 1024), dtype=np.int32)  # 1 MiB
        for i in range(100):
            message = s.PrefillSignature(
                engine_id="p0", request_id=f"sygw-{i:032x}", ts=time.time(), prompt_tokens=10, signature=counts
            )
            await engine.publish(secured.subjects.signature("p0"), encode(message))
            await engine.flush()
            await asyncio.sleep(0.005)  # paced: a subscriber cut off as a slow consumer would make this pass
        last = f"sygw-{99:032x}"
        await until(lambda: last in box.early)
        held = sum(message.signature.nbytes for _, message in box.early.values())
        assert held <= 64 * 2**20, f"{held / 2**20:.0f} MiB of early signatures held for a limit of 64 MiB"
        assert len(box.early) >= 60  # the newest are kept
    finally:
        await engine.close()
        await ingest.close()


async def test_the_gateways_engine_registry_holds_at_most_max_engines(bus: Bus) -> None:
    """A bus without credentials: hellos with an HTTP base URL from 4,396 distinct ids, into the gateway's
    registry on its hello subscription. It holds at most 4,096 (old code: every id, for 10 minutes past its
    liveness) and refuses the rest while they are live; a real engine heard first keeps its place."""
    registry = GatewayRegistry()
    await bus.subscribe(bus.subjects.all_hello, s.Hello, lambda message, _msg: registry.on_hello(message))
    await bus.nc.flush()

    def with_url(engine_id: str, interval_s: float = 60.0) -> s.Hello:
        message = hello(engine_id, "g0", ["gpu0"])
        return message.model_copy(update={"base_url": "http://127.0.0.1:9", "hello_interval_s": interval_s})

    await bus.publish(bus.subjects.hello("real"), with_url("real"))
    fakes = [with_url(f"x{i}") for i in range(MAX_ENGINES + 300)]
    await _flood(bus.nc, [(bus.subjects.hello(m.engine_id), encode(m)) for m in fakes])
    marker = with_url("real")
    marker = marker.model_copy(update={"model": marker.model.model_copy(update={"name": "marker"})})
    await bus.publish(bus.subjects.hello("real"), marker)  # after the flood, in its order
    await until(lambda: "real" in registry.engines and registry.engines["real"].model == "marker", within=30)
    assert len(registry.engines) <= MAX_ENGINES, f"{len(registry.engines)} engines for a limit of {MAX_ENGINES}"
    assert "real" in registry.engines


async def test_the_gateway_forgets_the_metric_labels_of_engines_it_forgets(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    """Engines served through a real gateway (HTTP in, stub engines out) get per-engine latency label sets; once
    they stop saying hello and the gateway's housekeeping forgets them, their label sets go too (old code: kept
    for every engine id that ever served, for the process's life)."""
    stubs = [StubConfig(f"gone{i}", hello_interval_s=0.1) for i in range(3)]
    async with deployment(settings, bus, stubs, router=False) as (gateway, engines):
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            for _ in range(9):
                answer = await client.post("/v1/completions", json={"model": "stub-model", "prompt": "hi"})
                assert answer.status_code == 200, answer.text
        served = {e for e, stub in engines.items() if stub.received}
        assert served and all(_ttft_count(e) > 0 for e in served)
        for stub in engines.values():
            await stub.stop()  # no more hellos: dead after 3 intervals (0.3 s)
        await until(lambda: not gateway.registry.live())
        gateway.registry.forget_dead(keep_s=0.0)  # its housekeeping, without the 10 minutes' grace
        assert not gateway.registry.engines
        left = [e for e in served if _ttft_count(e) or _label_sets(e)]
        assert not left, f"label sets kept for forgotten engines {left}"


def _ttft_count(engine_id: str) -> float:
    from tests.gateway_helpers import metric

    return metric("switchyard_gateway_time_to_first_token_seconds_count", engine=engine_id)


def _label_sets(engine_id: str) -> int:
    """Samples of any gateway metric labelled with this engine."""
    return sum(
        1
        for family in REGISTRY.collect()
        if family.name.startswith("switchyard_gateway")
        for sample in family.samples
        if sample.labels.get("engine") == engine_id
    )
