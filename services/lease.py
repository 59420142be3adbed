"""One owner per engine group across service replicas: a lease in a JetStream KV bucket with a TTL.

Two migration services both resumed the same unfinished migration (17 duplicate step requests; correctness
rested on the engines' dedup), and two placement services made 42 migrations in 45 s where one made 10. A
replica now acts for a group only while it holds the group's lease (`<kind>.<group>` in `<prefix>-leases`):

- `acquire` creates the key (compare-and-set on "absent"), or renews it when this owner already holds it;
- the bucket's TTL expires a lease its owner stopped renewing (crashed, cut off), so another replica takes
  the group over after at most `ttl_s`;
- `renew` keeps every held lease alive (compare-and-set on the revision it wrote: a lease taken over after
  an expiry is lost, never overwritten); `release` hands a group back at once.

Clock skew (issue 37, item 9). A lease expires on the clock of the KV stream's leader (the stored message's
timestamp + TTL), while its holder acts on its own monotonic clock. After a leader change to a node whose clock is
ahead by d, the lease lapses d early as its holder sees time; a standby may then take it over. So `holds` is true
only while `clock() < written + ttl_s - max_clock_skew_s` (`written`: this holder's clock just before the write the
leader stamped, so no later than the stamp), and never past two thirds of the TTL (a renewal missed). The
assumption: no two NATS nodes' clocks differ by more than `max_clock_skew_s` (`SWITCHYARD_LEASE_MAX_CLOCK_SKEW_S`,
0.25 s by default; NTP keeps hosts within milliseconds), and clocks run at the same rate over a TTL. Beyond that
bound, correctness rests on the engines' step dedup, as before. The clock is injectable (tests skew it).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from switchyard.shared.bus import Bus

log = logging.getLogger(__name__)

LEASES = Counter("switchyard_leases_total", "Group lease events, by kind and event.", ["kind", "event"])


class LeaseSettings(BaseSettings):
    """`SWITCHYARD_LEASE_*`: what every lease holder assumes of the NATS nodes' clocks."""

    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_LEASE_", env_file=".env", extra="ignore")

    #: The largest difference between any two NATS nodes' wall clocks: a holder stops acting this long before
    #: its lease would lapse on its own clock (see the module docstring).
    max_clock_skew_s: float = Field(default=0.25, ge=0)


class GroupLeases:
    """Leases of one `kind` ("placement", "migration") held by `owner` (a replica id).

    `clock`: the holder's time source (monotonic seconds); `max_clock_skew_s`: None reads `LeaseSettings`."""

    def __init__(
        self,
        bus: Bus,
        kind: str,
        owner: str,
        ttl_s: float = 10.0,
        *,
        max_clock_skew_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus, self.kind, self.owner, self.ttl_s = bus, kind, owner, ttl_s
        skew = LeaseSettings().max_clock_skew_s if max_clock_skew_s is None else max_clock_skew_s
        #: How long after a write this holder may act on it: before the lease can lapse on any node's clock.
        self.act_for_s = min(ttl_s * 2 / 3, ttl_s - skew)
        if self.act_for_s <= ttl_s / 3:  # renewals come every third of the TTL: it could never act between them
            raise ValueError(
                f"max_clock_skew_s ({skew:g} s) leaves a {ttl_s:g} s lease no time to act between renewals; "
                f"it must be below {ttl_s * 2 / 3:g} s (raise the lease TTL)"
            )
        self.clock = clock
        self.held: dict[str, int] = {}  # group -> revision this owner last wrote
        self._written: dict[str, float] = {}  # group -> when (monotonic) this owner last wrote it
        self.kv: KeyValue | None = None

    async def start(self) -> None:
        bucket = self.bus.subjects.lease_bucket
        self.kv = await self.bus.ensure_kv(bucket, history=1, ttl=self.ttl_s)
        # The bucket keeps the TTL of whichever service created it; a mismatch changes what `ttl_s` promises.
        max_age = (await self.bus.js.stream_info(f"KV_{bucket}")).config.max_age or 0.0
        if max_age and abs(max_age - self.ttl_s) > 1e-3:
            consequence = (
                "a lease can expire between this replica's renewals and be taken over while it still acts"
                if max_age < self.ttl_s
                else f"a dead owner's groups are taken over only after {max_age:g} s"
            )
            log.warning(
                "%s leases: bucket %s expires entries after %g s, not this service's lease_ttl_s %g s: %s "
                "(give placement and migration the same lease TTL, or recreate the bucket)",
                self.kind,
                bucket,
                max_age,
                self.ttl_s,
                consequence,
            )

    def _key(self, group: str) -> str:
        return f"{self.kind}.{group}"

    async def acquire(self, group: str) -> bool:
        """Whether this owner holds the group's lease now (taking or renewing it)."""
        assert self.kv is not None, "call start() first"
        if group in self.held:
            return await self._renew(group)
        for _attempt in range(2):
            try:
                asked = self.clock()
                self.held[group] = await self.kv.create(self._key(group), self.owner.encode())
                self._written[group] = asked
                LEASES.labels(self.kind, "acquired").inc()
                return True
            except KeyWrongLastSequenceError:
                break
            except KeyNotFoundError:
                # nats-py's create, refused because the key exists, reads it to see whether it is a delete marker;
                # a lease lapsing between the two reads as "not found". The key is gone now: ask again, once.
                continue
        with contextlib.suppress(KeyNotFoundError, NotFoundError):
            entry = await self.kv.get(self._key(group))
            if entry.value == self.owner.encode():  # ours from before a restart of this replica object
                self.held[group] = entry.revision or 0
                return await self._renew(group)
        return False

    async def _renew(self, group: str) -> bool:
        assert self.kv is not None
        try:
            asked = self.clock()
            self.held[group] = await self.kv.update(self._key(group), self.owner.encode(), last=self.held[group])
            self._written[group] = asked
            return True
        except (KeyWrongLastSequenceError, KeyNotFoundError, NotFoundError):
            del self.held[group]
            self._written.pop(group, None)
            LEASES.labels(self.kind, "lost").inc()
            log.warning("%s lease of group %s lost (expired and taken over?)", self.kind, group)
            return False

    def holds(self, group: str) -> bool:
        """Whether this owner surely holds the group's lease now: it wrote it within `act_for_s` (two thirds of the
        TTL, less where `max_clock_skew_s` needs it).

        Renewals come every third of the TTL; a lease not written for longer (this process stalled, or NATS was
        away) may have lapsed and been taken over without this owner having heard yet, and a lease lapses early
        on a leader whose clock is ahead (the module docstring), so it must not act on it before `acquire` has
        written it again.
        """
        written = self._written.get(group)
        return group in self.held and written is not None and self.clock() - written < self.act_for_s

    async def holder(self, group: str) -> str | None:
        """Who holds the group's lease now (None: nobody; it lapsed or was released), without taking it."""
        assert self.kv is not None, "call start() first"
        try:
            entry = await self.kv.get(self._key(group))
        except (KeyNotFoundError, NotFoundError):
            return None
        return entry.value.decode(errors="replace") if entry.value else None

    async def renew(self) -> list[str]:
        """Renew every held lease; returns the groups whose lease was lost."""
        lost = []
        for group in list(self.held):
            if not await self._renew(group):
                lost.append(group)
        return lost

    async def release(self, group: str) -> None:
        assert self.kv is not None
        revision = self.held.pop(group, None)
        self._written.pop(group, None)
        if revision is not None:
            with contextlib.suppress(Exception):
                await self.kv.delete(self._key(group), last=revision)

    async def release_all(self) -> None:
        for group in list(self.held):
            await self.release(group)
