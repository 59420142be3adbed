"""The engine book: the one place a process admits engines, stamps their liveness and checks their telemetry.

Every service that knows engines used to keep its own book, each admitting and evicting by its own rules (the
router's columns, the gateway's registry, the fleet view of the API, placement and migration); one process held
two. Now each of those is a *projection* (`BookListener`) over one `EngineBook`, told of every change in the
order the book made it, and a process feeds each hello and telemetry message to its book once.

Admission, in this order, for a hello:

1. the engine manifest (`shared/engine_manifest.py`; strict mode hands the book an empty one): a hello is believed
   only when it matches its engine's entry (role, model, base URL, EP group, DP rank);
2. group-slot claims (when `claims` is on, as in the fleet view: placement's and migration's coordinators come
   from it): no engine may take a (group, rank) a *live* engine holds, nor move a live engine elsewhere;
3. the id cap: at most `max_engines` engines, whose stored hellos weigh at most `max_hello_bytes`. Ids are the
   senders' word (on a bus without credentials anyone can name new ones), so a newcomer takes the place of the
   least recently heard engines only if they are dead by the liveness rule (and no projection `keeps` them:
   the gateway keeps an engine with requests in flight); else it is refused.

Telemetry needs no hello to be held: telemetry before the hello (a restarted consumer) counts for liveness and
load once the hello comes. Its sequence number is checked here (`shared/sequence.classify`): a late message is
dropped and is no proof of life; a gap and a restart are counted. Liveness is the one rule
(`shared/liveness.py`), stamped per message into `BookEntry.live_until`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from switchyard.services.engine_book.entry import BookEntry, BookListener, HelloChange
from switchyard.shared.engine_manifest import EngineManifest
from switchyard.shared.liveness import Liveness
from switchyard.shared.schemas import Hello, Telemetry
from switchyard.shared.sequence import Seq, classify

__all__ = ["MAX_ENGINES", "MAX_HELLO_BYTES", "BookCounters", "EngineBook", "hello_weight"]

#: Engines a book holds at most (each keeps its last hello, up to 256 KiB).
MAX_ENGINES = 4096
#: What the stored hellos may weigh together (`hello_weight`, about their size in memory).
MAX_HELLO_BYTES = 64 * 1024 * 1024


def hello_weight(hello: Hello) -> int:
    """About what a hello costs held in memory: a fixed part and each GPU name (a str object and a list slot)."""
    return 2048 + sum(64 + len(gpu) for gpu in hello.gpus)


@dataclass
class BookCounters:
    telemetry_gaps: int = 0  # telemetry gaps seen (events, not messages lost)
    telemetry_out_of_order: int = 0  # late telemetry dropped
    engine_restarts: int = 0
    engines_refused: int = 0  # hellos and telemetry from new ids while the book was full of live engines


class EngineBook:
    def __init__(
        self,
        liveness: Liveness | None = None,
        manifest: EngineManifest | None = None,
        *,
        max_engines: int = MAX_ENGINES,
        max_hello_bytes: int = MAX_HELLO_BYTES,
        claims: bool = True,
    ) -> None:
        self.liveness = liveness or Liveness()
        self.manifest = manifest
        self.max_engines, self.max_hello_bytes, self.claims = max_engines, max_hello_bytes, claims
        #: Least recently heard first (each accepted message moves its engine to the end).
        self.entries: OrderedDict[str, BookEntry] = OrderedDict()
        self.counters = BookCounters()
        self.hello_bytes = 0  # the stored hellos' weight
        #: (group, rank) -> the engine last accepted there; group -> engines whose hello named it.
        self.slots: dict[tuple[str, int], str] = {}
        self.members: dict[str, set[str]] = {}
        self._listeners: list[BookListener] = []
        #: Projections' vetoes on forgetting an engine (the gateway's: requests in flight to it).
        self._keeps: list[Callable[[str], bool]] = []

    def listen(self, listener: BookListener, keeps: Callable[[str], bool] | None = None) -> None:
        """Tell `listener` of every change from now on (`keeps`: engines it needs kept though dead)."""
        self._listeners.append(listener)
        if keeps is not None:
            self._keeps.append(keeps)

    # ----- admission -----

    def on_hello(self, hello: Hello, now: float) -> BookEntry | None:
        """Admit or refresh an engine by its hello; None when refused (every listener is told why)."""
        engine_id = hello.engine_id
        refused = self.manifest.refusal(hello) if self.manifest is not None else None
        if refused is None and self.claims:
            refused = self._claim_refusal(engine_id, (hello.ep_group, hello.dp_rank), now)
        if refused is None:
            refused = self._make_room(engine_id, hello_weight(hello), now)
        if refused is not None:
            self._refuse(refused, engine_id)
            return None
        entry = self._entry(engine_id)
        previous, was_live = entry.hello, entry.is_live(now)
        slot = (hello.ep_group, hello.dp_rank)
        weight = hello_weight(hello)
        self.hello_bytes += weight - entry.weight
        entry.hello, entry.weight, entry.hello_at = hello, weight, now
        entry.base_url = hello.base_url.rstrip("/") if hello.base_url is not None else None
        if previous is None or not was_live or (previous.ep_group, previous.dp_rank) != slot:
            if previous is not None:
                self._leave_slot(engine_id, previous)
            entry.joined_at = now
            self.slots[slot] = engine_id
            self.members.setdefault(hello.ep_group, set()).add(engine_id)
        if entry.live_since == 0.0 or not was_live:
            entry.live_since = now
        self._relive(entry)
        change = HelloChange.JOIN if previous is None or not was_live else _change(previous, hello)
        for listener in self._listeners:
            listener.hello_accepted(entry, change, previous)
        return entry

    def on_telemetry(self, telemetry: Telemetry, now: float) -> BookEntry | None:
        """Stamp an engine's telemetry (held before its hello too); None when refused for room. A late message is
        dropped (counted) and proves nothing."""
        engine_id = telemetry.engine_id
        entry = self.entries.get(engine_id)
        if entry is None:
            refused = self._make_room(engine_id, 0, now)
            if refused is not None:
                self._refuse(refused, engine_id)
                return None
            entry = self._entry(engine_id)
        event, missed = classify(entry.last_seq, telemetry.seq)
        if event is Seq.LATE:
            self.counters.telemetry_out_of_order += 1
            return entry
        if event is Seq.GAP:
            self.counters.telemetry_gaps += 1
            entry.telemetry_gaps += missed
        elif event is Seq.RESTART:
            self.counters.engine_restarts += 1
            entry.restarts += 1
        revived = not entry.is_live(now)
        entry.telemetry, entry.telemetry_at, entry.last_seq = telemetry, now, telemetry.seq
        if revived:
            entry.live_since = now
        self._relive(entry)
        self.entries.move_to_end(engine_id)
        for listener in self._listeners:
            listener.telemetry_accepted(entry, telemetry, event, revived)
        return entry

    def _entry(self, engine_id: str) -> BookEntry:
        """The engine's entry, moved to the most recently heard end; a new one (listeners told) if it had none."""
        entry = self.entries.get(engine_id)
        if entry is not None:
            self.entries.move_to_end(engine_id)
            return entry
        entry = self.entries[engine_id] = BookEntry(engine_id)
        for listener in self._listeners:
            listener.entry_added(entry)
        return entry

    def _refuse(self, reason: str, engine_id: str) -> None:
        if reason in ("max_engines", "max_hello_bytes"):
            self.counters.engines_refused += 1
        for listener in self._listeners:
            listener.refusal(reason, engine_id)

    def _claim_refusal(self, engine_id: str, slot: tuple[str, int], now: float) -> str | None:
        """Why a hello from `engine_id` claiming `slot` is refused (None: accepted): a live place is its own."""
        current = self._live_slot(engine_id, now)
        if current is not None and current != slot:
            return "rebind_while_live"  # the same credentials naming another place while the engine is live
        holder = self.slots.get(slot)
        if holder is not None and holder != engine_id and self._live_slot(holder, now) == slot:
            return "slot_taken"
        return None

    def _live_slot(self, engine_id: str, now: float) -> tuple[str, int] | None:
        entry = self.entries.get(engine_id)
        if entry is None or entry.hello is None or not entry.is_live(now):
            return None
        return entry.slot

    def _make_room(self, engine_id: str, weight: int, now: float) -> str | None:
        """Room for `engine_id` (new) or its heavier hello, dropping the least recently heard dead engines if need
        be; the refusal's reason when there is none."""
        entry = self.entries.get(engine_id)
        gone: list[str] = []
        reason = None
        if entry is None and not self._evict_dead(lambda: len(self.entries) < self.max_engines, engine_id, now, gone):
            reason = "max_engines"
        extra = weight - (entry.weight if entry is not None else 0)
        fits = lambda: self.hello_bytes + extra <= self.max_hello_bytes  # noqa: E731
        if reason is None and extra > 0 and not self._evict_dead(fits, engine_id, now, gone):
            reason = "max_hello_bytes"
        self._gone(gone)
        return reason

    def _evict_dead(self, enough: Callable[[], bool], keep: str, now: float, gone: list[str]) -> bool:
        """Drop the least recently heard engines while they are dead and not kept, until `enough()`."""
        while not enough():
            oldest = next(iter(self.entries.values()), None)
            if oldest is None or oldest.engine_id == keep or oldest.is_live(now) or self._kept(oldest.engine_id):
                return False
            self._drop(oldest.engine_id)
            gone.append(oldest.engine_id)
        return True

    def _kept(self, engine_id: str) -> bool:
        return any(keeps(engine_id) for keeps in self._keeps)

    def hold(self, engine_id: str, held: bool) -> None:
        """The owner takes an engine out of rotation (or puts it back): every projection is told, so the router's
        columns never offer what the gateway would not send to."""
        entry = self.entries.get(engine_id)
        if entry is not None and entry.held != held:
            entry.held = held
            for listener in self._listeners:
                listener.held_changed(entry)

    # ----- leaving -----

    def forget_silent(self, now: float, silent_for_s: float) -> list[str]:
        """Forget engines silent for `silent_for_s` and dead engines that never said hello (their telemetry keeps
        no one live any more), unless a projection keeps them; returns their ids."""
        gone = [
            e.engine_id
            for e in self.entries.values()
            if (now - e.last_seen > silent_for_s or (e.hello is None and not e.is_live(now)))
            and not self._kept(e.engine_id)
        ]
        for engine_id in gone:
            self._drop(engine_id)
        self._gone(gone)
        return gone

    def _drop(self, engine_id: str) -> None:
        entry = self.entries.pop(engine_id)
        if entry.hello is not None:
            self._leave_slot(engine_id, entry.hello)
            self.hello_bytes -= entry.weight

    def _gone(self, gone: list[str]) -> None:
        if gone:
            for listener in self._listeners:
                listener.entries_left(gone)

    def _leave_slot(self, engine_id: str, hello: Hello) -> None:
        """The engine no longer holds the place its `hello` named."""
        slot = (hello.ep_group, hello.dp_rank)
        if self.slots.get(slot) == engine_id:
            del self.slots[slot]
        members = self.members.get(hello.ep_group)
        if members is not None:
            members.discard(engine_id)
            if not members:
                del self.members[hello.ep_group]

    # ----- liveness -----

    def _relive(self, entry: BookEntry) -> None:
        entry.live_until = self.liveness.live_until(
            entry.hello_at, entry.hello_interval_s, entry.telemetry_at, entry.telemetry_interval_s
        )

    def live(self, now: float) -> list[BookEntry]:
        """Engines that said hello and are live now."""
        return [e for e in self.entries.values() if e.hello is not None and e.is_live(now)]

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self.entries


def _change(previous: Hello, hello: Hello) -> str:
    """CHANGE when the hello says anything a projection keeps otherwise than `previous` did, else REFRESH."""
    same = (
        previous.role == hello.role
        and previous.model.name == hello.model.name
        and previous.base_url == hello.base_url
        and previous.ep_group == hello.ep_group
        and previous.dp_rank == hello.dp_rank
        and previous.capacity == hello.capacity
        and previous.hello_interval_s == hello.hello_interval_s
        and previous.telemetry_interval_s == hello.telemetry_interval_s
    )
    return HelloChange.REFRESH if same else HelloChange.CHANGE
