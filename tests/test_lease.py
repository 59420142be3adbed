"""Group leases (services/lease.py) on a real JetStream KV bucket, and replicas that respect them."""

from __future__ import annotations

import asyncio

import pytest

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


class SkewedClock:
    """The holder's time source, set by the test (monotonic seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_holder_stops_acting_before_a_leader_ahead_by_the_assumed_skew_can_lapse_its_lease(bus: Bus) -> None:
    """Issue 37, item 9: a lease lapses on the KV leader's clock. After a leader change to a node ahead by d, it
    lapses at `written + ttl - d` as the holder's clock reads; a standby may take it over from then on. With d
    above a third of the TTL (here 0.5 s of 1 s) the old rule (act within 2/3 of the TTL) kept acting past that
    instant; a holder assuming `max_clock_skew_s` = d stops first."""
    ttl, skew = 1.0, 0.5
    clock = SkewedClock()
    holder = GroupLeases(bus, "migration", "replica-a", ttl_s=ttl, max_clock_skew_s=skew, clock=clock)
    standby = GroupLeases(bus, "migration", "replica-b", ttl_s=ttl)
    await holder.start()
    await standby.start()
    assert await holder.acquire("g0")  # written at the holder's 0.0
    clock.now = ttl - skew - 0.01
    assert holder.holds("g0"), "within the window it acts"
    for _ in range(50):  # the lease lapses (on the real server's clock) and the standby takes it over
        await asyncio.sleep(0.1)
        if await standby.acquire("g0"):
            break
    assert "g0" in standby.held
    clock.now = ttl - skew  # the earliest the standby could have taken over under a leader ahead by `skew`
    assert not holder.holds("g0"), "the holder still acted while the standby could hold the lease"
    assert await holder.renew() == ["g0"]  # and its next renewal finds it lost, never written over


def test_the_assumed_skew_must_leave_time_to_act_between_renewals() -> None:
    """A skew bound that leaves no time between renewals (every third of the TTL) is refused at once."""
    with pytest.raises(ValueError, match="max_clock_skew_s"):
        GroupLeases(None, "migration", "a", ttl_s=3.0, max_clock_skew_s=2.0)  # type: ignore[arg-type]
    assert GroupLeases(None, "migration", "a", ttl_s=10.0, max_clock_skew_s=0.25).act_for_s == 10.0 * 2 / 3  # type: ignore[arg-type]
    assert GroupLeases(None, "migration", "a", ttl_s=10.0, max_clock_skew_s=5.0).act_for_s == 5.0  # type: ignore[arg-type]
