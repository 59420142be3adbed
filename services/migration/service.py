"""The migration service: placement plans in (JetStream), ordered migrate steps out, every move's state in the DB.

A plan is recorded (placement row if new, one `pending` migration per placement) before its JetStream
message is acknowledged, so a plan is never lost and a redelivered plan is a no-op. Each engine group has
one worker that runs the group's unfinished migrations one at a time, oldest version first; on start the
service resumes every migration a previous run left `pending`, `running` or `rolling_back`. Every
`reconcile_s` it sets its plans consumer back to the code's settings if someone changed them, and takes up
from the database any plan that stayed `published` with no migration (`services.migration.reconcile`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from prometheus_client import Counter
from sqlalchemy import case, select, text
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, InterfaceError, OperationalError, StatementError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from switchyard.services.fleet_view import FleetView
from switchyard.services.history import add_placement
from switchyard.services.lease import GroupLeases
from switchyard.services.migration.executor import Executor, LeaseLost
from switchyard.services.migration.reconcile import CONSUMER_REPAIRS, recover_skipped
from switchyard.services.migration.settings import MigrationSettings
from switchyard.services.migration.takeover import still_owner, watch_for_orphans
from switchyard.services.runtime import (
    FETCH_WHILE_NATS_RECOVERS,
    RateLimitedLog,
    decode_stream_message,
    ensure_schema,
    metrics_endpoint,
)
from switchyard.shared.bus import Bus
from switchyard.shared.db import Migration, Placement, create_async_db
from switchyard.shared.schemas import PlacementPlan
from switchyard.shared.settings import SwitchyardSettings

log = logging.getLogger(__name__)

UNFINISHED = ("pending", "running", "rolling_back")
PLANS = Counter("switchyard_migration_plans_total", "Placement plans received, by outcome.", ["outcome"])


async def record_plan(sessions: async_sessionmaker[AsyncSession], plan: PlacementPlan) -> int | None:
    """Make sure the plan has a placement row and a migration row; returns the migration id (None: conflict)."""
    try:
        async with sessions() as session, session.begin():
            placement = await session.scalar(select(Placement).where(Placement.plan_id == plan.plan_id))
            if placement is None:
                placement = await add_placement(session, plan, "published", details={"recorded_by": "migration"})
            elif (placement.engine_group, placement.version) != (plan.engine_group, plan.version):
                log.warning("plan %s conflicts with its stored row (group/version differ); ignored", plan.plan_id)
                return None
            existing = await session.scalar(select(Migration.id).where(Migration.placement_id == placement.id))
            if existing is not None:
                PLANS.labels("duplicate").inc()
                return existing
            migration = Migration(
                placement_id=placement.id, engine_group=plan.engine_group, plan_version=plan.version, state="pending"
            )
            session.add(migration)
            await session.flush()
            PLANS.labels("recorded").inc()
            return migration.id
    except IntegrityError as exc:  # another plan holds this (group, version), or a replica recorded it first
        async with sessions() as session:
            placement_id = await session.scalar(select(Placement.id).where(Placement.plan_id == plan.plan_id))
            if placement_id is not None:
                return await session.scalar(select(Migration.id).where(Migration.placement_id == placement_id))
        PLANS.labels("conflict").inc()
        log.warning("plan %s (group %s v%d) refused: %s", plan.plan_id, plan.engine_group, plan.version, exc.orig)
        return None


def is_poison(exc: BaseException) -> bool:
    """Whether storing failed because of the plan itself (a value the database or Python cannot hold), so no
    redelivery can succeed; a database outage or a lost connection is not (the plan is retried)."""
    if isinstance(exc, (OperationalError, InterfaceError, OSError, TimeoutError)):
        return False
    if isinstance(exc, (DataError, ValueError, OverflowError, TypeError)):
        return True
    return isinstance(exc, StatementError) and isinstance(exc.orig, (ValueError, OverflowError, TypeError))


def is_outage(exc: BaseException) -> bool:
    """Whether the database (or the way to it) failed, rather than the statement: worth waiting for it to answer."""
    if isinstance(exc, (OperationalError, InterfaceError, ConnectionError, OSError, TimeoutError)):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


#: The plans consumer's settings: recording a plan takes milliseconds, so unacked after `PLAN_ACK_WAIT_S` means
#: the replica died; a plan is never dropped (recording it is idempotent).
PLAN_ACK_WAIT_S = 30.0
PLAN_MAX_DELIVER = -1

#: Probing an unreachable database: first after this, doubled up to `DATABASE_PROBE_MAX_S`.
DATABASE_PROBE_S = 0.1
DATABASE_PROBE_MAX_S = 1.0


class MigrationService:
    """Start with `await service.run(stop)`; returns once `stop` is set and the workers have stopped."""

    def __init__(self, settings: SwitchyardSettings, config: MigrationSettings | None = None) -> None:
        self.settings = settings
        self.config = config or MigrationSettings()
        self._warn = RateLimitedLog(log, "plans")
        self.fleet = FleetView(manifest=settings.engine_manifest_entries())
        self._workers: dict[str, asyncio.Task[None]] = {}
        self.leases: GroupLeases | None = None
        self.bus: Bus | None = None
        #: Hellos and telemetry (wildcard subjects any engine publishes on) on a connection of their own: a flood
        #: there can make the server cut that connection off as a slow consumer, never the one sending steps.
        self.ingest: Bus | None = None
        self._wake: dict[str, asyncio.Event] = {}

    async def run(self, stop: asyncio.Event) -> None:
        database_url = self.settings.resolved_database_url()
        await ensure_schema(database_url)
        engine, self.sessions = create_async_db(database_url)
        self.bus = bus = await Bus.connect(self.settings, name="switchyard-migration", role="migration")
        self.ingest = ingest = await Bus.connect(self.settings, name="switchyard-migration-ingest", role="migration")
        consumer = None
        renewing: asyncio.Task[None] | None = None
        takeover: asyncio.Task[None] | None = None
        reconciling: asyncio.Task[None] | None = None
        try:
            with metrics_endpoint(self.config.metrics_port, self.config.metrics_host):
                await bus.ensure_streams()
                await self.fleet.subscribe(ingest)
                self.executor = Executor(
                    self.sessions, bus, self.fleet, self.config, owns=lambda group: still_owner(self.leases, group)
                )
                durable = bus.subjects.migration_plans
                consumer = await bus.durable_pull(durable, ack_wait=PLAN_ACK_WAIT_S, max_deliver=PLAN_MAX_DELIVER)
                self.leases = GroupLeases(bus, "migration", self.config.replica_id, self.config.lease_ttl_s)
                await self.leases.start()
                renewing = asyncio.create_task(self._renew_leases(), name="migration-leases")
                await self._resume()
                scan_s = self.config.takeover_scan_s or self.config.lease_ttl_s / 3
                takeover = asyncio.create_task(
                    watch_for_orphans(self.sessions, self.leases, self._kick, scan_s), name="migration-takeover"
                )
                reconciling = asyncio.create_task(self._reconcile_forever(), name="migration-reconcile")
                log.info("migration service ready (consumer %s on %s)", durable.name, durable.stream)
                while not stop.is_set():
                    try:
                        messages = await consumer.fetch(16, timeout=0.5)
                    except (NatsTimeoutError, TimeoutError):
                        continue
                    except FETCH_WHILE_NATS_RECOVERS as exc:  # a fetch in flight across a NATS restart
                        self._warn(f"fetching plans failed while NATS recovers ({type(exc).__name__}); retrying")
                        await asyncio.sleep(0.5)
                        continue
                    for msg in messages:
                        await self._on_plan(bus, msg)
        finally:
            background = [task for task in (renewing, takeover, reconciling) if task is not None]
            for task in [*self._workers.values(), *background]:
                task.cancel()
            for task in [*self._workers.values(), *background]:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self.leases is not None:
                with contextlib.suppress(Exception):
                    await self.leases.release_all()
            if consumer is not None:  # unfetched messages would otherwise hold up draining the connection
                with contextlib.suppress(Exception):
                    await consumer.unsubscribe()
            await ingest.close()
            await bus.close()
            await engine.dispose()

    async def _on_plan(self, bus: Bus, msg: Msg) -> None:
        """Record the plan, then acknowledge it (a crash in between redelivers it: recording is idempotent)."""
        plan = await decode_stream_message(msg, PlacementPlan, bus.subjects.placement_plan, bus.max_payload)
        if plan is None:
            return
        try:
            migration_id = await record_plan(self.sessions, plan)
        except Exception as exc:
            if is_poison(exc):  # it can never be stored: redelivering it would fail forever
                PLANS.labels("poison").inc()
                self._warn(f"plan {plan.plan_id!r} can never be stored ({type(exc).__name__}: {exc}); terminated")
                await msg.term()
                return
            self._warn(f"cannot record plan {plan.plan_id!r} ({type(exc).__name__}: {exc}); it will be redelivered")
            await msg.nak(delay=2.0)
            return
        await msg.ack()
        if migration_id is not None:
            self._kick(plan.engine_group)

    async def _renew_leases(self) -> None:
        """Keep the held group leases alive while their migrations run (they may take longer than the TTL)."""
        while True:
            await asyncio.sleep(self.config.lease_ttl_s / 3)
            try:
                if self.leases is not None:
                    await self.leases.renew()
            except Exception:  # NATS briefly away: try again next round (the lease outlives a short blip)
                log.warning("renewing migration leases failed; retrying", exc_info=True)

    async def _reconcile_forever(self) -> None:
        """`reconcile` every `reconcile_s`; a failure (NATS or the database briefly away) waits for the next."""
        while True:
            await asyncio.sleep(self.config.reconcile_s)
            try:
                await self.reconcile()
            except Exception as exc:
                self._warn(f"reconciling plans failed ({type(exc).__name__}: {exc}); trying again")

    async def reconcile(self) -> int:
        """Set the plans consumer back to the code's settings if it differs, and take up every plan left
        `published` with no migration for `skipped_plan_s`; returns how many plans were taken up.

        Either alone is not enough: a consumer whose filter was rewritten has moved its pointer past the plans
        it skipped (repairing it brings none of them back), and without the repair every later plan would be
        skipped too and found only `skipped_plan_s` late.
        """
        assert self.bus is not None
        durable = self.bus.subjects.migration_plans
        if await self.bus.ensure_durable(durable, ack_wait=PLAN_ACK_WAIT_S, max_deliver=PLAN_MAX_DELIVER):
            CONSUMER_REPAIRS.inc()
            log.warning("plans consumer %s was missing or changed; set back to the service's settings", durable.name)
        recovered = await recover_skipped(self.sessions, self.config.skipped_plan_s)
        for plan in recovered:
            PLANS.labels("recovered").inc()
            log.warning(
                "plan %s (group %s) stayed published with no migration for %.0f s: taken up from the database",
                plan.plan_id,
                plan.engine_group,
                self.config.skipped_plan_s,
            )
            self._kick(plan.engine_group)
        return len(recovered)

    async def _resume(self) -> None:
        async with self.sessions() as session:
            groups = await session.scalars(
                select(Migration.engine_group).where(Migration.state.in_(UNFINISHED)).distinct()
            )
            for group in groups:
                log.info("resuming unfinished migrations of group %s", group)
                self._kick(group)

    def _kick(self, group: str) -> None:
        """Make sure the group's worker runs (again) and sees newly recorded migrations."""
        self._wake.setdefault(group, asyncio.Event()).set()
        task = self._workers.get(group)
        if task is None or task.done():
            self._workers[group] = asyncio.create_task(self._drain(group), name=f"migration-{group}")

    async def _next(self, group: str) -> int | None:
        """The group's next migration: one already in flight first, then the oldest pending version."""
        in_flight_first = case((Migration.state == "pending", 1), else_=0)
        async with self.sessions() as session:
            return await session.scalar(
                select(Migration.id)
                .where(Migration.engine_group == group, Migration.state.in_(UNFINISHED))
                .order_by(in_flight_first, Migration.plan_version)
                .limit(1)
            )

    async def _drain(self, group: str) -> None:
        wake = self._wake[group]
        backoff = 1.0
        while True:
            wake.clear()
            migration_id: int | None = None
            try:
                migration_id = await self._next(group)
                if migration_id is None:
                    if wake.is_set():
                        continue
                    if self.leases is not None:
                        await self.leases.release(group)
                    return
                if self.leases is not None and not await self.leases.acquire(group):
                    # another replica runs this group: look again once its lease could have lapsed
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), self.config.lease_ttl_s / 2)
                    continue
                if await self._take_up(migration_id):
                    await self.executor.run(migration_id)
                backoff = 1.0
            except asyncio.CancelledError:
                raise
            except LeaseLost as exc:  # another replica may run the group now: back to contending for its lease
                log.warning("%s; leaving the group to its lease holder", exc)
                continue
            except Exception as exc:  # e.g. the database is briefly unreachable: the state is durable, try again
                if is_outage(exc) and await self._waited_for_database(group, exc):
                    continue  # it answers again: resume now, not after a backoff grown during the outage
                log.exception("migration worker for group %s failed; retrying in %.0f s", group, backoff)
                with contextlib.suppress(Exception):
                    await self._note_error(migration_id, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.retry_max_s)

    async def _waited_for_database(self, group: str, exc: Exception) -> bool:
        """Probe the database (`SELECT 1`, every 0.1 s doubling to 1 s) until it answers; False if it answered at
        once (the error was not an outage after all: the caller backs off as for any error).

        Every state is durable, so the worker just takes up its group again once the database is back: a
        migration resumes within about a second of the outage's end however long the outage was (with only the
        backoff it was up to `retry_max_s` later, 30 s before that was capped).
        """
        delay, waited = DATABASE_PROBE_S, False
        while True:
            try:
                async with self.sessions() as session:
                    await session.execute(text("SELECT 1"))
            except Exception:
                if not waited:
                    self._warn(f"database unavailable ({type(exc).__name__}); group {group} resumes when it answers")
                waited = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, DATABASE_PROBE_MAX_S)
                continue
            if waited:
                log.info("database answers again: resuming the migrations of group %s", group)
            return waited

    async def _take_up(self, migration_id: int | None) -> bool:
        """Count one more run of the migration; past `max_runs` mark it failed instead, so it cannot wedge the group.

        A run that ends normally reaches a final state; only crashes and unexpected errors leave a migration
        unfinished, so the count bounds how often one migration may take the service down or stall it.
        """
        async with self.sessions() as session, session.begin():
            migration = await session.get(Migration, migration_id, with_for_update=True)
            if migration is None or migration.state not in UNFINISHED:
                return False
            if migration.attempts >= self.config.max_runs:
                why = f"gave up after {migration.attempts} runs; last error: {migration.error or 'none recorded'}"
                await self.executor.give_up(session, migration, why)
                return False
            migration.attempts += 1
            return True

    async def _note_error(self, migration_id: int | None, exc: Exception) -> None:
        if migration_id is None:
            return
        async with self.sessions() as session, session.begin():
            migration = await session.get(Migration, migration_id, with_for_update=True)
            if migration is not None and migration.state in UNFINISHED:
                migration.error = f"{type(exc).__name__}: {exc}"[:2000]


async def run_migration(
    settings: SwitchyardSettings, stop: asyncio.Event, config: MigrationSettings | None = None
) -> None:
    """Run the migration service until `stop` is set."""
    await MigrationService(settings, config).run(stop)
