"""Plans skipped on their way to the migration service are noticed and taken up (issue 29, item 2).

A plan stored and marked `published` whose message the migration service never receives (a rewritten or
recreated consumer, a lost message) stayed `published` for ever, and placement did not plan its group again
until `inflight_timeout_s` (10 min). Real NATS, real databases, simulated engines as protocol peers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from switchyard.engine_agents.sim.live.migration import MigrationCost, SimExpertGroup, serve_migrate
from switchyard.services.history import add_placement
from switchyard.services.migration.reconcile import CONSUMER_REPAIRS
from switchyard.services.migration.service import PLANS, MigrationService
from switchyard.services.migration.settings import MigrationSettings
from switchyard.shared.bus import Bus
from switchyard.shared.db import create_async_db, upgrade
from switchyard.shared.schemas import PlacementPlan
from switchyard.shared.settings import SwitchyardSettings
from switchyard.solver.placement.layouts import default_layout
from tests.fleet_helpers import announcing, hello, plan, shuffled
from tests.helpers import eventually
from tests.test_migration_service import EXPERTS, FAST, GPUS, LAYERS, _finished, _migration, _status, db_settings

__all__ = ["db_settings"]  # the fixture, for this module's tests


@contextlib.asynccontextmanager
async def running(
    settings: SwitchyardSettings, config: MigrationSettings
) -> AsyncIterator[tuple[MigrationService, async_sessionmaker[AsyncSession]]]:
    """The service as an asyncio task (kept at hand), plus a session factory on its database."""
    upgrade(settings.resolved_database_url())
    engine, sessions = create_async_db(settings.resolved_database_url())
    service, stop = MigrationService(settings, config), asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        yield service, sessions
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await engine.dispose()


async def _store_published(sessions: async_sessionmaker[AsyncSession], target: PlacementPlan) -> None:
    """What placement does before and after publishing a plan: its row, marked `published`."""
    async with sessions() as session, session.begin():
        await add_placement(session, target, "published")


def _recovered() -> float:
    return PLANS.labels("recovered")._value.get()


async def test_a_published_plan_whose_message_never_came_is_taken_up(bus: Bus, db_settings: SwitchyardSettings) -> None:
    """The plan is stored and marked published, but its message never reaches the service: after
    `skipped_plan_s` the service records its migration from the database and the engine moves its experts."""
    base = default_layout(LAYERS, EXPERTS, GPUS)
    group = SimExpertGroup("gs", base.copy(), MigrationCost(time_scale=0.0))
    await serve_migrate(bus, "e0", group)
    await bus.ensure_streams()
    target = plan("gs", 1, shuffled(base, 1))
    upgrade(db_settings.resolved_database_url())
    engine, sessions = create_async_db(db_settings.resolved_database_url())
    try:
        await _store_published(sessions, target)  # no message on the stream: lost on its way
    finally:
        await engine.dispose()
    before = _recovered()
    config = FAST.model_copy(update={"skipped_plan_s": 0.5, "reconcile_s": 0.2})
    async with (
        announcing(bus, hello("e0", "gs", ["gs-gpu0", "gs-gpu1"])),
        running(db_settings, config) as (_, sessions),
    ):
        done = await eventually(lambda: _finished(sessions, target.plan_id), timeout=30)
        assert done.state == "succeeded"
        assert await _status(sessions, target.plan_id) == "applied"
    np.testing.assert_array_equal(group.layout, target.placement)
    assert _recovered() == before + 1


async def test_a_rewritten_consumer_is_set_back_and_the_plans_it_skipped_are_taken_up(
    bus: Bus, db_settings: SwitchyardSettings
) -> None:
    """The issue's attack, as an operator with admin rights could still do it: the plans consumer's filter is
    rewritten (to the calibration requests) and the service fetches past a plan. Reconciling sets the filter
    back (counted) and takes the skipped plan up; the next plan comes through the consumer again."""
    base = default_layout(LAYERS, EXPERTS, GPUS)
    group = SimExpertGroup("gr", base.copy(), MigrationCost(time_scale=0.0))
    await serve_migrate(bus, "e0", group)
    await bus.ensure_streams()
    subjects, durable = bus.subjects, bus.subjects.migration_plans
    first, second = plan("gr", 1, shuffled(base, 1)), plan("gr", 2, shuffled(base, 2))
    config = FAST.model_copy(update={"skipped_plan_s": 0.05, "reconcile_s": 3600.0})  # reconciled by hand here
    async with (
        announcing(bus, hello("e0", "gr", ["gr-gpu0", "gr-gpu1"])),
        running(db_settings, config) as (service, sessions),
    ):

        async def consumer_exists() -> bool:
            with contextlib.suppress(NotFoundError):
                return bool(await bus.js.consumer_info(durable.stream, durable.name))
            return False

        await eventually(consumer_exists)
        rewrite = ConsumerConfig(
            durable_name=durable.name,
            filter_subject=subjects.calibration_request,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30.0,
            max_deliver=-1,
        )
        await bus.js.add_consumer(durable.stream, config=rewrite)
        await _store_published(sessions, first)
        await bus.js_publish(subjects.placement_plan, first, msg_id=first.plan_id)
        after = (await bus.js.publish(subjects.calibration_request, b"not-a-plan")).seq

        async def fetched_past_the_plan() -> bool:
            return (await bus.js.consumer_info(durable.stream, durable.name)).delivered.stream_seq >= after

        await eventually(fetched_past_the_plan)
        assert await _migration(sessions, first.plan_id) is None  # skipped: nothing would ever take it up
        repairs, recovered = CONSUMER_REPAIRS._value.get(), _recovered()
        assert await service.reconcile() == 1
        assert CONSUMER_REPAIRS._value.get() == repairs + 1 and _recovered() == recovered + 1
        info = await bus.js.consumer_info(durable.stream, durable.name)
        assert info.config.filter_subject == subjects.placement_plan
        assert (await eventually(lambda: _finished(sessions, first.plan_id), timeout=30)).state == "succeeded"
        np.testing.assert_array_equal(group.layout, first.placement)

        await _store_published(sessions, second)  # the consumer delivers plans again
        await bus.js_publish(subjects.placement_plan, second, msg_id=second.plan_id)
        assert (await eventually(lambda: _finished(sessions, second.plan_id), timeout=30)).state == "succeeded"
        assert _recovered() == recovered + 1  # it came through the consumer, not the reconciliation
        assert await service.reconcile() == 0 and CONSUMER_REPAIRS._value.get() == repairs + 1
    np.testing.assert_array_equal(group.layout, second.placement)
