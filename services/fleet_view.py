"""A live view of the engines, built from their hellos and telemetry (core NATS, latest value wins).

The migration service asks it who coordinates an EP group, the placement service (and its calibrations) which
GPUs and DP ranks a group has (`topology`), and the API shows it as `/v1/engines`. An engine is *stale* when it
is not live by the one liveness rule (`shared/liveness.py`, the router's and the gateway's too): neither a hello
nor telemetry arrived within `misses` (here `stale_intervals`) of its own announced intervals, each window at
most `max_silence_s`, so a dead engine drops out by itself. Telemetry sequence numbers are checked per engine: a
jump forward is a gap (lost messages), a jump back a restart. (Not the router's `services/router` fleet columns:
this view is for the control plane, which needs who and where, not per-request load.)

A hello's `ep_group` and `dp_rank` are the engine's own word; bus permissions prove only its id. With an
engine manifest every claim is checked against it. Without one, no engine may take a place a *live* engine
holds (see docs/security.md, "Group claims"): a hello naming a (group, rank) that another live engine holds, or
moving a live engine to another group or rank, is refused and counted; and a group's coordinator, once it has
been live for one hello interval, keeps the migrate steps while it stays live, so an engine that joins later
with a lower rank cannot take them over.

Every value it keeps is keyed by what engines say (ids, groups, ranks), so each is bounded: at most
`max_engines` engines, whose stored hellos weigh at most `max_hello_bytes` (a hello lists up to 1,024 GPU names
of any length: 4,096 of those would be over a GiB); a newcomer, or a heavier hello, takes the place of the least
recently heard engines only if they are stale, else it is refused and counted. An engine that moves leaves its
old place and group behind, and engines silent for `forget_after_s` are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.subscription import Subscription
from prometheus_client import Counter

from switchyard.shared.bus import Bus
from switchyard.shared.engine_manifest import EngineManifest
from switchyard.shared.liveness import Liveness, LivenessSettings
from switchyard.shared.schemas import Announce, Hello, Telemetry
from switchyard.shared.sequence import Seq, classify

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
#: Engines a fleet view holds at most (each keeps its last hello, up to 256 KiB): ids are the senders' word,
#: and on a bus without credentials anyone can name new ones.
MAX_ENGINES = 4096
#: What the stored hellos may weigh together (`hello_weight`, about their size in memory).
MAX_HELLO_BYTES = 64 * 1024 * 1024


def hello_weight(hello: Hello) -> int:
    """About what a hello costs held in memory: a fixed part and each GPU name (a str object and a list slot)."""
    return 2048 + sum(64 + len(gpu) for gpu in hello.gpus)


@dataclass
class EngineState:
    engine_id: str
    hello: Hello | None = None
    hello_at: float | None = None
    telemetry: Telemetry | None = None
    telemetry_at: float | None = None
    telemetry_gaps: int = 0
    restarts: int = 0
    #: When the engine took its current (group, rank): a coordinator is pinned only once it has held it a while.
    joined_at: float = 0.0
    #: `hello_weight` of the stored hello (0 without one).
    weight: int = 0

    @property
    def last_seen(self) -> float:
        return max(self.hello_at or 0.0, self.telemetry_at or 0.0)


class FleetView:
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
        self.liveness = liveness
        #: The engine manifest: a hello claiming another group, rank, role, model or URL than its engine's entry
        #: is refused (an engine's credentials prove its id; without this it could name any group and become
        #: its migrate coordinator). None: every hello is believed.
        self.manifest = manifest
        #: Engines silent this long are dropped (pods come and go; the view must not grow forever).
        self.forget_after_s = forget_after_s
        self.max_engines = max_engines
        self.max_hello_bytes = max_hello_bytes
        self.hello_bytes = 0  # the stored hellos' weight
        #: Least recently heard first (each message moves its engine to the end): the one a newcomer may evict.
        self.engines: OrderedDict[str, EngineState] = OrderedDict()
        self._changed = asyncio.Event()
        self._next_prune = 0.0
        #: (group, rank) -> the engine last accepted there; a live holder keeps it (see the module docstring).
        self._slots: dict[tuple[str, int], str] = {}
        #: group -> the coordinator that keeps the migrate steps while it is live, though a lower rank joined.
        self._pinned: dict[str, str] = {}
        #: group -> engines whose hello named it (an index: `group` must not scan every engine per hello).
        self._members: dict[str, set[str]] = {}

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

    def _state(self, engine_id: str) -> EngineState | None:
        """The engine's record, moved to the most recently heard end; a new one if there is room (None and
        counted if not)."""
        now = self.clock()
        if now >= self._next_prune:  # at most once a minute: an O(engines) pass
            self._next_prune = now + 60.0
            for gone in [e for e, s in self.engines.items() if now - s.last_seen > self.forget_after_s]:
                self._drop(gone)
        state = self.engines.get(engine_id)
        if state is not None:
            self.engines.move_to_end(engine_id)
            return state
        room = lambda: len(self.engines) < self.max_engines  # noqa: E731
        if not room() and not self._evict_stale(room):
            ENGINES_REFUSED.labels("max_engines").inc()
            return None
        state = self.engines[engine_id] = EngineState(engine_id)
        return state

    def _evict_stale(self, enough: Callable[[], bool], keep: str | None = None) -> bool:
        """Drop the least recently heard engines while they are stale, until `enough()`; whether it is. A live
        engine is never dropped to make room, nor `keep` (the one making it)."""
        while not enough():
            oldest = next(iter(self.engines.values()), None)
            if oldest is None or oldest.engine_id == keep or not self.is_stale(oldest):
                return False
            self._drop(oldest.engine_id)
        return True

    def _store_hello(self, state: EngineState, hello: Hello) -> bool:
        """Keep `hello` as the engine's, within `max_hello_bytes` (making room from stale engines); False and
        counted if it does not fit."""
        weight = hello_weight(hello)
        extra = weight - state.weight
        fits = lambda: self.hello_bytes + extra <= self.max_hello_bytes  # noqa: E731
        if extra > 0 and not self._evict_stale(fits, keep=state.engine_id):
            ENGINES_REFUSED.labels("max_hello_bytes").inc()
            return False
        self.hello_bytes += extra
        state.hello, state.weight = hello, weight
        return True

    def _drop(self, engine_id: str) -> None:
        """Forget an engine and every index entry that names it."""
        state = self.engines.pop(engine_id, None)
        if state is not None and state.hello is not None:
            self._leave(engine_id, state.hello)
            self.hello_bytes -= state.weight

    def _leave(self, engine_id: str, hello: Hello) -> None:
        """The engine no longer holds the place its `hello` named: drop that slot, membership and pin."""
        slot = (hello.ep_group, hello.dp_rank)
        if self._slots.get(slot) == engine_id:
            del self._slots[slot]
        members = self._members.get(hello.ep_group)
        if members is not None:
            members.discard(engine_id)
            if not members:
                del self._members[hello.ep_group]
        if self._pinned.get(hello.ep_group) == engine_id:
            del self._pinned[hello.ep_group]

    def on_hello(self, hello: Hello, _msg: object = None) -> None:
        refused = self.manifest.refusal(hello) if self.manifest is not None else None
        if refused is not None:
            UNBOUND_HELLOS.labels("wrong_group_or_rank" if refused in ("ep_group", "dp_rank") else refused).inc()
            return
        slot = (hello.ep_group, hello.dp_rank)
        refusal = self._claim_refusal(hello.engine_id, slot)
        if refusal is not None:
            UNBOUND_HELLOS.labels(refusal).inc()
            return
        state = self._state(hello.engine_id)
        if state is None:
            return
        now = self.clock()
        previous = state.hello  # liveness and the coordinator are judged on it, before the new hello is stored
        periodic = previous is not None and self._live_slot(hello.engine_id) == slot  # a live member: nothing moves
        before = None if periodic else self.coordinator(hello.ep_group)
        if not self._store_hello(state, hello):
            if previous is None and state.telemetry is None:
                del self.engines[hello.engine_id]  # created for this hello only
            return
        if periodic:
            state.hello_at = now
            self._changed.set()
            return
        if previous is not None:
            self._leave(hello.engine_id, previous)
        state.hello_at, state.joined_at = now, now
        self._slots[slot] = hello.engine_id
        self._members.setdefault(hello.ep_group, set()).add(hello.engine_id)
        if before is not None and before != hello.engine_id and self.coordinator(hello.ep_group) != before:
            holder = self.engines[before]
            if holder.hello is not None and now - holder.joined_at >= holder.hello.hello_interval_s:
                self._pinned[hello.ep_group] = before  # settled: a newcomer with a lower rank does not take over
        self._changed.set()

    def _live_slot(self, engine_id: str) -> tuple[str, int] | None:
        state = self.engines.get(engine_id)
        if state is None or state.hello is None or self.is_stale(state):
            return None
        return state.hello.ep_group, state.hello.dp_rank

    def _claim_refusal(self, engine_id: str, slot: tuple[str, int]) -> str | None:
        """Why a hello from `engine_id` claiming `slot` is refused (None: accepted): a live place is its own."""
        current = self._live_slot(engine_id)
        if current is not None and current != slot:
            return "rebind_while_live"  # the same credentials naming another place while the engine is live
        holder = self._slots.get(slot)
        if holder is not None and holder != engine_id and self._live_slot(holder) == slot:
            return "slot_taken"
        return None

    def on_telemetry(self, telemetry: Telemetry, _msg: object = None) -> None:
        state = self._state(telemetry.engine_id)
        if state is None:
            return
        event, missed = classify(state.telemetry.seq if state.telemetry else None, telemetry.seq)
        if event is Seq.LATE:
            return  # newer data is already in
        state.telemetry_gaps += missed
        state.restarts += event is Seq.RESTART
        state.telemetry, state.telemetry_at = telemetry, self.clock()

    @property
    def stale_intervals(self) -> float:
        return self.liveness.misses

    def live_until(self, state: EngineState) -> float:
        """The liveness rule's answer for the engine's last hello and telemetry (intervals from its hello)."""
        hello = state.hello
        if hello is None:
            return self.liveness.live_until(state.hello_at, last_telemetry=state.telemetry_at)
        return self.liveness.live_until(
            state.hello_at, hello.hello_interval_s, state.telemetry_at, hello.telemetry_interval_s
        )

    def is_stale(self, state: EngineState) -> bool:
        """Not live by the liveness rule: no hello within `misses` hello intervals and no telemetry within as
        many telemetry intervals (each window at most `max_silence_s`)."""
        return not Liveness.is_live(self.live_until(state), self.clock())

    def group(self, ep_group: str, live_only: bool = True) -> list[EngineState]:
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
        members = self.group(ep_group)
        if not members:
            return None
        pinned = self._pinned.get(ep_group)
        if pinned is not None:
            if any(m.engine_id == pinned for m in members):
                return pinned
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
