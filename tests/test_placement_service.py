"""The placement service against real NATS and databases, end to end with the migration service and sim engines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from switchyard.engine_agents.sim.live.migration import MigrationCost, SimExpertGroup, serve_migrate
from switchyard.services.fleet_view import FleetView
from switchyard.services.history import add_placement, load_layout
from switchyard.services.migration.service import run_migration
from switchyard.services.migration.settings import MigrationSettings
from switchyard.services.placement.engine_registry import EngineRegistry
from switchyard.services.placement.ingest import FUTURE_WINDOWS
from switchyard.services.placement.service import PlacementService
from switchyard.services.placement.settings import PlacementSettings
from switchyard.shared.bus import Bus, rejected_count
from switchyard.shared.codec import decode
from switchyard.shared.db import Placement, create_async_db, upgrade
from switchyard.shared.db.types import utcnow
from switchyard.shared.schemas import PlacementPlan
from switchyard.shared.settings import SwitchyardSettings
from switchyard.solver.placement import DEFAULT_PARAMS
from switchyard.solver.placement.layouts import default_layout
from tests.fleet_helpers import announcing, hello, plan, publish_load, running
from tests.helpers import eventually, telemetry

LAYERS, EXPERTS = 4, 8
QUICK = PlacementSettings(period_s=3600, min_interval_s=0, tick_s=0.05, warmup_s=3600)


@pytest.fixture
def db_settings(settings: SwitchyardSettings, database_url: str) -> SwitchyardSettings:
    upgrade(database_url)
    return settings.model_copy(update={"database_url": database_url})


@pytest.fixture
async def sessions(db_settings: SwitchyardSettings) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine, factory = create_async_db(db_settings.resolved_database_url())
    yield factory
    await engine.dispose()


async def _placements(sessions: async_sessionmaker[AsyncSession], group: str) -> list[Placement]:
    async with sessions() as session:
        query = select(Placement).where(Placement.engine_group == group).order_by(Placement.version)
        return list((await session.scalars(query)).all())


async def test_load_to_applied_placement_and_a_restart_rebuilds_state(
    bus: Bus, db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    await bus.ensure_streams()
    group = SimExpertGroup("g0", default_layout(LAYERS, EXPERTS, 4), MigrationCost(time_scale=0.0))
    await serve_migrate(bus, "e0", group)
    # Both DP ranks send every token to experts 0..3, which the contiguous layout keeps on GPU 0.
    await publish_load(bus, "e0", "g0", 0, range(4))
    await publish_load(bus, "e1", "g0", 1, range(4))
    hellos = hello("e0", "g0", ["a", "b"], 0), hello("e1", "g0", ["c", "d"], 1)
    migration = MigrationSettings(step_timeout_s=2, retry_backoff_s=0.05, engine_wait_s=5)
    first = PlacementService(db_settings, QUICK)
    async with (
        announcing(bus, *hellos),
        running(lambda stop: run_migration(db_settings, stop, migration)),
        running(first.run),
    ):
        await asyncio.wait_for(first.caught_up.wait(), 10)
        rows = await eventually(lambda: _applied(sessions, "g0"))
    v1 = rows[0]
    assert (v1.version, v1.source, v1.base_version, v1.parent_id) == (1, "greedy", None, None)
    assert v1.params == DEFAULT_PARAMS.as_map()  # no calibration yet
    assert v1.objective_terms["load"] >= 0 and v1.predicted_gain > v1.objective_terms["mig"]
    assert v1.details["trigger"] == "start" and v1.details["source_aware"] is True
    assert v1.details["current_from"] == "engines"  # the group's coordinator reported its layout
    assert v1.details["engines"] == ["e0", "e1"] and v1.gpus == ["a", "b", "c", "d"]
    hot_per_gpu = [len(set(gpu.tolist()) & {0, 1, 2, 3}) for gpu in group.layout[0]]
    assert hot_per_gpu == [1, 1, 1, 1]  # the hot experts are spread over the four GPUs now
    assert first.windows["g0"].windows == 2

    # A new process rebuilds the same window from the stream and starts from the applied placement.
    second = PlacementService(db_settings, QUICK)
    async with announcing(bus, *hellos), running(second.run):
        await asyncio.wait_for(second.caught_up.wait(), 10)
        rows = await eventually(lambda: _at_least(sessions, "g0", 2))
    np.testing.assert_allclose(second.windows["g0"].load, first.windows["g0"].load)
    v2 = rows[1]
    assert (v2.version, v2.status, v2.parent_id, v2.base_version) == (2, "rejected", v1.id, 1)
    assert "does not exceed" in v2.details["decision"] or "keeps" in v2.details["decision"]
    assert v2.details["layout_stored"] is False


async def _applied(sessions: async_sessionmaker[AsyncSession], group: str) -> list[Placement] | None:
    rows = await _placements(sessions, group)
    return rows if rows and rows[0].status == "applied" else None


async def _at_least(sessions: async_sessionmaker[AsyncSession], group: str, count: int) -> list[Placement] | None:
    rows = await _placements(sessions, group)
    return rows if len(rows) >= count else None


async def test_each_decoder_is_placed_from_its_own_load(
    bus: Bus, db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    await bus.ensure_streams()
    # decoder 0's requests use experts 0..3, decoder 1's 4..7; two windows each: the second shows the skew
    # persists, without which the step-time rule credits a move with nothing (`DecayedLoad.persistence`)
    await publish_load(bus, "d0", "d0", 0, range(4), windows=2)
    await publish_load(bus, "d1", "d1", 0, range(4, 8), windows=2)
    service = PlacementService(db_settings, QUICK)
    decoders = hello("d0", "d0", ["d0-0", "d0-1"], role="decode"), hello("d1", "d1", ["d1-0", "d1-1"], role="decode")
    subject = bus.subjects.all_expert_load
    before = rejected_count(subject, "not_msgpack")
    async with announcing(bus, *decoders), running(service.run):
        await bus.js.publish(bus.subjects.expert_load("d0"), b"\xc1")  # malformed: counted, never fatal
        d0 = await eventually(lambda: _published(sessions, "d0"))
        d1 = await eventually(lambda: _published(sessions, "d1"))
    assert rejected_count(subject, "not_msgpack") == before + 1
    assert d0.details["roles"] == d1.details["roles"] == ["decode"]
    assert d0.details["engines"] == ["d0"] and d1.details["engines"] == ["d1"]
    async with sessions() as session:
        layouts = {row.engine_group: await load_layout(session, row) for row in (d0, d1)}
    for decoder, hot in (("d0", {0, 1, 2, 3}), ("d1", {4, 5, 6, 7})):  # each spreads its own hot experts
        for layer in layouts[decoder]:
            assert [len(hot & set(gpu.tolist())) for gpu in layer] == [2, 2], decoder
    assert not np.array_equal(layouts["d0"], layouts["d1"])


async def _published(sessions: async_sessionmaker[AsyncSession], group: str) -> Placement | None:
    rows = await _placements(sessions, group)
    return rows[0] if rows and rows[0].status == "published" else None


async def test_proposed_plans_are_published_by_the_outbox(
    bus: Bus, db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    await bus.ensure_streams()
    manual = plan("g9", 1, default_layout(LAYERS, EXPERTS, 2)[:, ::-1].copy(), source="manual")
    async with sessions() as session, session.begin():
        row = await add_placement(session, manual, "proposed")
    service = PlacementService(db_settings, QUICK)
    async with running(service.run):
        await eventually(lambda: _status_is(sessions, row.id, "published"))
    stored = await bus.js.get_last_msg(bus.subjects.placement_stream, bus.subjects.placement_plan)
    published = decode(stored.data, PlacementPlan)
    assert published.plan_id == manual.plan_id and published.source == "manual"
    np.testing.assert_array_equal(published.placement, manual.placement)


async def _status_is(sessions: async_sessionmaker[AsyncSession], placement_id: int, status: str) -> bool:
    async with sessions() as session:
        return (await session.get(Placement, placement_id)).status == status


async def test_windows_from_a_skewed_clock_are_refused(
    bus: Bus, db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    """A window an hour in the future would outweigh every honest one until the clocks met: refused."""
    await bus.ensure_streams()
    await publish_load(bus, "fast", "gf", 0, range(4), clock_offset_s=3600.0)
    await publish_load(bus, "honest", "gh", 0, range(4))
    before = FUTURE_WINDOWS._value.get()
    service = PlacementService(db_settings, QUICK)
    async with running(service.run):
        await asyncio.wait_for(service.caught_up.wait(), 10)
    assert "gf" not in service.windows and service.windows["gh"].windows == 1
    assert FUTURE_WINDOWS._value.get() == before + 1


async def _value(value: object) -> object:
    return value


async def test_windows_must_fit_the_announced_model_and_orphan_groups_are_dropped(
    bus: Bus, db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    """Finding 2: windows of invented groups and shapes took placement from 249 to 963 MB, kept forever."""
    from switchyard.services.placement.ingest import WINDOWS_REFUSED

    await bus.ensure_streams()
    await publish_load(bus, "old", "g-invented", 0, range(4))  # in the stream from before the start
    refused = {r: WINDOWS_REFUSED.labels(r)._value.get() for r in ("unknown_engine", "wrong_shape", "wrong_group")}
    config = QUICK.model_copy(update={"orphan_window_s": 0.3, "period_s": 3600, "gain_threshold": 1e9})
    service = PlacementService(db_settings, config)
    hellos = [hello(f"e{i}", "g0", [f"gpu{i}"], dp_rank=i) for i in range(3)]
    async with announcing(bus, *hellos), running(service.run):
        await asyncio.wait_for(service.caught_up.wait(), 10)
        await eventually(lambda: _value(len(service.fleet.group("g0")) == 3))
        await publish_load(bus, "e0", "g0", 0, range(4))  # as announced: kept
        await publish_load(bus, "e1", "g0", 0, range(4), layers=LAYERS + 2)  # another model shape
        await publish_load(bus, "e2", "g-other", 0, range(4))  # another group than its hello says
        await publish_load(bus, "ghost", "g-ghost", 0, range(4))  # never said hello
        await eventually(lambda: _value("g0" in service.windows and "g-invented" not in service.windows))
        assert set(service.windows) == {"g0"} and service.windows["g0"].load.shape == (LAYERS, EXPERTS)
        await eventually(
            lambda: _value(WINDOWS_REFUSED.labels("unknown_engine")._value.get() > refused["unknown_engine"])
        )
    assert WINDOWS_REFUSED.labels("wrong_shape")._value.get() == refused["wrong_shape"] + 1
    assert WINDOWS_REFUSED.labels("wrong_group")._value.get() == refused["wrong_group"] + 1


async def test_identical_rejections_are_coalesced_and_a_group_without_engines_writes_none(
    db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    """Finding 6: a `rejected` row per group per tick, even for groups with no live engine (2,834 in an hour)."""
    from switchyard.shared.schemas import ExpertLoad
    from switchyard.solver.placement.window import DecayedLoad

    service = PlacementService(db_settings, QUICK.model_copy(update={"gain_threshold": 1e9}))
    service.sessions = sessions
    service.fleet = FleetView(clock=lambda: 1000.0)  # e0 stays live however slow this machine is
    service.fleet.on_hello(hello("e0", "gc", ["a", "b"]))
    for group in ("gc", "g-gone"):
        window = DecayedLoad(300.0)
        counts = np.arange(LAYERS * EXPERTS, dtype=np.uint32).reshape(LAYERS, EXPERTS)
        window.add(
            ExpertLoad(engine_id="e0", ep_group=group, seq=0, window_start=0, window_end=1, expert_counts=counts)
        )
        service.windows[group] = window
    async with sessions() as session, session.begin():  # g-gone was placed once, by engines long gone
        await add_placement(session, plan("g-gone", 1, default_layout(LAYERS, EXPERTS, 2)), "applied")
    for _ in range(5):
        await service.plan_group("gc", "period")
        assert await service.plan_group("g-gone", "period") is None
    rows = await _placements(sessions, "gc")
    assert [r.status for r in rows] == ["rejected"] and rows[0].details["repeats"] == 4
    assert [r.status for r in await _placements(sessions, "g-gone")] == ["applied"]


async def test_engines_not_seen_for_their_retention_are_pruned(
    db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    from switchyard.shared.db import Engine

    async with sessions() as session, session.begin():
        for engine_id, days in (("fresh", 0), ("gone", 30)):
            session.add(
                Engine(
                    engine_id=engine_id,
                    role="decode",
                    ep_group="g",
                    agent="sim",
                    model_name="m",
                    num_layers=2,
                    num_experts=8,
                    top_k=2,
                    hello={},
                    last_seen=utcnow() - timedelta(days=days),
                )
            )
    registry = EngineRegistry(sessions, retention_s=7 * 86400)
    assert await registry.prune() == 1
    assert await registry.prune() == 0  # at most once an hour
    async with sessions() as session:
        assert list(await session.scalars(select(Engine.engine_id))) == ["fresh"]


async def test_rejected_decisions_are_pruned_after_their_retention(
    db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    layout = default_layout(LAYERS, EXPERTS, 2)
    ages = {1: ("applied", 30), 2: ("rejected", 30), 3: ("rejected", 20), 4: ("rejected", 0), 5: ("rejected", 40)}
    async with sessions() as session, session.begin():
        for version, (status, days) in ages.items():
            group = "gp" if version < 5 else "lonely"  # a group whose only row is old and rejected
            row = await add_placement(session, plan(group, version, layout), status)
            row.created_at = utcnow() - timedelta(days=days)
    service = PlacementService(db_settings, QUICK.model_copy(update={"rejected_retention_s": 7 * 86400}))
    service.sessions = sessions
    assert await service.prune_rejected() == 2
    assert await service.prune_rejected() == 0  # at most once an hour
    left = {(r.engine_group, r.version) for g in ("gp", "lonely") for r in await _placements(sessions, g)}
    assert left == {("gp", 1), ("gp", 4), ("lonely", 5)}  # history and each group's newest row stay


def test_a_new_group_takes_its_live_engines_gpus_once_each() -> None:
    now = [1000.0]
    fleet = FleetView(clock=lambda: now[0])
    fleet.on_hello(hello("gone", "gt", ["x", "y"], dp_rank=0))
    now[0] += 60.0  # "gone" missed its hellos: it left the fleet
    fleet.on_hello(hello("e0", "gt", ["a", "b"], dp_rank=0))
    fleet.on_hello(hello("e1", "gt", ["b", "c"], dp_rank=1))  # shares GPU b (e.g. two DP ranks per GPU)
    assert fleet.topology("gt", None) == (["a", "b", "c"], [0, 1, 1])
    # A group placed before keeps its stored GPU order; a GPU of an engine that left keeps its last known owner.
    assert fleet.topology("gt", ["x", "c", "a"]) == (["x", "c", "a"], [0, 1, 0])
    assert fleet.topology("nobody", None) is None


async def test_groups_whose_engines_cannot_migrate_are_not_planned(
    bus: Bus, db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    await bus.ensure_streams()
    await publish_load(bus, "static", "gs", 0, range(4))
    await publish_load(bus, "mobile", "gm", 0, range(4))
    static = hello("static", "gs", ["s0", "s1"]).model_copy(update={"migrates": False})  # e.g. today's vLLM agent
    service = PlacementService(db_settings, QUICK)
    async with announcing(bus, static, hello("mobile", "gm", ["m0", "m1"])), running(service.run):
        await eventually(lambda: _at_least(sessions, "gm", 1))  # the other group is planned meanwhile
        await asyncio.sleep(0.3)  # several more ticks
    assert await _placements(sessions, "gs") == []
    assert "gs" in service._static_groups


async def test_engine_ingest_has_its_own_connection(bus: Bus, db_settings: SwitchyardSettings) -> None:
    """Finding 3: near-limit payloads on the engines' wildcard subjects made nats-server cut services off as slow
    consumers. Placement takes hellos and expert-load windows on a connection of its own; plans, layout requests
    and leases ride the other, which stays connected when the server cuts the ingest one."""
    await bus.ensure_streams()
    await publish_load(bus, "e0", "g0", 0, range(4))
    service = PlacementService(db_settings, QUICK)
    async with announcing(bus, hello("e0", "g0", ["a", "b"], 0)), running(service.run):
        await asyncio.wait_for(service.caught_up.wait(), 10)
        assert service.ingest is not None and service.ingest.nc is not service.bus.nc
        ingest = {sub.subject for sub in service.ingest.nc._subs.values()}
        control = {sub.subject for sub in service.bus.nc._subs.values()}
        assert bus.subjects.all_hello in ingest and bus.subjects.all_hello not in control
        # hellos, telemetry (step time, requests waiting: the payoff rule), the expert-load consumer's delivery
        # subject, the request inbox
        assert len(ingest) == 4, ingest
        assert bus.subjects.all_telemetry in ingest and bus.subjects.all_telemetry not in control
        await bus.publish(bus.subjects.telemetry("e0"), telemetry("e0", 1, ts=time.time(), num_waiting=7))
        await eventually(
            lambda: any(e.telemetry is not None and e.telemetry.num_waiting == 7 for e in service.fleet.group("g0"))
        )
        hellos = [sub for sub in service.ingest.nc._subs.values() if sub.subject == bus.subjects.all_hello]
        assert len(hellos) == 1  # the fleet view's feeds the engines table too: two made the server send each twice
        await service.ingest.nc.close()  # what the server does to a slow consumer
        assert service.bus.nc.is_connected
        await service.bus.nc.flush(timeout=5)


async def test_a_held_lease_outlives_its_ttl_between_plans(bus: Bus, db_settings: SwitchyardSettings) -> None:
    """A group is planned every `period_s` but its lease lives `lease_ttl_s`: the service renews what it holds
    every tick, so between two plans the lease stays its own (it used to lapse and be reported lost)."""
    await bus.ensure_streams()
    await publish_load(bus, "e0", "g0", 0, range(4))
    service = PlacementService(db_settings, QUICK.model_copy(update={"lease_ttl_s": 1.0}))
    async with announcing(bus, hello("e0", "g0", ["a", "b"], 0)), running(service.run):

        async def holds() -> bool:
            return service.leases is not None and "g0" in service.leases.held

        await eventually(holds)  # the start trigger planned g0 under its lease
        await asyncio.sleep(2.5)  # over twice the TTL, and no trigger (period 3600 s)
        entry = await service.leases.kv.get("placement.g0")  # type: ignore[union-attr]
        assert entry.value == service.config.replica_id.encode()


async def test_a_group_stays_blocked_while_its_migration_is_unfinished_and_is_free_once_it_is_final(
    bus: Bus, db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    """Issue 29: placement let a plan block its group for `inflight_timeout_s` (600 s) whatever its migration
    did, then planned again over a migration still running. Now an unfinished migration blocks the group however
    old its plan is, and the group is planned again as soon as the migration is final."""
    from switchyard.shared.db import Migration
    from switchyard.shared.schemas import ExpertLoad
    from switchyard.solver.placement.window import DecayedLoad

    await bus.ensure_streams()
    service = PlacementService(db_settings, QUICK.model_copy(update={"inflight_timeout_s": 600.0}))
    service.sessions, service.bus = sessions, bus
    service.fleet = FleetView(clock=lambda: 1000.0)  # e0 stays live however slow this machine is
    service.fleet.on_hello(hello("e0", "g0", ["a", "b"]))
    counts = np.ones((LAYERS, EXPERTS), dtype=np.uint32)
    counts[:, :4] = 1000  # experts 0..3, all on GPU 0 in the contiguous layout: worth moving
    window = DecayedLoad(300.0)
    for seq in (0, 1):  # two windows: the skew is seen to persist, so the step-time rule credits it
        window.add(
            ExpertLoad(
                engine_id="e0", ep_group="g0", seq=seq, window_start=seq, window_end=seq + 1, expert_counts=counts
            )
        )
    service.windows["g0"] = window
    long_ago = utcnow() - timedelta(seconds=700)  # older than inflight_timeout_s
    async with sessions() as session, session.begin():
        first = await add_placement(session, plan("g0", 1, default_layout(LAYERS, EXPERTS, 2)), "published")
        first.created_at = long_ago
        migration = Migration(
            placement_id=first.id, engine_group="g0", plan_version=1, state="running", created_at=long_ago
        )
        session.add(migration)

    for _ in range(3):
        assert await service.plan_group("g0", "period") is None  # its migration still runs: not placed over it
    assert [r.version for r in await _placements(sessions, "g0")] == [1]

    async with sessions() as session, session.begin():  # what the migration service commits when it finishes
        (await session.get(Migration, migration.id)).state = "succeeded"  # type: ignore[union-attr]
        (await session.get(Placement, first.id)).status = "applied"  # type: ignore[union-attr]
    placed = await service.plan_group("g0", "period")
    assert placed is not None and placed.version == 2
    assert [r.status for r in await _placements(sessions, "g0")] == ["applied", "published"]
