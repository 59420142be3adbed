"""The router's per-role snapshot of its telemetry view (`RoleView`), and the engine columns a routing profile
may gather from it (`COLUMNS`, `PER_DECISION`, `CLOCKED`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from switchyard.services.router.telemetry_view import TelemetryView
from switchyard.shared.signals import SIGNALS, need
from switchyard.solver.routing import FleetSnapshot

__all__ = ["CLOCKED", "COLUMNS", "PER_DECISION", "SNAPSHOT_COLUMNS", "Column", "RoleView"]


class RoleView:
    """The engines of one role as a `FleetSnapshot` (sorted ids), kept in step with the fleet columns.

    `refresh` and `gather` re-read the columns only when the fleet's data changed since the last read, and
    liveness is re-checked only when the earliest-expiring live engine may have gone stale (or the clock went
    back), so between telemetry messages a decision costs no per-engine work. A decision recorded through
    `record_decision` right after the fleet counted it is applied in place (load + 1, and the gathered
    in-flight columns by what it adds to them, `PER_DECISION`): the snapshot then equals what a full re-read
    would give (counts and tokens are integer-valued), without one.
    """

    #: Re-check liveness this long before the earliest live engine's deadline (guards float rounding).
    _MARGIN_S = 1e-6

    def __init__(self, fleet: TelemetryView, role: str, columns: Mapping[str, Column] | None = None) -> None:
        self.fleet = fleet
        self.role = role
        self.columns = {**COLUMNS, **columns} if columns else COLUMNS  # the gathers, some the router's own
        self.version = -1
        self.any_alive = False
        self.rebuild()

    def rebuild(self) -> bool:
        """Re-derive rows and snapshot if the fleet's membership changed; True when it did."""
        if self.version == self.fleet.version:
            return False
        self.rows = self.fleet.rows_of(self.role)
        ids = tuple(self.fleet.engine_ids[i] for i in self.rows)
        d = len(ids)
        self.snap = FleetSnapshot(ids, np.zeros(d), np.zeros(d), np.zeros(d, dtype=bool), version=self.fleet.version)
        self.row_of = tuple(int(row) for row in self.rows)  # position -> fleet row, as Python ints
        self.position = {row: i for i, row in enumerate(self.row_of)}
        self.models = tuple(self.fleet.model[row] for row in self.row_of)
        self._serving: dict[str, np.ndarray | None] = {}
        self.version = self.fleet.version
        self._synced = -1  # fleet.data_version the snapshot reflects
        self._gathered: tuple[tuple[str, ...], int] = ((), -1)  # the gathered columns, and the data_version
        self._last_seen = np.zeros(d)
        self._live_until = np.zeros(d)  # the liveness rule's column (`shared/liveness.py`)
        self._held = np.zeros(d, dtype=bool)  # held out of rotation by the book's owner
        self._live_now = np.zeros(d, dtype=bool)
        self._checked_at = np.inf  # when liveness was last evaluated
        self._alive_until = -np.inf  # liveness holds while now < this
        self._fresh_load_s = np.nan  # ... for this staleness limit
        return True

    def refresh(self, now: float, fresh_load_s: float) -> FleetSnapshot:
        f, snap = self.fleet, self.snap
        if self._synced != f.data_version:
            rows = self.rows
            np.take(f.num_running, rows, out=snap.load)
            snap.load += f.num_waiting[rows]
            snap.load += f.inflight[rows]
            np.take(f.kv_usage, rows, out=snap.kv_usage)
            np.take(f.last_seen, rows, out=self._last_seen)
            np.take(f.live_until, rows, out=self._live_until)
            np.take(f.held, rows, out=self._held)
            self._synced = f.data_version
            self._check_alive(now, fresh_load_s)
        elif not self._checked_at <= now < self._alive_until or fresh_load_s != self._fresh_load_s:
            self._check_alive(now, fresh_load_s)
        return snap

    def _check_alive(self, now: float, fresh_load_s: float) -> None:
        # A candidate is live by the liveness rule and heard from within fresh_load_s (fresh load data).
        alive = np.less_equal(now - self._last_seen, fresh_load_s, out=self.snap.alive)
        alive &= np.less_equal(now, self._live_until, out=self._live_now)
        alive &= ~self._held
        self.any_alive = bool(alive.any())
        self._checked_at, self._fresh_load_s = now, fresh_load_s
        # A candidate drops out at min(last_seen + fresh_load_s, live_until); a dropped one only comes back
        # by reporting (a data change). Without a candidate nothing can expire.
        if self.any_alive:
            fresh_until = float(np.minimum.reduce(self._last_seen[alive])) + fresh_load_s
            earliest = min(fresh_until, float(np.minimum.reduce(self._live_until[alive])))
        else:
            earliest = np.inf
        self._alive_until = earliest - self._MARGIN_S

    def gather(self, names: tuple[str, ...]) -> None:
        """Fill the snapshot's extra `columns` a profile reads (`COLUMNS`) from the fleet's, unless they already
        show its data."""
        f, rows, columns = self.fleet, self.rows, self.snap.columns
        if self._gathered == (names, f.data_version):
            return
        for name in names:
            columns[name] = self.columns[name](f, rows, self.snap)
        self._gathered = (names, f.data_version)

    def prepare(self, now: float, fresh_load_s: float, columns: tuple[str, ...]) -> FleetSnapshot:
        """The snapshot as a decision reads it: membership, liveness and load, and the extra `columns` its
        profile reads (each step does nothing when nothing changed since it last ran)."""
        self.rebuild()
        snap = self.refresh(now, fresh_load_s)
        if columns:
            self.gather(columns)
            if "recent_sends" in columns:  # `CLOCKED`: decayed to `now` and re-read at every decision
                snap.columns["recent_sends"] = self.fleet.recent.at(now)[self.rows]
        return snap

    def serving(self, model: str | None) -> np.ndarray | None:
        """Mask of the engines serving `model`, None when no filter is needed (no model asked for, or every
        engine of the view serves it). Cached until the view's membership changes (a model change is one)."""
        if model is None:
            return None
        mask = self._serving.get(model, False)
        if mask is False:
            if len(self._serving) > 64:  # model names come from requests: bound the cache
                self._serving.clear()
            serves = np.array([m == model for m in self.models], dtype=bool)
            mask = self._serving[model] = None if serves.all() else serves
        return mask

    def alive_for(self, model: str | None) -> np.ndarray:
        """The snapshot's liveness, narrowed to the engines serving `model` (a new array only when narrowed)."""
        mask = self.serving(model)
        return self.snap.alive if mask is None else self.snap.alive & mask

    def record_decision(self, row: int, prompt_tokens: float) -> None:
        """The fleet has just counted one more request in flight on `row` (`TelemetryView.on_decision*`)."""
        version = self.fleet.data_version
        i = self.position.get(row)
        if self._synced == version - 1:  # in step until that decision: follow it in place
            if i is not None:
                self.snap.load[i] += 1
            self._synced = version
        names, gathered = self._gathered
        if gathered == version - 1:
            if i is not None:
                columns = self.snap.columns
                for name in names:
                    add = PER_DECISION.get(name)
                    if add is not None:
                        columns[name][i] += add(prompt_tokens)
            for name in CLOCKED.intersection(names):  # the decision decayed every row: re-read, not followed
                self.snap.columns[name] = self.columns[name](self.fleet, self.rows, self.snap)
            self._gathered = (names, version)


