"""The migration service in-process, against real NATS, real databases and simulated engines as protocol peers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
from nats.aio.msg import Msg
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from switchyard.engine_agents.sim.live.migration import MigrationCost, SimExpertGroup, serve_migrate
from switchyard.services.migration.service import record_plan, run_migration
from switchyard.services.migration.settings import MigrationSettings
from switchyard.shared.bus import Bus, rejected_count
from switchyard.shared.db import Migration, MigrationMove, Placement, create_async_db, upgrade
from switchyard.shared.embedded import free_port
from switchyard.shared.schemas import LayoutReply, LayoutRequest, MigrateReply, MigrateRequest
from switchyard.shared.settings import SwitchyardSettings
from switchyard.solver.placement.layouts import default_layout
from tests.fleet_helpers import announcing, hello, plan, shuffled
from tests.helpers import eventually

FAST = MigrationSettings(step_timeout_s=2.0, retry_backoff_s=0.05, engine_wait_s=5.0)
LAYERS, EXPERTS, GPUS = 4, 8, 2


@contextlib.asynccontextmanager
async def migration_service(
    settings: SwitchyardSettings, config: MigrationSettings = FAST
) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """The service as an asyncio task, plus a session factory on its database for the test to look with."""
    upgrade(settings.resolved_database_url())
    engine, sessions = create_async_db(settings.resolved_database_url())
    stop = asyncio.Event()
    task = asyncio.create_task(run_migration(settings, stop, config))
    try:
        yield sessions
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await engine.dispose()


async def _migration(sessions: async_sessionmaker[AsyncSession], plan_id: str) -> Migration | None:
    async with sessions() as session:
        placement_id = select(Placement.id).where(Placement.plan_id == plan_id).scalar_subquery()
        return await session.scalar(select(Migration).where(Migration.placement_id == placement_id))


async def _finished(sessions: async_sessionmaker[AsyncSession], plan_id: str) -> Migration | None:
    migration = await _migration(sessions, plan_id)
    return (
        migration if migration is not None and migration.state not in ("pending", "running", "rolling_back") else None
    )


async def _moves(sessions: async_sessionmaker[AsyncSession], migration_id: int) -> list[MigrationMove]:
    async with sessions() as session:
        query = select(MigrationMove).where(MigrationMove.migration_id == migration_id).order_by(MigrationMove.seq)
        return list((await session.scalars(query)).all())


async def _status(sessions: async_sessionmaker[AsyncSession], plan_id: str) -> str:
    async with sessions() as session:
        return await session.scalar(select(Placement.status).where(Placement.plan_id == plan_id))


@pytest.fixture
def db_settings(settings: SwitchyardSettings, database_url: str) -> SwitchyardSettings:
    return settings.model_copy(update={"database_url": database_url})


async def test_a_plan_is_applied_step_by_step_exactly_once(bus: Bus, db_settings: SwitchyardSettings) -> None:
    base = default_layout(LAYERS, EXPERTS, GPUS)
    group = SimExpertGroup("g0", base.copy(), MigrationCost(time_scale=0.0))
    await serve_migrate(bus, "e0", group)
    await bus.ensure_streams()
    first, second = plan("g0", 1, shuffled(base, 1)), plan("g0", 2, shuffled(base, 2))
    metrics_port = free_port()
    async with (
        announcing(bus, hello("e0", "g0", ["g0-gpu0", "g0-gpu1"])),
        migration_service(db_settings, FAST.model_copy(update={"metrics_port": metrics_port})) as sessions,
    ):
        await bus.js_publish(bus.subjects.placement_plan, first, msg_id=first.plan_id)
        done = await eventually(lambda: _finished(sessions, first.plan_id))
        assert done.state == "succeeded" and done.error is None
        np.testing.assert_array_equal(group.layout, first.placement)
        moves = await _moves(sessions, done.id)
        assert moves and {m.state for m in moves} == {"applied"} and {m.engine_id for m in moves} == {"e0"}
        steps = sorted({m.step for m in moves})
        assert group.applied_keys() == [(first.plan_id, s) for s in steps]  # each step once, in order
        assert await _status(sessions, first.plan_id) == "applied"

        # The next plan starts from where the first left the group, and the first becomes history.
        await bus.js_publish(bus.subjects.placement_plan, second, msg_id=second.plan_id)
        assert (await eventually(lambda: _finished(sessions, second.plan_id))).state == "succeeded"
        np.testing.assert_array_equal(group.layout, second.placement)
        assert [await _status(sessions, p.plan_id) for p in (first, second)] == ["superseded", "applied"]

        # A redelivered plan is a no-op, and a plan claiming a version another plan holds is refused.
        requests = group.requests
        await bus.js_publish(bus.subjects.placement_plan, second, msg_id="redelivery")
        older = plan("g0", 2, shuffled(base, 4), plan_id="g0-other-v2")
        await bus.js_publish(bus.subjects.placement_plan, older, msg_id=older.plan_id)
        probe = plan("g0", 3, second.placement, plan_id="g0-probe")  # same layout: succeeds with no moves
        await bus.js_publish(bus.subjects.placement_plan, probe, msg_id=probe.plan_id)
        assert (await eventually(lambda: _finished(sessions, probe.plan_id))).state == "succeeded"
        assert group.requests == requests
        assert await _migration(sessions, older.plan_id) is None  # its version belongs to another plan
        async with sessions() as session:
            assert len((await session.scalars(select(Migration))).all()) == 3
        async with httpx.AsyncClient() as client:  # the service's own metrics endpoint
            metrics = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
        assert 'switchyard_migration_steps_total{kind="forward",outcome="applied"}' in metrics


async def test_stale_plans_are_refused(bus: Bus, db_settings: SwitchyardSettings) -> None:
    base = default_layout(LAYERS, EXPERTS, GPUS)
    group = SimExpertGroup("g1", base.copy(), MigrationCost(time_scale=0.0))
    await serve_migrate(bus, "e1", group)
    await bus.ensure_streams()
    newer, older = plan("g1", 5, shuffled(base, 5)), plan("g1", 3, shuffled(base, 6))
    async with announcing(bus, hello("e1", "g1", ["a", "b"])), migration_service(db_settings) as sessions:
        await bus.js_publish(bus.subjects.placement_plan, newer, msg_id=newer.plan_id)
        assert (await eventually(lambda: _finished(sessions, newer.plan_id))).state == "succeeded"
        requests = group.requests
        await bus.js_publish(bus.subjects.placement_plan, older, msg_id=older.plan_id)
        refused = await eventually(lambda: _finished(sessions, older.plan_id))
        assert refused.state == "refused" and "stale plan: version 3 <= applied version 5" in refused.error
        assert await _status(sessions, older.plan_id) == "superseded"
        assert group.requests == requests
        np.testing.assert_array_equal(group.layout, newer.placement)


async def test_a_refused_step_rolls_the_group_back(bus: Bus, db_settings: SwitchyardSettings) -> None:
    base = default_layout(LAYERS, EXPERTS, GPUS)
    group = SimExpertGroup("g2", base.copy(), MigrationCost(time_scale=0.0))

    async def refuse_step_two(request: MigrateRequest) -> MigrateReply:
        if request.step == 2:
            return MigrateReply(
                plan_id=request.plan_id,
                version=request.version,
                step=2,
                applied=0,
                duration_s=0.0,
                failure="simulated fault: NCCL timeout",
            )
        return await group.apply(request)

    await bus.serve(bus.subjects.migrate("e2"), MigrateRequest, refuse_step_two)
    await bus.ensure_streams()
    doomed = plan("g2", 1, shuffled(base, 7))
    async with announcing(bus, hello("e2", "g2", ["a", "b"])), migration_service(db_settings) as sessions:
        await bus.js_publish(bus.subjects.placement_plan, doomed, msg_id=doomed.plan_id)
        done = await eventually(lambda: _finished(sessions, doomed.plan_id))
        assert done.state == "rolled_back" and "NCCL timeout" in done.error
        np.testing.assert_array_equal(group.layout, base)  # back where it started
        moves = await _moves(sessions, done.id)
        states = {(m.kind, m.step): m.state for m in moves}
        assert states[("forward", 0)] == states[("forward", 1)] == "rolled_back"
        assert states[("forward", 2)] == "failed" and states[("forward", 3)] == "pending"
        rollback = sorted({m.step for m in moves if m.kind == "rollback"})
        assert len(rollback) == 2 and all(states[("rollback", s)] == "applied" for s in rollback)
        assert [key[1] for key in group.applied_keys()] == [0, 1, *rollback]
        assert await _status(sessions, doomed.plan_id) == "failed"


async def test_an_unanswered_step_fails_in_doubt_and_bad_plans_are_counted(
    bus: Bus, db_settings: SwitchyardSettings
) -> None:
    await bus.ensure_streams()
    silent = plan("g3", 1, shuffled(default_layout(LAYERS, EXPERTS, GPUS), 8))
    config = FAST.model_copy(update={"step_timeout_s": 0.2, "max_attempts": 2})
    subject = bus.subjects.placement_plan
    before = rejected_count(subject, "not_msgpack")
    async with announcing(bus, hello("e3", "g3", ["a", "b"])), migration_service(db_settings, config) as sessions:
        await bus.js.publish(subject, b"\xc1 not a plan")
        await bus.js_publish(subject, silent, msg_id=silent.plan_id)  # nobody serves e3's migrate subject
        done = await eventually(lambda: _finished(sessions, silent.plan_id))
        assert done.state == "failed" and "step 0 in doubt" in done.error
        first_step = [m for m in await _moves(sessions, done.id) if m.step == 0]
        assert {(m.state, m.attempts) for m in first_step} == {("sent", 2)}
    assert rejected_count(subject, "not_msgpack") == before + 1


async def test_moves_start_from_the_layout_the_engines_report(bus: Bus, db_settings: SwitchyardSettings) -> None:
    """Engines that restart run their boot layout again, whatever the database says was applied."""
    base = default_layout(LAYERS, EXPERTS, GPUS)
    engine = {"group": SimExpertGroup("g4", base.copy(), MigrationCost(time_scale=0.0))}

    async def apply(request: MigrateRequest) -> MigrateReply:
        return await engine["group"].apply(request)

    await bus.serve(bus.subjects.migrate("e4"), MigrateRequest, apply)
    await bus.serve(bus.subjects.layout("e4"), LayoutRequest, lambda request: engine["group"].report(request))
    await bus.ensure_streams()
    first, second = plan("g4", 1, shuffled(base, 11)), plan("g4", 2, shuffled(base, 12))
    async with announcing(bus, hello("e4", "g4", ["a", "b"])), migration_service(db_settings) as sessions:
        await bus.js_publish(bus.subjects.placement_plan, first, msg_id=first.plan_id)
        assert (await eventually(lambda: _finished(sessions, first.plan_id))).state == "succeeded"
        reported = await bus.request(bus.subjects.layout("e4"), LayoutRequest(engine_group="g4"), LayoutReply)
        np.testing.assert_array_equal(reported.layout, first.placement)
        assert (reported.version, reported.plan_id) == (1, first.plan_id)

        engine["group"] = restarted = SimExpertGroup("g4", base.copy(), MigrationCost(time_scale=0.0))
        await bus.js_publish(bus.subjects.placement_plan, second, msg_id=second.plan_id)
        done = await eventually(lambda: _finished(sessions, second.plan_id))
        assert done.state == "succeeded", done.error  # planned from v1's layout, the engine would refuse step 0
        np.testing.assert_array_equal(restarted.layout, second.placement)
        assert [await _status(sessions, p.plan_id) for p in (first, second)] == ["superseded", "applied"]


async def test_an_unreadable_acknowledgement_is_retried_then_fails_in_doubt(
    bus: Bus, db_settings: SwitchyardSettings
) -> None:
    async def garbage(msg: Msg) -> None:
        await msg.respond(b"\xc1 not msgpack")

    await bus.nc.subscribe(bus.subjects.migrate("e6"), cb=garbage)
    await bus.ensure_streams()
    doomed = plan("g6", 1, shuffled(default_layout(LAYERS, EXPERTS, GPUS), 13))
    config = FAST.model_copy(update={"max_attempts": 3})
    async with announcing(bus, hello("e6", "g6", ["a", "b"])), migration_service(db_settings, config) as sessions:
        await bus.js_publish(bus.subjects.placement_plan, doomed, msg_id=doomed.plan_id)
        done = await eventually(lambda: _finished(sessions, doomed.plan_id))
        assert done.state == "failed" and "answered garbage" in done.error
        assert {m.attempts for m in await _moves(sessions, done.id) if m.step == 0} == {3}
        assert await _status(sessions, doomed.plan_id) == "failed"


async def test_a_migration_taken_up_too_often_is_given_up(bus: Bus, db_settings: SwitchyardSettings) -> None:
    """A migration that keeps crashing the service (or erroring) must not wedge its group forever."""
    upgrade(db_settings.resolved_database_url())
    engine, sessions = create_async_db(db_settings.resolved_database_url())
    cursed = plan("g7", 1, shuffled(default_layout(LAYERS, EXPERTS, GPUS), 14))
    try:
        migration_id = await record_plan(sessions, cursed)
        assert migration_id is not None
        async with sessions() as session, session.begin():
            row = await session.get(Migration, migration_id)
            row.state, row.attempts, row.error = "running", FAST.max_runs, "RuntimeError: boom"
    finally:
        await engine.dispose()
    await bus.ensure_streams()
    async with migration_service(db_settings) as sessions:  # resumes it on start
        done = await eventually(lambda: _finished(sessions, cursed.plan_id))
        assert done.state == "failed" and f"gave up after {FAST.max_runs} runs" in done.error
        assert "RuntimeError: boom" in done.error
        assert await _status(sessions, cursed.plan_id) == "failed"


async def test_plans_that_can_never_be_stored_are_terminated_not_redelivered(
    bus: Bus, db_settings: SwitchyardSettings
) -> None:
    """Finding 4: a plan id with a NUL byte or `created_at: 1e308` was NAKed forever (~205 tracebacks a minute)."""
    import msgpack

    from switchyard.services.migration.service import is_poison
    from switchyard.shared.codec import encode

    await bus.ensure_streams()
    subject, stream = bus.subjects.placement_plan, bus.subjects.placement_stream
    good = plan("g9", 1, default_layout(LAYERS, EXPERTS, GPUS))
    raw = msgpack.unpackb(encode(good), raw=False)
    before = rejected_count(subject, "schema")
    for poison in ({"plan_id": "g9\x00v1"}, {"created_at": 1e308}, {"version": 2**40}):
        await bus.js.publish(subject, msgpack.packb({**raw, **poison}, use_bin_type=True))
    async with migration_service(db_settings):

        async def settled() -> bool:
            from nats.js.errors import NotFoundError

            try:
                info = await bus.js.consumer_info(stream, bus.subjects.migration_plans.name)
            except NotFoundError:  # the service has not created it yet
                return False
            return info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.stream_seq == 3

        await eventually(settled)
        info = await bus.js.consumer_info(stream, bus.subjects.migration_plans.name)
        assert info.num_redelivered == 0 and info.delivered.stream_seq == 3
    assert rejected_count(subject, "schema") == before + 3
    # what the schema cannot see is judged by the error storing it raised
    from sqlalchemy.exc import DataError, OperationalError

    assert is_poison(DataError("INSERT", {}, ValueError("NUL"))) and is_poison(OverflowError("date"))
    assert not is_poison(OperationalError("SELECT 1", {}, OSError("connection refused")))


async def test_a_second_replica_leaves_a_running_migration_to_its_owner(
    bus: Bus, db_settings: SwitchyardSettings
) -> None:
    """Finding 7: a second migration service resumed the migration the first was executing (17 duplicate
    step requests; correctness rested on the engine's dedup). Now the group's lease keeps it out."""
    base = default_layout(LAYERS, EXPERTS, GPUS)
    group = SimExpertGroup("g0", base.copy(), MigrationCost(time_scale=1.0))  # ~0.2-0.5 s per step
    await serve_migrate(bus, "e0", group)
    await bus.ensure_streams()
    target = plan("g0", 1, shuffled(base, 1))
    async with (
        announcing(bus, hello("e0", "g0", ["g0-gpu0", "g0-gpu1"])),
        migration_service(db_settings, FAST.model_copy(update={"replica_id": "first"})) as sessions,
    ):
        await bus.js_publish(bus.subjects.placement_plan, target, msg_id=target.plan_id)

        async def running() -> bool:
            migration = await _migration(sessions, target.plan_id)
            return migration is not None and migration.state == "running"

        await eventually(running)
        async with migration_service(db_settings, FAST.model_copy(update={"replica_id": "second"})):
            done = await eventually(lambda: _finished(sessions, target.plan_id))
    assert done.state == "succeeded" and done.attempts == 1
    steps = sorted({m.step for m in await _moves(sessions, done.id)})
    assert group.requests == len(steps)  # every step sent once: no replica ran it twice
    np.testing.assert_array_equal(group.layout, target.placement)


async def test_a_nats_restart_mid_step_resends_at_once_not_after_the_step_timeout(tmp_path, database_url: str) -> None:
    """Finding 9: a NATS blip during a step cost the full step timeout (30 s). The engine here takes the first
    request and never answers it (its reply lost with the connection); NATS restarts; the step is resent as
    soon as the connection is back, long before its 120 s timeout."""
    import uuid

    from switchyard.shared.codec import decode, encode
    from switchyard.shared.embedded import EmbeddedNats
    from switchyard.shared.schemas import MigrateReply, MigrateRequest

    server = EmbeddedNats(tmp_path / "nats")
    await asyncio.to_thread(server.start)
    settings = SwitchyardSettings(
        nats_servers=[server.url], subject_prefix="b" + uuid.uuid4().hex[:8], database_url=database_url
    )
    bus = await Bus.connect(settings, name="test-engine")
    seen: list[int] = []

    async def engine(msg) -> None:
        request = decode(msg.data, MigrateRequest)
        seen.append(request.step)
        if len(seen) == 1:
            return  # taken, never answered: the reply is lost with the connection
        reply = MigrateReply(
            plan_id=request.plan_id, version=request.version, step=request.step, applied=1, duration_s=0.0
        )
        await msg.respond(encode(reply))

    try:
        await bus.ensure_streams()
        await bus.nc.subscribe(bus.subjects.migrate("e0"), cb=engine)
        target = plan("g0", 1, shuffled(default_layout(LAYERS, EXPERTS, GPUS), 1))
        config = FAST.model_copy(update={"step_timeout_s": 120.0})
        async with (
            announcing(bus, hello("e0", "g0", ["g0-gpu0", "g0-gpu1"])),
            migration_service(settings, config) as sessions,
        ):
            await bus.js_publish(bus.subjects.placement_plan, target, msg_id=target.plan_id)

            async def first_taken() -> bool:
                return len(seen) >= 1

            await eventually(first_taken)
            await asyncio.to_thread(server.stop)
            await asyncio.to_thread(server.start)  # same port, same JetStream store
            done = await eventually(lambda: _finished(sessions, target.plan_id), timeout=60)
            assert done.state == "succeeded"
            first_step = [m for m in await _moves(sessions, done.id) if m.step == 0]
            assert {m.attempts for m in first_step} == {2} and seen[:2] == [0, 0]
    finally:
        await bus.close()
        await asyncio.to_thread(server.stop)


async def test_engine_ingest_has_its_own_connection(bus: Bus, db_settings: SwitchyardSettings) -> None:
    """Finding 3: near-limit payloads on the engines' wildcard subjects made nats-server cut services off as slow
    consumers. Hellos and telemetry reach the migration service on a connection of their own: when the server
    cuts that one, the connection that takes plans and sends migrate steps keeps working."""
    from switchyard.services.migration.service import MigrationService

    base = default_layout(LAYERS, EXPERTS, GPUS)
    group = SimExpertGroup("g0", base.copy(), MigrationCost(time_scale=0.0))
    await serve_migrate(bus, "e0", group)
    await bus.ensure_streams()
    upgrade(db_settings.resolved_database_url())
    engine, sessions = create_async_db(db_settings.resolved_database_url())
    service = MigrationService(db_settings, FAST)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    lasting = hello("e0", "g0", ["g0-gpu0", "g0-gpu1"]).model_copy(update={"hello_interval_s": 60.0})
    try:
        async with announcing(bus, lasting):

            async def known() -> bool:
                return service.fleet.coordinator("g0") == "e0"

            await eventually(known)
            assert service.ingest is not None and service.bus is not None
            ingest = {sub.subject for sub in service.ingest.nc._subs.values()}
            control = {sub.subject for sub in service.bus.nc._subs.values()}
            engine_wildcards = {bus.subjects.all_hello, bus.subjects.all_telemetry}
            assert engine_wildcards <= ingest and not engine_wildcards & control
            await service.ingest.nc.close()  # what the server does to a slow consumer
            target = plan("g0", 1, shuffled(base, 1))
            await bus.js_publish(bus.subjects.placement_plan, target, msg_id=target.plan_id)
            done = await eventually(lambda: _finished(sessions, target.plan_id))
        assert done.state == "succeeded"
        np.testing.assert_array_equal(group.layout, target.placement)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await engine.dispose()
