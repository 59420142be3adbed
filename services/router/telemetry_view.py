"""The router's projection of the engine book: what hellos, telemetry and routing decisions say about each
engine, kept as numpy columns so routing parts never loop over engines.

The engine book (`services.engine_book`) admits engines, checks telemetry sequence numbers and stamps liveness;
this view keeps one row per engine the book holds (rows added as the book takes an engine, compacted when it
forgets some), overwritten in place by each accepted message. Decisions made since an engine's last report are
added as in-flight compensation (`solver.routing.ledger.InflightLedger`, the one ledger the DP simulator's
dispatcher keeps too), because telemetry lags the router by up to one reporting interval and every replica
routing on the same stale numbers would herd onto one engine. A telemetry sequence that restarts (the book's
`Seq.RESTART`) means the engine restarted, so its in-flight compensation is cleared.

An engine is a candidate while it is *live* by the one liveness rule (the `live_until` column, the book's
stamp), its load data is *fresh* (heard from within `fresh_load_s`) and its owner does not hold it out of
rotation (`held`: the in-process gateway's ejected and on-trial engines, and engines serving no HTTP there).
Each row's in-flight FIFO holds at most `max_inflight_per_engine` decisions (an engine that says hello but
never reports would otherwise keep every request routed to it).

Two counters let readers cache what they derive: `version` changes when membership or a role changes,
`data_version` whenever any column changes (every input below bumps it, a decision by exactly one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from switchyard.services.engine_book import BookCounters, BookEntry, BookListenerBase, EngineBook
from switchyard.shared.engine_manifest import EngineManifest
from switchyard.shared.liveness import Liveness
from switchyard.shared.schemas import Hello, Telemetry
from switchyard.shared.sequence import Seq
from switchyard.shared.signals import telemetry_view_columns
from switchyard.solver.routing.defaults import DEFAULT_INFLIGHT_GRACE_S
from switchyard.solver.routing.exact_ledger import ExactLedger, RecentSends
from switchyard.solver.routing.ledger import InflightLedger

ROLES = ("prefill", "decode", "dp")
_UNKNOWN_ROLE = -1
#: Every per-engine column: dtype and the value of a row no engine has filled yet. Between the view's own
#: (role, last_seen, last_seq), one per engine signal stored from a message field, as the registry declares
#: it (`shared.signals`: kv_usage, num_running, num_waiting, waiting_prefill, remaining_prefill, step_time,
#: expert_pressure, migrating); `on_telemetry` fills them, and `on_hello` the hello's kv_blocks.
_COLUMNS: dict[str, tuple[type, float]] = {
    "role": (np.int8, _UNKNOWN_ROLE),
    **telemetry_view_columns(),
    "last_seen": (np.float64, -np.inf),
    "last_seq": (np.int64, -1),
    # when each signal last came, and the book's liveness stamp (`shared/liveness.py`)
    "last_hello": (np.float64, -np.inf),
    "last_telemetry": (np.float64, -np.inf),
    "live_until": (np.float64, -np.inf),
    # the hello's `capacity.block_size` (tokens per KV block; 0 before a hello): names a prompt's prefix blocks
    "block_size": (np.int64, 0),
    # held out of rotation by the book's owner (the in-process gateway: ejected, on trial, no HTTP)
    "held": (np.bool_, False),
}


@dataclass
class TelemetryView(BookListenerBase):
    """Per-engine columns, indexed by a stable row number per engine id (rows are never reused), projected from
    an `EngineBook` (`book`; None: a book of its own, built from `liveness` and `max_engines`).

    `inflight` and `inflight_tokens` (decisions since the engine's last report, and their prompt tokens) are
    the ledger's columns."""

    fresh_load_s: float = 1.0
    inflight_grace_s: float = DEFAULT_INFLIGHT_GRACE_S
    capacity: int = 64
    max_engines: int = 4096
    max_inflight_per_engine: int | None = None
    #: The liveness rule (`shared/liveness.py`) of the book built when none is given.
    liveness: Liveness = field(default_factory=Liveness)
    book: EngineBook | None = None
    manifest: EngineManifest | None = None
    engine_ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.capacity
        if self.book is None:
            self.book = EngineBook(self.liveness, self.manifest, max_engines=self.max_engines, claims=False)
        self.liveness = self.book.liveness
        #: Bumped whenever an engine joins, leaves or changes role or model: per-role views rebuild on a change.
        self.version = 0
        #: Bumped by every change to any column (hello, telemetry, decision, forget): derived views re-read.
        self.data_version = 0
        self.index: dict[str, int] = {}
        self.ep_group: list[str] = []
        #: The model each engine serves (its hello's `model.name`; "" until its hello): routes filter on it.
        self.model: list[str] = []
        for name, (dtype, fill) in _COLUMNS.items():
            setattr(self, name, np.full(n, fill, dtype=dtype))
        self.ledger = InflightLedger(n, self.max_inflight_per_engine)
        #: The exact ledger (`solver.routing.exact_ledger`): requests routed with ``progress``, settled by the
        #: sender's first-token and end reports (`on_progress`), not by telemetry timing.
        self.exact = ExactLedger(n)
        #: Requests routed without ``progress`` (clients that never report, other replicas' decisions): what the
        #: exact columns add for them, settled by telemetry as `ledger` is (`on_telemetry`).
        self.unreported = InflightLedger(n, self.max_inflight_per_engine)
        #: Every decision (reported or not, this replica's or another's), decaying over tens of ms: the
        #: ``recent_sends`` column (`RecentSends.at` decays it to a decision's time).
        self.recent = RecentSends(n)
        #: Whether a profile reads ``recent_sends`` (`RouterCore` sets it): only then is each decision counted
        #: there, since counting one decays every row (a numpy pass per decision the default profile need not pay).
        self.tracks_recent = False
        for entry in self.book.entries.values():  # a book already in use: its engines first
            self.entry_added(entry)
            self._fill(entry)
        self.book.listen(self)

    @property
    def counters(self) -> BookCounters:
        """The book's counts (telemetry gaps, late messages, restarts, engines refused)."""
        assert self.book is not None
        return self.book.counters

    @property
    def inflight(self) -> np.ndarray:
        """Decisions in flight per row (the ledger's count column; a view, not a copy)."""
        return self.ledger.count

    @property
    def inflight_tokens(self) -> np.ndarray:
        """Their prompt tokens per row (the ledger's token column)."""
        return self.ledger.tokens

    # ----- bookkeeping -----

    def __len__(self) -> int:
        return len(self.engine_ids)

    def _grow(self) -> None:
        for name, (_, fill) in _COLUMNS.items():
            column = getattr(self, name)
            grown = np.full(len(column) * 2, fill, dtype=column.dtype)
            grown[: len(column)] = column
            setattr(self, name, grown)
        self.ledger.resize(len(self.role))
        self.exact.resize(len(self.role))
        self.unreported.resize(len(self.role))
        self.recent.resize(len(self.role))

    # ----- inputs: the book's messages, and what it tells this projection -----

    def on_hello(self, hello: Hello, now: float) -> None:
        """Feed the book a hello (a view with a book of its own; a shared book is fed by its owner)."""
        assert self.book is not None
        self.book.on_hello(hello, now)

    def on_telemetry(self, t: Telemetry, now: float) -> None:
        assert self.book is not None
        self.book.on_telemetry(t, now)

    def entry_added(self, entry: BookEntry) -> None:
        row = len(self.engine_ids)
        if row == len(self.role):
            self._grow()
        self.index[entry.engine_id] = row
        self.engine_ids.append(entry.engine_id)
        self.ep_group.append("")
        self.model.append("")
        self.version += 1
        self.data_version += 1

    def _fill(self, entry: BookEntry) -> None:
        """Copy an entry the book held before this view listened (its hello and last telemetry)."""
        if entry.telemetry is not None:
            self.telemetry_accepted(entry, entry.telemetry, Seq.FIRST, False)
        if entry.hello is not None:
            self.hello_accepted(entry, "join", None)
        self.held_changed(entry)

    def hello_accepted(self, entry: BookEntry, change: str, previous: Hello | None) -> None:
        hello = entry.hello
        assert hello is not None
        row = self.index[entry.engine_id]
        role = ROLES.index(hello.role)
        if self.role[row] != role or self.model[row] != hello.model.name:
            self.role[row] = role
            self.model[row] = hello.model.name
            self.version += 1
        now = entry.hello_at if entry.hello_at is not None else -np.inf
        self.ep_group[row] = hello.ep_group
        self.block_size[row] = hello.capacity.block_size
        self.kv_blocks[row] = hello.capacity.kv_blocks
        self.last_seen[row] = max(self.last_seen[row], now)
        self.last_hello[row] = now
        self.live_until[row] = entry.live_until
        self.data_version += 1

    def telemetry_accepted(self, entry: BookEntry, t: Telemetry, event: Seq, revived: bool) -> None:
        row = self.index[entry.engine_id]
        now = entry.telemetry_at if entry.telemetry_at is not None else -np.inf
        if event is Seq.RESTART:  # what was in flight to the old process is not in the new one's numbers
            self.ledger.clear(row)
            self.exact.clear(row)
            self.unreported.clear(row)
        self.last_seq[row] = t.seq
        self.kv_usage[row] = t.kv_usage
        self.num_running[row] = t.num_running
        self.num_waiting[row] = t.num_waiting
        self.waiting_prefill[row] = t.waiting_prefill_tokens
        self.remaining_prefill[row] = t.remaining_prefill_tokens
        self.step_time[row] = t.step_time_ema
        self.expert_pressure[row] = max(t.expert_pressure, 1.0)
        self.migrating[row] = t.migrating
        self.last_seen[row] = now
        self.last_telemetry[row] = now
        self.live_until[row] = entry.live_until
        self.data_version += 1
        self.ledger.settle(row, now - self.inflight_grace_s)
        self.unreported.settle(row, now - self.inflight_grace_s)

    def held_changed(self, entry: BookEntry) -> None:
        """Held out of rotation by the book's owner: not a candidate while held."""
        row = self.index[entry.engine_id]
        if bool(self.held[row]) != entry.held:
            self.held[row] = entry.held
            self.data_version += 1

    def entries_left(self, engine_ids: list[str]) -> None:
        """The book forgot these engines: their rows go (the rest compacted)."""
        gone = [self.index[e] for e in engine_ids if e in self.index]
        if gone:
            self._compact(np.array(sorted(gone)))

    def on_decision(self, engine_id: str, prompt_tokens: float, now: float) -> int:
        """A request was sent to this engine (by this or another replica) and is not yet in its telemetry.

        Returns the engine's row, or -1 for an unknown engine (nothing changes then)."""
        row = self.index.get(engine_id)
        if row is None:
            return -1
        self.on_decision_row(row, prompt_tokens, now)
        return row

    def on_decision_row(
        self, row: int, prompt_tokens: float, now: float, request_id: str | None = None, owner: str | None = None
    ) -> None:
        """`on_decision` for a known row: one more request in flight (`data_version` + 1 exactly). With a
        `request_id` (its sender, `owner`, reports progress) it enters the exact ledger, else `unreported`; an id
        already open there (a sender reusing ids) is counted as unreported too."""
        self.ledger.add(row, now, prompt_tokens)
        if self.tracks_recent:
            self.recent.sent(row, now)
        if request_id is not None and request_id not in self.exact:
            self.exact.sent(request_id, row, prompt_tokens, owner, now)
        else:
            self.unreported.add(row, now, prompt_tokens)
        self.data_version += 1

    def on_progress(self, first: list[str], done: list[str], owner: str | None = None, now: float = 0.0) -> None:
        """A sender's progress report: first tokens, then ends, settle the exact ledger (ids not held, or held for
        another owner: ignored)."""
        for request_id in first:
            self.exact.first_token(request_id, owner, now)
        for request_id in done:
            self.exact.finished(request_id, owner)
        self.data_version += 1

    def touch(self) -> None:
        """Something a routing column is derived from changed outside these columns (the prefix index): readers
        re-read (`data_version` + 1)."""
        self.data_version += 1

    def forget(self, now: float, silent_for_s: float) -> list[str]:
        """Have the book forget engines silent for `silent_for_s` (rows are compacted); returns their ids."""
        assert self.book is not None
        return self.book.forget_silent(now, silent_for_s)

    def _compact(self, gone: np.ndarray) -> None:
        n = len(self.engine_ids)
        keep = np.setdiff1d(np.arange(n), gone)
        for name in _COLUMNS:
            column = getattr(self, name)
            column[: len(keep)] = column[keep]
        self.engine_ids = [self.engine_ids[i] for i in keep]
        self.ep_group = [self.ep_group[i] for i in keep]
        self.ledger.compact(keep)
        self.exact.compact(keep)
        self.unreported.compact(keep)
        self.recent.compact(keep)
        self.model = [self.model[i] for i in keep]
        self.index = {e: i for i, e in enumerate(self.engine_ids)}
        for name, (_, fill) in _COLUMNS.items():
            getattr(self, name)[len(keep) : n] = fill
        self.version += 1
        self.data_version += 1

    def rows_of(self, role: str) -> np.ndarray:
        """Rows of every known engine of `role` (live or not), ordered by engine id."""
        n = len(self.engine_ids)
        rows = np.flatnonzero(self.role[:n] == ROLES.index(role))
        return rows[np.argsort([self.engine_ids[i] for i in rows], kind="stable")] if len(rows) else rows

    # ----- outputs -----

    def live(self, now: float) -> np.ndarray:
        """Boolean mask over rows: live by the liveness rule (the notion every service shares), any role."""
        n = len(self.engine_ids)
        return (self.role[:n] != _UNKNOWN_ROLE) & (now <= self.live_until[:n])

    def routable(self, now: float, fresh_load_s: float) -> np.ndarray:
        """Boolean mask over rows: live, heard from within `fresh_load_s` (fresh load data), and not held."""
        n = len(self.engine_ids)
        return (now - self.last_seen[:n] <= fresh_load_s) & (now <= self.live_until[:n]) & ~self.held[:n]

    def alive(self, role: str, now: float) -> np.ndarray:
        """Boolean mask over rows: engines of this role that are live and heard from within `fresh_load_s`."""
        n = len(self.engine_ids)
        return (self.role[:n] == ROLES.index(role)) & self.routable(now, self.fresh_load_s)

    def stale_count(self, now: float) -> int:
        """Known engines that are not candidates: dead, or without fresh load data."""
        n = len(self.engine_ids)
        known = self.role[:n] != _UNKNOWN_ROLE
        return int(np.count_nonzero(known & ~self.routable(now, self.fresh_load_s)))

    def load(self) -> np.ndarray:
        """Requests on each engine as the router believes: running + waiting + in flight (a view, no copy)."""
        n = len(self.engine_ids)
        return self.num_running[:n] + self.num_waiting[:n] + self.inflight[:n]
