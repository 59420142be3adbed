"""The router's telemetry view of the engines: what hellos, telemetry and routing decisions say about each
engine, kept as numpy columns so routing parts never loop over engines.

Hellos register engines (role, capacity); telemetry overwrites one row in place; decisions made since an
engine's last report are added as in-flight compensation (`solver.routing.ledger.InflightLedger`, the one
ledger the DP simulator's dispatcher keeps too), because telemetry lags the router by up to one reporting
interval and every replica routing on the same stale numbers would herd onto one engine.

Sequence numbers are checked per engine (the lesson from Dynamo's router): a gap is counted, a message
older than the last one is dropped, and a sequence that restarts from a low number means the engine
restarted, so its in-flight compensation is cleared. An engine is a candidate while it is *live* by the one
liveness rule (`shared/liveness.py`, the gateway's and the fleet view's too: a hello or telemetry within
`misses` of its own intervals, capped at `max_silence_s`; the `live_until` column) and its load data is
*fresh*: heard from within `stale_after_s`. One not heard from within `stale_after_s` drops out of the
candidate set until it reports again; one the rule counts dead is dead for every service at once.

Engine ids are the senders' word (on a bus without credentials anyone can name new ones), so the view holds at
most `max_engines` rows: a new id beyond that first makes room by forgetting every engine silent for
`stale_after_s`, and is refused (counted in `counters.engines_refused`) when every row is live. Each row's
in-flight FIFO holds at most `max_inflight_per_engine` decisions (an engine that says hello but never reports
would otherwise keep every request routed to it).

Two counters let readers cache what they derive: `version` changes when membership or a role changes,
`data_version` whenever any column changes (every input below bumps it, a decision by exactly one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from switchyard.shared.liveness import DEFAULT_HELLO_INTERVAL_S, DEFAULT_TELEMETRY_INTERVAL_S, Liveness
from switchyard.shared.schemas import Hello, Telemetry
from switchyard.shared.sequence import Seq, classify
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
    # liveness (`shared/liveness.py`): when each signal last came, at what announced interval, and the rule's answer
    "last_hello": (np.float64, -np.inf),
    "last_telemetry": (np.float64, -np.inf),
    "hello_interval": (np.float64, DEFAULT_HELLO_INTERVAL_S),
    "telemetry_interval": (np.float64, DEFAULT_TELEMETRY_INTERVAL_S),
    "live_until": (np.float64, -np.inf),
    # the hello's `capacity.block_size` (tokens per KV block; 0 before a hello): names a prompt's prefix blocks
    "block_size": (np.int64, 0),
}


@dataclass
class FleetCounters:
    telemetry_gaps: int = 0
    telemetry_out_of_order: int = 0
    engine_restarts: int = 0
    engines_refused: int = 0  # messages from a new engine id while every row was live


@dataclass
class TelemetryView:
    """Per-engine columns, indexed by a stable row number per engine id (rows are never reused).

    `inflight` and `inflight_tokens` (decisions since the engine's last report, and their prompt tokens) are
    the ledger's columns."""

    stale_after_s: float = 1.0
    inflight_grace_s: float = DEFAULT_INFLIGHT_GRACE_S
    capacity: int = 64
    max_engines: int = 4096
    max_inflight_per_engine: int | None = None
    #: The liveness rule (`shared/liveness.py`); `stale_after_s` is the router's own freshness of load data.
    liveness: Liveness = field(default_factory=Liveness)
    engine_ids: list[str] = field(default_factory=list)
    counters: FleetCounters = field(default_factory=FleetCounters)

    def __post_init__(self) -> None:
        n = self.capacity
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

    def row(self, engine_id: str, now: float) -> int:
        """The engine's row, registering it on first sight; -1 (counted) for a new engine when every one of
        `max_engines` rows is live."""
        row = self.index.get(engine_id)
        if row is None:
            n = len(self.engine_ids)
            if n >= self.max_engines:
                if n == 0 or now - float(self.last_seen[:n].min()) <= self.stale_after_s:
                    self.counters.engines_refused += 1
                    return -1
                self.forget(now, self.stale_after_s)  # every stale row at once, not one per newcomer
            row = len(self.engine_ids)
            if row == len(self.role):
                self._grow()
            self.index[engine_id] = row
            self.engine_ids.append(engine_id)
            self.ep_group.append("")
            self.model.append("")
            self.version += 1
            self.data_version += 1
        return row

    # ----- inputs -----

    def on_hello(self, hello: Hello, now: float) -> None:
        row = self.row(hello.engine_id, now)
        if row < 0:
            return
        role = ROLES.index(hello.role)
        if self.role[row] != role or self.model[row] != hello.model.name:
            self.role[row] = role
            self.model[row] = hello.model.name
            self.version += 1
        self.ep_group[row] = hello.ep_group
        self.block_size[row] = hello.capacity.block_size
        self.kv_blocks[row] = hello.capacity.kv_blocks
        self.last_seen[row] = max(self.last_seen[row], now)
        self.last_hello[row] = now
        self.hello_interval[row] = hello.hello_interval_s
        self.telemetry_interval[row] = hello.telemetry_interval_s
        self._relive(row)
        self.data_version += 1

    def on_telemetry(self, t: Telemetry, now: float) -> None:
        row = self.row(t.engine_id, now)
        if row < 0:
            return
        event, _missed = classify(int(self.last_seq[row]), t.seq)
        if event is Seq.LATE:
            self.counters.telemetry_out_of_order += 1
            return
        if event is Seq.GAP:
            self.counters.telemetry_gaps += 1
        elif event is Seq.RESTART:  # what was in flight to the old process is not in the new one's numbers
            self.counters.engine_restarts += 1
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
        self._relive(row)
        self.data_version += 1
        self.ledger.settle(row, now - self.inflight_grace_s)
        self.unreported.settle(row, now - self.inflight_grace_s)

    def _relive(self, row: int) -> None:
        """The row's `live_until` after a hello or telemetry: the rule's scalar form, per message."""
        self.live_until[row] = self.liveness.live_until(
            float(self.last_hello[row]),
            float(self.hello_interval[row]),
            float(self.last_telemetry[row]),
            float(self.telemetry_interval[row]),
        )

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
        """Unregister engines silent for `silent_for_s` (rows are compacted); returns their ids."""
        n = len(self.engine_ids)
        gone = np.flatnonzero(now - self.last_seen[:n] > silent_for_s)
        if len(gone) == 0:
            return []
        keep = np.setdiff1d(np.arange(n), gone)
        forgotten = [self.engine_ids[i] for i in gone]
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
        return forgotten

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

    def routable(self, now: float, stale_after_s: float) -> np.ndarray:
        """Boolean mask over rows: live, and heard from within `stale_after_s` (fresh load data)."""
        n = len(self.engine_ids)
        return (now - self.last_seen[:n] <= stale_after_s) & (now <= self.live_until[:n])

    def alive(self, role: str, now: float) -> np.ndarray:
        """Boolean mask over rows: engines of this role that are live and heard from within `stale_after_s`."""
        n = len(self.engine_ids)
        return (self.role[:n] == ROLES.index(role)) & self.routable(now, self.stale_after_s)

    def stale_count(self, now: float) -> int:
        """Known engines that are not candidates: dead, or without fresh load data."""
        n = len(self.engine_ids)
        known = self.role[:n] != _UNKNOWN_ROLE
        return int(np.count_nonzero(known & ~self.routable(now, self.stale_after_s)))

    def load(self) -> np.ndarray:
        """Requests on each engine as the router believes: running + waiting + in flight (a view, no copy)."""
        n = len(self.engine_ids)
        return self.num_running[:n] + self.num_waiting[:n] + self.inflight[:n]