#: Engine signals (`shared.signals`) a routing profile may read beyond the snapshot's own (load, kv_usage,
#: alive), from the telemetry view's rows: a signal copied from a message field is its view column (no code
#: here); the derived ones follow. `waiting` counts this replica's and the others' decisions since the last
#: report as waiting, as vLLM's client counts its own; `outstanding` is the router's best count of unfinished
#: requests.
SNAPSHOT_COLUMNS = need("load", "kv_usage", "alive")
Column = Callable[[TelemetryView, np.ndarray, FleetSnapshot], np.ndarray]
COLUMNS: dict[str, Column] = {
    **{
        s.name: (lambda f, rows, snap, view=s.view: getattr(f, view)[rows])
        for s in SIGNALS.values()
        if s.field is not None and s.view is not None and s.name not in SNAPSHOT_COLUMNS
    },
    "inflight_tokens": lambda f, rows, snap: f.inflight_tokens[rows],
    "inflight": lambda f, rows, snap: f.inflight[rows],
    "waiting": lambda f, rows, snap: f.num_waiting[rows] + f.inflight[rows],
    "outstanding": lambda f, rows, snap: snap.load,
    "kv_blocks": lambda f, rows, snap: f.kv_blocks[rows],  # from the engine's hello (`Hello.capacity`)
    # the exact ledger (requests routed with `progress`) plus, for the others, what is in flight by telemetry
    "pending_prefill": lambda f, rows, snap: f.exact.pending_prefill[rows] + f.unreported.tokens[rows],
    "pending": lambda f, rows, snap: f.exact.pending[rows] + f.unreported.count[rows],
    "decoding": lambda f, rows, snap: f.exact.decoding[rows],
    # every decision, decaying (`RecentSends`; as of the last decay here: `RoleView.prepare` decays it to `now`)
    "recent_sends": lambda f, rows, snap: f.recent.column[rows],
    "indexed_blocks": lambda f, rows, snap: np.zeros(len(rows)),  # RouterCore gathers it from its prefix index
}
#: What one decision (one more request in flight, of its prompt tokens) adds to the columns above that count
#: requests in flight, given its prompt tokens; the others only change with a report.
PER_DECISION: dict[str, Callable[[float], float]] = {
    "inflight": lambda tokens: 1.0,
    "inflight_tokens": lambda tokens: tokens,
    "waiting": lambda tokens: 1.0,
    "pending_prefill": lambda tokens: tokens,
    "pending": lambda tokens: 1.0,
}
#: Columns that change with time as well as with the fleet's data (`recent_sends` decays): `RoleView.prepare`
#: decays and re-reads them at every decision, and `record_decision` re-reads them (a decision first decays
#: every row, so adding to one row in place would not equal a fresh read).
CLOCKED = frozenset({"recent_sends"})
if _ungathered := sorted(set(SIGNALS) - SNAPSHOT_COLUMNS - set(COLUMNS)):  # a new derived signal needs code here
    raise AssertionError(f"the router has no gather for signal(s) {', '.join(_ungathered)} (services/router/core.py)")
need(*COLUMNS, *PER_DECISION)
