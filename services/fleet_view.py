"""The control plane's projection of the engine book: who is in which EP group, and who coordinates each.

The migration service asks it who coordinates an EP group, the placement service (and its calibrations) which
GPUs and DP ranks a group has (`topology`), and the API shows it as `/v1/engines`. It follows hellos and
telemetry (core NATS, latest value wins) into an engine book of its own (`services.engine_book`), which admits
engines (the engine manifest; group-slot claims; at most `max_engines` engines whose stored hellos weigh at most
`max_hello_bytes`, a newcomer taking only a dead engine's place), checks telemetry sequence numbers (a jump
forward is a gap, a jump back a restart) and stamps liveness by the one rule (`shared/liveness.py`, the
router's and the gateway's too). An engine is *stale* when it is not live by that rule. (Not the router's
`services/router` fleet columns: this view is for the control plane, which needs who and where, not
per-request load.)

A hello's `ep_group` and `dp_rank` are the engine's own word; bus permissions prove only its id. With an
engine manifest every claim is checked against it. Without one, no engine may take a place a *live* engine
holds (see docs/security.md, "Group claims"): the book refuses (and this view counts) a hello naming a
(group, rank) that another live engine holds, or moving a live engine to another group or rank; and a group's
coordinator, once it has been live for one hello interval, keeps the migrate steps while it stays live, so an
engine that joins later with a lower rank cannot take them over. Engines silent for `forget_after_s` are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from nats.aio.subscription import Subscription
from prometheus_client import Counter

from switchyard.services.engine_book import (
    MAX_ENGINES,
    MAX_HELLO_BYTES,
    BookEntry,
    BookListenerBase,
    EngineBook,
    HelloChange,
    hello_weight,
)
from switchyard.shared.bus import Bus
from switchyard.shared.engine_manifest import EngineManifest
from switchyard.shared.liveness import Liveness, LivenessSettings
from switchyard.shared.schemas import Announce, Hello, Telemetry

#: What the fleet view holds per engine: the book's entry (its older name, still imported by placement).
EngineState = BookEntry

__all__ = [
    "ENGINES_REFUSED",
    "MAX_ENGINES",
    "MAX_HELLO_BYTES",
    "UNBOUND_HELLOS",
    "EngineState",
    "FleetView",
    "hello_weight",
]

UNBOUND_HELLOS = Counter(
    "switchyard_fleet_hellos_refused_total",
    "Hellos refused: by the engine manifest (an unlisted engine, another group or DP rank, role, model or "
    "base_url than listed), or "
    "claiming a place a live engine holds (slot_taken) or moving a live engine (rebind_while_live).",
    ["reason"],
)
ENGINES_REFUSED = Counter(
    "switchyard_fleet_engines_refused_total",
    "Hellos and telemetry refused because the view is full of live engines: a new id beyond max_engines, or a "
    "hello beyond max_hello_bytes of stored hellos, by reason (max_engines|max_hello_bytes).",
    ["reason"],
)


class FleetView(BookListenerBase):
    """Engines by id, refreshed by `sy.engine.*.hello` and `sy.engine.*.telemetry`."""

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        stale_intervals: float | None = None,
        forget_after_s: float = 3600.0,
        manifest: EngineManifest | None = None,
        max_engines: int = MAX_ENGINES,
        max_hello_bytes: int = MAX_HELLO_BYTES,
        liveness: Liveness | None = None,
    ) -> None:
        self.clock = clock
        #: The liveness rule (default: `LivenessSettings`, as the router and the gateway read it);
        #: `stale_intervals`, when given, is its `misses`.
        liveness = liveness or LivenessSettings().rule()
        if stale_intervals is not None:
            liveness = Liveness(stale_intervals, liveness.max_silence_s)
        #: The engine manifest: a hello claiming another group, rank, role, model or URL than its engine's entry
        #: is refused (an engine's credentials prove its id; without this it could name any group and become
        #: its migrate coordinator). None: every hello is believed.
        self.book = EngineBook(liveness, manifest, max_engines=max_engines, max_hello_bytes=max_hello_bytes)
        self.book.listen(self)
        #: Engines silent this long are dropped (pods come and go; the view must not grow forever).
        self.forget_after_s = forget_after_s
        self._changed = asyncio.Event()
        self._next_prune = 0.0
        #: group -> the coordinator that keeps the migrate steps while it is live, though a lower rank joined.
        self._pinned: dict[str, str] = {}

    @property
    def liveness(self) -> Liveness:
        return self.book.liveness

    @property
    def manifest(self) -> EngineManifest | None:
        return self.book.manifest

    @property
    def engines(self) -> OrderedDict[str, BookEntry]:
        """The book's engines by id, least recently heard first (telemetry-only ones included)."""
        return self.book.entries

    @property
    def hello_bytes(self) -> int:
        return self.book.hello_bytes

    @property
    def _slots(self) -> dict[tuple[str, int], str]:
        return self.book.slots

    @property
    def _members(self) -> dict[str, set[str]]:
        return self.book.members

    async def subscribe(
        self,
        bus: Bus,
        requester: str = "fleet-view",
        telemetry: bool = True,
        also: Callable[[Hello], Awaitable[None]] | None = None,
    ) -> list[Subscription]:
        """Follow hellos (and telemetry, unless the caller only needs who is in which group), and ask every
        engine to say hello now rather than in up to 5 s.

        `also` takes every hello after this view (placement's engines table): on the same subscription, since a
        second one on the same connection makes the server send each hello twice and the service decode it twice
        (placement's ingest, the one service that did, was the one cut off as a slow consumer in a hello flood)."""
        on_hello: Callable[[Hello, object], Awaitable[None] | None] = self.on_hello
        if also is not None:
            then = also

            async def on_hello(hello: Hello, _msg: object = None) -> None:
                self.on_hello(hello)
                await then(hello)

        subscriptions = [await bus.subscribe(bus.subjects.all_hello, Hello, on_hello)]
        if telemetry:
            subscriptions.append(await bus.subscribe(bus.subjects.all_telemetry, Telemetry, self.on_telemetry))
        await bus.publish(bus.subjects.announce, Announce(requester=requester))
        return subscriptions

    # ----- messages: into the book -----

    def on_hello(self, hello: Hello, _msg: object = None) -> None:
        self._prune()
        self.book.on_hello(hello, self.clock())

    def on_telemetry(self, telemetry: Telemetry, _msg: object = None) -> None:
        self._prune()
        self.book.on_telemetry(telemetry, self.clock())

    def _prune(self) -> None:
        """At most once a minute (an O(engines) pass): forget engines silent for `forget_after_s`."""
        now = self.clock()
        if now >= self._next_prune:
            self._next_prune = now + 60.0
            self.book.forget_silent(now, self.forget_after_s)

    # ----- what the book tells it -----

    def refusal(self, reason: str, engine_id: str) -> None:
        if reason in ("max_engines", "max_hello_bytes"):
            ENGINES_REFUSED.labels(reason).inc()
        else:
            UNBOUND_HELLOS.labels("wrong_group_or_rank" if reason in ("ep_group", "dp_rank") else reason).inc()

    def hello_accepted(self, entry: BookEntry, change: str, previous: Hello | None) -> None:
        hello = entry.hello
        assert hello is not None
        moved = previous is not None and (previous.ep_group, previous.dp_rank) != (hello.ep_group, hello.dp_rank)
        if change == HelloChange.JOIN or moved:  # it took a place (else a live member's periodic hello)
            self._settle(hello.ep_group, entry.engine_id, entry.joined_at)
        self._changed.set()

    def _settle(self, group: str, newcomer: str, now: float) -> None:
        """A newcomer took a place in `group`: a coordinator settled there before it keeps the migrate steps,
        though the newcomer has a lower rank."""
        before = self._coordinator(group, excluding=newcomer)
        if before is None or self._coordinator(group) == before:
            return
        holder = self.engines[before]
        if holder.hello is not None and now - holder.joined_at >= holder.hello.hello_interval_s:
            self._pinned[group] = before  # settled: a newcomer with a lower rank does not take over

    def entries_left(self, engine_ids: list[str]) -> None:
        for engine_id in engine_ids:
            for group in [g for g, pinned in self._pinned.items() if pinned == engine_id]:
                del self._pinned[group]

    # ----- reading -----

    @property
    def stale_intervals(self) -> float:
        return self.liveness.misses

    def live_until(self, state: BookEntry) -> float:
        """The liveness rule's answer for the engine's last hello and telemetry (intervals from its hello)."""
        return state.live_until

    def is_stale(self, state: BookEntry) -> bool:
        """Not live by the liveness rule: no hello within `misses` hello intervals and no telemetry within as
        many telemetry intervals (each window at most `max_silence_s`)."""
        return not state.is_live(self.clock())

    def group(self, ep_group: str, live_only: bool = True) -> list[BookEntry]:
        """The group's engines that said hello, in (dp_rank, engine_id) order."""
        states = [self.engines[e] for e in self._members.get(ep_group, ()) if e in self.engines]
        members = [
            s
            for s in states
            if s.hello is not None and s.hello.ep_group == ep_group and not (live_only and self.is_stale(s))
        ]
        return sorted(members, key=lambda s: (s.hello.dp_rank, s.engine_id))  # type: ignore[union-attr]

    def topology(self, ep_group: str, gpus: list[str] | None) -> tuple[list[str], list[int | None]] | None:
        """The group's GPU names and the DP rank owning each, from the hellos; None when it has no GPU.

        `gpus` (the applied placement's order) wins when given; a group never placed takes its live engines'
        GPUs, each once, in DP-rank order. Engines gone silent are no part of a new group, but a GPU of one
        keeps its last known owner.
        """
        owner = {
            gpu: state.hello.dp_rank  # type: ignore[union-attr]
            for state in self.group(ep_group, live_only=False)
            for gpu in state.hello.gpus  # type: ignore[union-attr]
        }
        if gpus is None:
            live = [gpu for state in self.group(ep_group) for gpu in state.hello.gpus]  # type: ignore[union-attr]
            gpus = list(dict.fromkeys(live))
        return (gpus, [owner.get(gpu) for gpu in gpus]) if gpus else None

    def coordinator(self, ep_group: str) -> str | None:
        """The engine that receives the group's migrate steps (see README): the live engine with the lowest DP
        rank, except that a settled coordinator keeps them while it is live (see the module docstring)."""
        return self._coordinator(ep_group)

    def _coordinator(self, ep_group: str, excluding: str | None = None) -> str | None:
        members = [m for m in self.group(ep_group) if m.engine_id != excluding]
        if not members:
            return None
        pinned = self._pinned.get(ep_group)
        if pinned is not None:
            if any(m.engine_id == pinned for m in members):
                return pinned
            if excluding is None:
                del self._pinned[ep_group]  # it went stale or left: the lowest live rank again
        return members[0].engine_id

    async def wait_for_coordinator(self, ep_group: str, timeout: float) -> str | None:  # noqa: ASYNC109
        """The group's coordinator, waiting up to `timeout` seconds for one of its engines to say hello."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (engine := self.coordinator(ep_group)) is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
        return engine
