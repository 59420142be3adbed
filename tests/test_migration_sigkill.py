"""`switchyard migration` killed with SIGKILL mid-plan resumes with no move applied twice or lost."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from switchyard.engine_agents.sim.live.migration import MigrationCost, SimExpertGroup, serve_migrate
from switchyard.shared.bus import Bus
from switchyard.shared.db import Migration, MigrationMove, create_async_db, upgrade
from switchyard.shared.settings import SwitchyardSettings
from switchyard.solver.placement.layouts import default_layout
from tests.fleet_helpers import announcing, hello, plan, shuffled
from tests.helpers import eventually
from tests.migration_processes import HeldStep, start_migration

LAYERS, EXPERTS, GPUS = 6, 8, 2
HELD_STEP = 2  # the step in flight when the service is killed
FINAL = ("succeeded", "failed", "rolled_back", "refused")


@pytest.mark.slow
async def test_sigkill_mid_plan_resumes_exactly_once(
    bus: Bus, settings: SwitchyardSettings, database_url: str, tmp_path: Path
) -> None:
    upgrade(database_url)
    base = default_layout(LAYERS, EXPERTS, GPUS)
    held = HeldStep(HELD_STEP)

    group = SimExpertGroup("g0", base.copy(), MigrationCost(time_scale=0.1), sleep=held.sleep)
    await serve_migrate(bus, "e0", group)
    await bus.ensure_streams()
    target = plan("g0", 1, shuffled(base, 11))
    log = tmp_path / "migration.log"
    engine, sessions = create_async_db(database_url)

    async def finished() -> Migration | None:
        async with sessions() as session:
            migration = await session.scalar(select(Migration))
        return migration if migration is not None and migration.state in FINAL else None

    async def moves() -> list[MigrationMove]:
        async with sessions() as session:
            return list((await session.scalars(select(MigrationMove).order_by(MigrationMove.seq))).all())

    service = start_migration(settings, database_url, log)
    try:
        async with announcing(bus, hello("e0", "g0", ["g0-gpu0", "g0-gpu1"])):
            await bus.js_publish(bus.subjects.placement_plan, target, msg_id=target.plan_id)
            await asyncio.wait_for(held.entered.wait(), 60)  # the engine is applying HELD_STEP right now
            states = {(m.step, m.state) for m in await moves()}
            assert {s for s, state in states if state == "applied"} == set(range(HELD_STEP))
            assert (HELD_STEP, "sent") in states
            service.send_signal(signal.SIGKILL)
            await asyncio.to_thread(service.wait, 30)
            held.release.set()  # the engine finishes the step; its acknowledgement goes to a dead inbox

            service = start_migration(settings, database_url, log)
            done = await eventually(finished, timeout=60)
    finally:
        if service.poll() is None:
            service.send_signal(signal.SIGTERM)
            await asyncio.to_thread(service.wait, 30)
        await engine.dispose()

    assert done.state == "succeeded", log.read_text()[-3000:]
    rows = await _rows(database_url)
    steps = sorted({m.step for m in rows})
    assert group.applied_keys() == [(target.plan_id, step) for step in steps]  # every step once, in order
    assert group.requests == len(group.applications) + 1  # the in-flight step was resent once, answered from memory
    np.testing.assert_array_equal(group.layout, target.placement)
    assert {m.state for m in rows} == {"applied"}
    assert {m.attempts for m in rows if m.step == HELD_STEP} == {2}
    assert {m.attempts for m in rows if m.step != HELD_STEP} == {1}
    assert service.returncode == 0  # the restarted service stopped cleanly on SIGTERM


async def _rows(database_url: str) -> list[MigrationMove]:
    engine, sessions = create_async_db(database_url)
    try:
        async with sessions() as session:
            return list((await session.scalars(select(MigrationMove))).all())
    finally:
        await engine.dispose()
