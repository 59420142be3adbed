"""Drive one migration through its state machine. Every transition is committed before the service acts on it.

```
pending ──prepare──▶ running ──every step acknowledged──▶ succeeded   (placement: applied)
   ├──▶ refused  (stale or superseded plan; placement: superseded)
   └──▶ failed   (bad plan, no live engine; nothing was sent)
running ──engine refused a step──▶ rolling_back ──inverse steps acknowledged──▶ rolled_back  (placement: failed)
running / rolling_back ──no acknowledgement after max_attempts──▶ failed  (the step stays `sent`: in doubt)
any unfinished ──taken up more than max_runs times (crashes, errors)──▶ failed  (the service gives up)
```

Moves are planned from the layout the group's coordinator reports (`sy.engine.<id>.layout`), falling back
to the last applied placement in the database (or vLLM's default layout) when no engine answers: engines
that restarted run their boot layout again, whatever the database remembers (`solver.placement.layouts`,
the placement service's rule too).

A step's moves are marked `sent` (committed) before the request goes out, and `applied` once the engine
acknowledged it, in the same transaction that marks the next step `sent` (or finishes the migration): one
commit per step. After a crash the service resends exactly the steps still marked `sent`; engines answer a
repeated `(plan_id, step)` from memory instead of applying it again. Rollback steps are numbered after the
forward ones, so they have idempotency keys of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import numpy as np
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from prometheus_client import Counter
from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from switchyard.services.fleet_view import FleetView
from switchyard.services.history import load_layout, set_status
from switchyard.services.layout import GroupShape, LayoutProbe, differs, layout_now, recorded
from switchyard.services.migration.planner import plan_steps, rollback_steps
from switchyard.services.migration.settings import MigrationSettings
from switchyard.shared.bus import Bus
from switchyard.shared.db import Migration, MigrationMove, Placement
from switchyard.shared.db.types import utcnow
from switchyard.shared.errors import RemoteError, WireError
from switchyard.shared.schemas import MOVE_COLUMNS, MigrateReply, MigrateRequest
from switchyard.solver.placement import PlacementError

log = logging.getLogger(__name__)

STEPS = Counter("switchyard_migration_steps_total", "Migrate steps sent, by outcome.", ["kind", "outcome"])
FINISHED = Counter("switchyard_migrations_finished_total", "Migrations that reached a final state.", ["state"])


@dataclass(frozen=True)
class StepOutcome:
    applied: bool
    duration_s: float | None = None
    refusal: str | None = None  # the engine refused: nothing of the step was applied
    in_doubt: str | None = None  # no acknowledgement: the step may or may not have been applied


def _moves(rows: Sequence[MigrationMove]) -> np.ndarray:
    return np.array(
        [[r.layer, r.expert, r.src_gpu, r.src_slot, r.dst_gpu, r.dst_slot] for r in rows], dtype=np.int32
    ).reshape(-1, 6)


def _by_step(rows: Sequence[MigrationMove]) -> list[tuple[int, list[MigrationMove]]]:
    ordered = sorted(rows, key=lambda r: (r.step, r.seq))
    return [(step, list(group)) for step, group in groupby(ordered, key=lambda r: r.step)]


class Executor:
    """Runs migrations by id against the database, the bus and the live fleet view."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        bus: Bus,
        fleet: FleetView,
        config: MigrationSettings,
        owns: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self.sessions = sessions
        self.bus = bus
        self.fleet = fleet
        self.config = config
        self.layouts = LayoutProbe(bus, fleet, config.layout_timeout_s)
        #: Asked before every step is sent: whether this replica still owns the group (None: no leases).
        self.owns = owns

    async def run(self, migration_id: int) -> str:
        """Take the migration as far as it goes; returns its final state."""
        async with self.sessions() as session:
            migration = await session.get(Migration, migration_id)
            if migration is None:
                raise LookupError(f"no migration {migration_id}")
            state = migration.state
        if state == "pending":
            state = await self._prepare(migration_id)
        if state == "running":
            state = await self._forward(migration_id)
        if state == "rolling_back":
            state = await self._rollback(migration_id)
        return state

    # ----- transitions -----

    async def _finish(
        self, session: AsyncSession, migration: Migration, state: str, placement_status: str, error: str | None
    ) -> str:
        migration.state = state
        migration.error = error
        await set_status(session, migration.placement_id, placement_status)
        if state == "succeeded":  # the group now runs this placement; its previous one is history
            await session.execute(
                update(Placement)
                .where(
                    Placement.engine_group == migration.engine_group,
                    Placement.status == "applied",
                    Placement.id != migration.placement_id,
                )
                .values(status="superseded")
            )
        FINISHED.labels(state).inc()
        level = logging.INFO if state == "succeeded" else logging.WARNING
        what = f"migration {migration.id} (group {migration.engine_group} v{migration.plan_version})"
        log.log(level, "%s: %s%s", what, state, f": {error}" if error else "")
        return state

    async def give_up(self, session: AsyncSession, migration: Migration, why: str) -> str:
        """Mark an unfinished migration failed (in the caller's transaction): steps still `sent` stay in doubt."""
        return await self._finish(session, migration, "failed", "failed", why)

    async def _prepare(self, migration_id: int) -> str:
        """Refuse stale plans, plan the ordered steps from the group's current layout, persist them."""
        async with self.sessions() as session:
            group = (await session.get(Migration, migration_id)).engine_group  # type: ignore[union-attr]
        coordinator = await self.fleet.wait_for_coordinator(group, self.config.engine_wait_s)
        reported = await self.layouts.live_layout(group) if coordinator is not None else None
        async with self.sessions() as session, session.begin():
            migration = await session.get(Migration, migration_id, with_for_update=True)
            if migration is None or migration.state != "pending":
                return migration.state if migration else "failed"
            placement = await session.get(Placement, migration.placement_id)
            assert placement is not None  # enforced by the foreign key
            record = await recorded(session, group)
            current = record.applied
            if current is not None and placement.version <= current.version:
                stale = f"stale plan: version {placement.version} <= applied version {current.version}"
                return await self._finish(session, migration, "refused", "superseded", stale)
            newer = await session.scalar(
                select(Migration.plan_version)
                .where(
                    Migration.engine_group == group,
                    Migration.state == "pending",
                    Migration.plan_version > migration.plan_version,
                )
                .order_by(Migration.plan_version.desc())
                .limit(1)
            )
            if newer is not None:
                superseded = f"superseded by pending version {newer}"
                return await self._finish(session, migration, "refused", "superseded", superseded)
            if not placement.details.get("layout_stored", True):
                return await self._finish(session, migration, "failed", "failed", "placement has no stored layout")
            target = await load_layout(session, placement)
            try:
                base, source, on_record = layout_now(reported, record, GroupShape.of(target))
                if reported is not None and source == "engines" and differs(base, on_record):
                    log.warning(
                        "migration %d: group %s runs another layout than %s (engines report v%d); moving from theirs",
                        migration.id,
                        group,
                        f"applied v{current.version}" if current is not None else "the default",
                        reported.version,
                    )
                steps = await asyncio.to_thread(plan_steps, base, target)  # ~0.1 s for a full reshuffle
            except PlacementError as exc:
                return await self._finish(session, migration, "failed", "failed", f"cannot plan the moves: {exc}")
            if steps and coordinator is None:
                no_engine = f"no live engine of group {group} said hello within {self.config.engine_wait_s:g} s"
                return await self._finish(session, migration, "failed", "failed", no_engine)
            migration.base_placement_id = current.id if current is not None else None
            migration.state = "running"
            count = await _insert_moves(session, migration.id, steps, "forward", coordinator or "")
            log.info("migration %d: %d moves in %d steps via %s", migration.id, count, len(steps), coordinator)
            if not steps:
                return await self._finish(session, migration, "succeeded", "applied", None)
            return "running"

    async def _forward(self, migration_id: int) -> str:
        migration, rows = await self._load(migration_id)
        plan_id = await self._plan_id(migration)
        settle: Settle = []
        for step, step_rows in _by_step([r for r in rows if r.kind == "forward"]):
            if all(r.state == "applied" for r in step_rows):
                continue
            outcome = await self._send(migration, plan_id, step, step_rows, "forward", settle)
            if outcome.applied:
                settle.append((step_rows, {"state": "applied", "duration_s": outcome.duration_s, "error": None}))
                continue
            async with self.sessions() as session, session.begin():
                fresh = await session.get(Migration, migration_id, with_for_update=True)
                assert fresh is not None
                if outcome.in_doubt:
                    error = f"step {step} in doubt: {outcome.in_doubt}"
                    return await self._finish(session, fresh, "failed", "failed", error)
                await _update(session, step_rows, state="failed", error=outcome.refusal)
                fresh.state, fresh.error = "rolling_back", f"step {step} refused: {outcome.refusal}"
                return "rolling_back"
        async with self.sessions() as session, session.begin():
            await _settle(session, settle)
            fresh = await session.get(Migration, migration_id, with_for_update=True)
            assert fresh is not None
            return await self._finish(session, fresh, "succeeded", "applied", None)

    async def _rollback(self, migration_id: int) -> str:
        migration, rows = await self._load(migration_id)
        forward = _by_step([r for r in rows if r.kind == "forward"])
        done = [(step, step_rows) for step, step_rows in forward if step_rows[0].state in ("applied", "rolled_back")]
        first_rollback_step = (forward[-1][0] + 1) if forward else 0
        if not any(r.kind == "rollback" for r in rows):
            await self._plan_rollback(migration, [s for _, s in done], first_rollback_step, len(rows))
            migration, rows = await self._load(migration_id)
        plan_id = await self._plan_id(migration)
        undone_order = list(reversed(done))
        settle: Settle = []
        for step, step_rows in _by_step([r for r in rows if r.kind == "rollback"]):
            if all(r.state == "applied" for r in step_rows):
                continue
            outcome = await self._send(migration, plan_id, step, step_rows, "rollback", settle)
            if not outcome.applied:
                async with self.sessions() as session, session.begin():
                    fresh = await session.get(Migration, migration_id, with_for_update=True)
                    assert fresh is not None
                    error = f"{fresh.error}; rollback step {step} failed: {outcome.refusal or outcome.in_doubt}"
                    return await self._finish(session, fresh, "failed", "failed", error)
            _, undone = undone_order[step - first_rollback_step]
            settle.append((step_rows, {"state": "applied", "duration_s": outcome.duration_s, "error": None}))
            settle.append((undone, {"state": "rolled_back", "error": None}))
        async with self.sessions() as session, session.begin():
            await _settle(session, settle)
            fresh = await session.get(Migration, migration_id, with_for_update=True)
            assert fresh is not None
            return await self._finish(session, fresh, "rolled_back", "failed", fresh.error)

    async def _plan_rollback(
        self, migration: Migration, applied: list[list[MigrationMove]], first_step: int, first_seq: int
    ) -> None:
        """Persist the inverse of every applied forward step, last first (step numbers after the forward ones)."""
        inverses = rollback_steps([_moves(step_rows) for step_rows in applied])
        engine = applied[0][0].engine_id if applied else ""
        async with self.sessions() as session, session.begin():
            await _insert_moves(session, migration.id, inverses, "rollback", engine, first_step, first_seq)

    # ----- steps -----

    async def _load(self, migration_id: int) -> tuple[Migration, list[MigrationMove]]:
        async with self.sessions() as session:
            migration = await session.get(Migration, migration_id)
            assert migration is not None
            query = select(MigrationMove).where(MigrationMove.migration_id == migration_id)
            return migration, list((await session.scalars(query)).all())

    async def _plan_id(self, migration: Migration) -> str:
        async with self.sessions() as session:
            placement = await session.get(Placement, migration.placement_id)
            assert placement is not None
            return placement.plan_id

    async def _request_step(self, engine: str, request: MigrateRequest) -> MigrateReply:
        """The engine's reply to one step; raises `_Reconnected` if NATS reconnects before it comes."""
        reconnected = self.bus.next_reconnect()
        asking = asyncio.ensure_future(
            self.bus.request(
                self.bus.subjects.migrate(engine), request, MigrateReply, timeout=self.config.step_timeout_s
            )
        )
        try:
            await asyncio.wait({asking, reconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            reconnected.cancel()
        if asking.done():
            return asking.result()
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asking
        raise _Reconnected

    async def _send(
        self, migration: Migration, plan_id: str, step: int, rows: list[MigrationMove], kind: str, settle: Settle
    ) -> StepOutcome:
        """Send one step until it is acknowledged or refused, at most `max_attempts` times.

        The transaction that marks the step `sent` also records `settle` (the previous step's acknowledgement),
        so each step costs one commit; a crash before it just resends that previous step.
        """
        request = MigrateRequest(
            plan_id=plan_id,
            version=migration.plan_version,
            engine_group=migration.engine_group,
            step=step,
            moves=_moves(rows),
        )
        delay = self.config.retry_backoff_s
        last_error = "never sent"
        for attempt in range(1, self.config.max_attempts + 1):
            if self.owns is not None and not await self.owns(migration.engine_group):
                # another replica may have taken the group over (this one stalled past the lease): it resumes
                # from the rows; going on here would send the same steps from two replicas at once
                raise LeaseLost(f"migration {migration.id}: lost the lease of group {migration.engine_group}")
            engine = self.fleet.coordinator(migration.engine_group) or rows[0].engine_id
            async with self.sessions() as session, session.begin():
                await _settle(session, settle)
                await _update(session, rows, state="sent", engine_id=engine, attempts=MigrationMove.attempts + 1)
            try:
                reply = await self._request_step(engine, request)
            except _Reconnected:
                # NATS went away and came back mid-step: the reply is lost, the engine may have applied it;
                # resend now (idempotent) instead of waiting out the step timeout (30 s by default)
                last_error = f"engine {engine}: NATS reconnected while waiting (attempt {attempt})"
                STEPS.labels(kind, "unacknowledged").inc()
                log.warning("migration %d step %d: %s; resending", migration.id, step, last_error)
                continue
            except (NatsTimeoutError, NoRespondersError, ConnectionClosedError, TimeoutError, WireError) as exc:
                # no answer, or one that cannot be read: the step may or may not have been applied; resend it
                what = "did not acknowledge" if not isinstance(exc, WireError) else f"answered garbage ({exc})"
                last_error = f"engine {engine} {what} (attempt {attempt}): {type(exc).__name__}"
                STEPS.labels(kind, "unacknowledged").inc()
                log.warning("migration %d step %d: %s", migration.id, step, last_error)
                if attempt < self.config.max_attempts:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10.0)
                continue
            except RemoteError as exc:
                STEPS.labels(kind, "refused").inc()
                return StepOutcome(applied=False, refusal=f"engine {engine}: {exc}")
            if reply.failure is not None or (reply.plan_id, reply.step) != (plan_id, step):
                STEPS.labels(kind, "refused").inc()
                why = reply.failure or f"answered for plan {reply.plan_id} step {reply.step}"
                return StepOutcome(applied=False, refusal=f"engine {engine}: {why}")
            STEPS.labels(kind, "applied").inc()
            return StepOutcome(applied=True, duration_s=reply.duration_s)
        return StepOutcome(applied=False, in_doubt=last_error)


class LeaseLost(Exception):
    """This replica no longer surely holds the group's lease: it stops before sending another step."""


class _Reconnected(Exception):
    """The bus reconnected while a step's reply was awaited."""


#: Move-row updates waiting to be written with the next transaction: (rows, column values).
Settle = list[tuple[Sequence[MigrationMove], dict[str, Any]]]


async def _update(session: AsyncSession, rows: Sequence[MigrationMove], **values: Any) -> None:
    await session.execute(update(MigrationMove).where(MigrationMove.id.in_([r.id for r in rows])).values(**values))


async def _settle(session: AsyncSession, settle: Settle) -> None:
    for rows, values in settle:
        await _update(session, rows, **values)
    settle.clear()


async def _insert_moves(
    session: AsyncSession,
    migration_id: int,
    steps: list[np.ndarray],
    kind: str,
    engine_id: str,
    first_step: int = 0,
    first_seq: int = 0,
) -> int:
    """Insert the move rows of `steps` (numbered from `first_step`, `seq` from `first_seq`); returns how many."""
    now = utcnow()
    rows = [
        {
            "migration_id": migration_id,
            "step": first_step + offset,
            "kind": kind,
            "engine_id": engine_id,
            "state": "pending",
            "attempts": 0,
            "updated_at": now,
            **dict(zip(MOVE_COLUMNS, move, strict=True)),
        }
        for offset, step in enumerate(steps)
        for move in step.tolist()
    ]
    for seq, row in enumerate(rows, start=first_seq):
        row["seq"] = seq
    if rows:
        await session.execute(insert(MigrationMove), rows)
    return len(rows)
