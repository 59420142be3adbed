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


async def test_a_bucket_made_with_another_ttl_is_said_at_start(bus: Bus, caplog) -> None:
    """The lease bucket keeps its creator's TTL: a service asking another one (placement's and migration's lease
    TTLs differ) is told what that changes, instead of silently running on a TTL it did not ask for."""
    await GroupLeases(bus, "migration", "replica-a", ttl_s=1.0).start()
    caplog.clear()
    await GroupLeases(bus, "migration", "replica-b", ttl_s=1.0).start()
    assert not [r for r in caplog.records if "lease_ttl_s" in r.getMessage()]
    await GroupLeases(bus, "placement", "replica-c", ttl_s=3.0).start()
    (warning,) = [r for r in caplog.records if "lease_ttl_s" in r.getMessage()]
    assert "after 1 s, not this service's lease_ttl_s 3 s" in warning.getMessage()
    assert "taken over while it still acts" in warning.getMessage()
