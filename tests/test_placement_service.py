"""The placement service against real NATS and databases, end to end with the migration service and sim engines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import astuple

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from engine_agents.sim.migration import MigrationCost, SimExpertGroup, serve_migrate
from services.history import add_placement, default_layout, load_layout
from services.migration.service import run_migration
from services.migration.settings import MigrationSettings
from services.placement.service import PlacementService
from services.placement.settings import PlacementSettings
from shared.bus import Bus, rejected_count
from shared.codec import decode
from shared.db import Placement, create_async_db, upgrade
from shared.schemas import PlacementPlan
from shared.settings import SwitchyardSettings
from solver.placement import DEFAULT_PARAMS
from tests.fleet_helpers import announcing, eventually, hello, plan, publish_load, running

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
    assert (v1.alpha, v1.beta, v1.gamma) == astuple(DEFAULT_PARAMS)  # no calibration yet
    assert v1.objective_load >= 0 and v1.predicted_gain > v1.objective_mig
    assert v1.details["trigger"] == "start" and v1.details["source_aware"] is True
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
    await publish_load(bus, "d0", "d0", 0, range(4))  # decoder 0's requests use experts 0..3
    await publish_load(bus, "d1", "d1", 0, range(4, 8))  # decoder 1's use experts 4..7
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
