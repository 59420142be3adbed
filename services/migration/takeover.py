"""Standby migration replicas take over a group whose owner died mid-migration.

Two kill -9 tests left the dead replica's migration stuck until that process was restarted (81 s and more
than 50 s), and placement blocked the group meanwhile: a replica looked at a group only at its own start or
when a plan reached it. Now every live replica scans the database every `takeover_scan_s` (a third of the
lease TTL by default) for groups with an unfinished migration whose lease nobody holds, and kicks the group's
worker there — the same path a replica's start takes (`MigrationService._kick`): the worker takes the lease by
compare-and-set, so only one replica wins, and resumes from the durable move rows, resending only the step
still marked `sent` (engines answer a repeated `(plan_id, step)` from memory).

Bound: the dead owner renewed its lease at most a third of the TTL before it died, so the lease lapses at
most one TTL after the death; the next scan (at most `takeover_scan_s` later) finds the group free and the
worker resumes at once: within TTL + scan interval (4/3 TTL by default) plus the server's expiry latency.
Groups whose lease another replica holds are left alone (no worker, no lease traffic for them).

The other side of a takeover: an owner that stalled past its lease (CPU starvation, a long pause) would be
taken over while it still runs. `still_owner` is asked before every step: a lease not written within two
thirds of the TTL must first be renewed by compare-and-set on this owner's own revision, which fails once
another replica has taken it; the executor then stops (`LeaseLost`) instead of sending steps beside its
successor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import Counter
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from switchyard.services.history import UNFINISHED_MIGRATION
from switchyard.services.lease import GroupLeases
from switchyard.services.runtime import RateLimitedLog
from switchyard.shared.db import Migration

log = logging.getLogger(__name__)

TAKEOVERS = Counter(
    "switchyard_migration_takeovers_total", "Groups with an unfinished migration found without a lease holder."
)


async def still_owner(leases: GroupLeases | None, group: str) -> bool:
    """Whether this replica may send the group's next step: its lease is fresh, or renewing it now (compare-and-set
    on the revision this replica wrote, so never over another owner's) succeeds."""
    if leases is None or leases.holds(group):
        return True
    return group in leases.held and await leases.acquire(group)


async def unfinished_groups(sessions: async_sessionmaker[AsyncSession]) -> list[str]:
    """Every group with a migration not yet in a final state."""
    async with sessions() as session:
        query = select(Migration.engine_group).where(Migration.state.in_(UNFINISHED_MIGRATION)).distinct()
        return list((await session.scalars(query)).all())


async def orphaned_groups(sessions: async_sessionmaker[AsyncSession], leases: GroupLeases) -> list[str]:
    """Groups with an unfinished migration and no live lease holder (its owner died or let it lapse)."""
    return [group for group in await unfinished_groups(sessions) if await leases.holder(group) is None]


async def watch_for_orphans(
    sessions: async_sessionmaker[AsyncSession], leases: GroupLeases, kick: Callable[[str], None], every_s: float
) -> None:
    """Kick the worker of every orphaned group, every `every_s`, until cancelled."""
    warn = RateLimitedLog(log, "takeover scans")
    while True:
        await asyncio.sleep(every_s)
        try:
            orphaned = await orphaned_groups(sessions, leases)
        except Exception as exc:  # the database or NATS briefly away: the next scan looks again
            warn(f"looking for orphaned migrations failed ({type(exc).__name__}: {exc}); retrying")
            continue
        for group in orphaned:
            TAKEOVERS.inc()
            log.info("group %s has an unfinished migration and no lease holder: taking it over", group)
            kick(group)
