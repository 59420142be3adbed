"""Plans that no delivery brought: noticed in the database and taken up from it.

Placement stores a plan, publishes it and marks it `published`; the migration service records a migration
for it when the stream delivers it. A plan can be skipped on the way: a durable consumer whose filter was
rewritten (issue 29: four plans skipped for ever, placement stalled for every group for 9 min 50 s while
it waited on them), deleted and recreated, or a stream message lost. Nothing else would ever look at such a
plan again, so the migration service looks: a placement left `published` with no migration for longer than
`skipped_plan_s` gets its pending migration from the database, exactly what the plan's delivery would have
recorded (the executor reads the target layout from the database and plans the moves from the group's live
layout; the message's own moves are never used). The executor's usual rules then apply: a plan older than
the applied version or than another pending one is refused and its placement marked `superseded`, so a plan
found late never undoes a newer one. Each plan taken up is counted in
`switchyard_migration_plans_total{outcome="recovered"}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from prometheus_client import Counter
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from switchyard.shared.db import Migration, Placement
from switchyard.shared.db.types import utcnow

CONSUMER_REPAIRS = Counter(
    "switchyard_migration_consumer_repairs_total",
    "Times the plans consumer was found missing or with other settings than the code's, and set back.",
)

#: At most this many skipped plans are taken up per round (the rest the next round).
BATCH = 100


@dataclass(frozen=True)
class Recovered:
    """A skipped plan taken up: its new migration, its group and plan."""

    migration_id: int
    engine_group: str
    plan_id: str


async def recover_skipped(sessions: async_sessionmaker[AsyncSession], older_than_s: float) -> list[Recovered]:
    """Record a pending migration for every placement `published` more than `older_than_s` ago without one."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    has_migration = select(Migration.id).where(Migration.placement_id == Placement.id).exists()
    async with sessions() as session:
        rows = (
            await session.execute(
                select(Placement.id, Placement.engine_group, Placement.version, Placement.plan_id)
                .where(Placement.status == "published", Placement.created_at < cutoff, ~has_migration)
                .order_by(Placement.id)
                .limit(BATCH)
            )
        ).all()
    recovered = []
    for placement_id, group, version, plan_id in rows:
        try:
            async with sessions() as session, session.begin():
                migration = Migration(placement_id=placement_id, engine_group=group, plan_version=version)
                session.add(migration)
                await session.flush()
                recovered.append(Recovered(migration.id, group, plan_id))
        except IntegrityError:  # its delivery (or another replica) recorded it meanwhile: nothing was skipped
            continue
    return recovered
