"""Group leases (services/lease.py) on a real JetStream KV bucket, and replicas that respect them."""

from __future__ import annotations

import asyncio

from switchyard.services.lease import GroupLeases
from switchyard.shared.bus import Bus


async def test_one_owner_per_group_until_it_stops_renewing(bus: Bus) -> None:
    first = GroupLeases(bus, "migration", "replica-a", ttl_s=1.0)
    second = GroupLeases(bus, "migration", "replica-b", ttl_s=1.0)
    placement = GroupLeases(bus, "placement", "replica-b", ttl_s=1.0)
    for leases in (first, second, placement):
        await leases.start()
    assert await first.acquire("g0")
    assert not await second.acquire("g0")  # held by the first replica
    assert await placement.acquire("g0")  # another kind of lease: independent
    assert await first.acquire("g0")  # renewing one's own lease
    assert await second.acquire("g1")  # another group is free
    for _ in range(3):  # the first keeps renewing: the second never gets g0
        await asyncio.sleep(0.4)
        assert await first.renew() == []
        assert not await second.acquire("g0")
    await asyncio.sleep(1.6)  # the first stops renewing (crashed): its lease lapses
    assert await second.acquire("g0")
    assert await first.renew() == ["g0"] and "g0" not in first.held  # lost, never written over
    await second.release("g0")
    assert await first.acquire("g0")  # released: free at once
