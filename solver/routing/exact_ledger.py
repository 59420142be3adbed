"""The dispatcher's exact ledger: per engine, what it sent that has not reached its first token, and what it sent
that has not finished.

In-flight compensation (`solver.routing.ledger.InflightLedger`) guesses when an engine's telemetry has caught
up with a decision from the report's timing; with reports at engine-specific phases that guess is skewed
(docs/gimbal-dispatch.md, "Why Gimbal's dispatch loses on the conversation trace"). A dispatcher that also sees
each response's first token and end (the gateway streams them; the DP simulator has the same events) knows
instead, exactly:

- ``pending_prefill``: prompt tokens of requests sent and not yet at their first token: the prefill the
  engine still owes (whole prompts: a half-prefilled chunk still counts in full until its first token);
- ``pending``: those requests;
- ``decoding``: requests past their first token and not finished: the engine's decode load.

Columns are float64 (exact for integer counts) so a profile adds them to other columns without a cast; the
caller passes ids and, where entries must expire, times. A first token or end for an id the ledger does not hold
(never sent, or sent before a restart cleared the row) is ignored and counted in `unknown`, so a late or
duplicated report cannot drive a count negative. Each entry has an `owner`, the sender that will report it (the
router's: the gateway that asked); a report from another owner is ignored and counted in `foreign`, so one
gateway cannot settle another's requests. `expire` drops entries whose owner stopped reporting. No I/O.

`RecentSends` is the one clocked column beside it: ``recent_sends``, the requests sent to each engine, each
counting exp(-age / tau) (`RECENT_TAU_S`). The exact ledger forgets a prompt the moment it has its first token;
this remembers for about a step that the engine was just sent one (docs/gimbal-exact-ledger.md).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import numpy as np

__all__ = ["RECENT_TAU_S", "ExactLedger", "RecentSends"]

#: Time constant of `RecentSends` (s): about two mean TTFTs at light load (10.7 ms at conv ÷20: the step a prompt
#: waits for plus its prefill step), a fifth of a 100 ms telemetry interval. A send weighs e^-1 after 20 ms and
#: under 1 % after 100 ms. Fitted with `profiles.RECENT_WEIGHT` on seed 0 at conv ÷20 (10 to 100 ms tried).
RECENT_TAU_S = 0.02


class ExactLedger:
    """Per-request (row, prompt tokens, past first token?) with per-row totals, rows 0..n-1."""

    def __init__(self, rows: int) -> None:
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        self.pending = np.zeros(rows)  # sent, no first token yet (requests)
        self.pending_prefill = np.zeros(rows)  # their prompt tokens
        self.decoding = np.zeros(rows)  # past the first token, not finished (requests)
        self.unknown = 0  # progress reports for ids the ledger does not hold
        self.foreign = 0  # progress reports for ids another owner asked for
        #: id -> (row, prompt tokens, decoding, owner, when it was sent or reached its first token)
        self._req: dict[Hashable, tuple[int, float, bool, str | None, float]] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._req

    @property
    def open(self) -> int:
        """Requests sent and not finished, all rows."""
        return len(self._req)

    def sent(self, rid: Hashable, row: int, prompt_tokens: float, owner: str | None = None, now: float = 0.0) -> None:
        """Request `rid` (`prompt_tokens` to prefill) went to `row`, to be reported by `owner`. An id already
        open is an error."""
        if rid in self._req:
            raise ValueError(f"request {rid!r} is already in the ledger")
        if not 0 <= row < len(self.pending):
            raise ValueError(f"row {row} out of range 0..{len(self.pending) - 1}")
        self._req[rid] = (row, float(prompt_tokens), False, owner, now)
        self.pending[row] += 1
        self.pending_prefill[row] += prompt_tokens

    def _owned(self, rid: Hashable, owner: str | None) -> tuple[int, float, bool, str | None, float] | None:
        """`rid`'s entry when `owner` may report it (counted in `unknown` or `foreign` when not)."""
        entry = self._req.get(rid)
        if entry is None:
            self.unknown += 1
        elif entry[3] != owner:
            self.foreign += 1
            return None
        return entry

    def first_token(self, rid: Hashable, owner: str | None = None, now: float = 0.0) -> None:
        """`rid` produced its first token: its prefill is done, it decodes now. Repeats are no-ops."""
        entry = self._owned(rid, owner)
        if entry is None:
            return
        row, tokens, decoding, _, _ = entry
        if decoding:
            return
        self._req[rid] = (row, tokens, True, owner, now)
        self._unpend(row, tokens)
        self.decoding[row] += 1

    def finished(self, rid: Hashable, owner: str | None = None) -> None:
        """`rid` ended (done, failed or cancelled, with or without a first token): it leaves the ledger."""
        entry = self._owned(rid, owner)
        if entry is None:
            return
        del self._req[rid]
        self._settle(entry)

    def _settle(self, entry: tuple[int, float, bool, str | None, float]) -> None:
        row, tokens, decoding, _, _ = entry
        if decoding:
            self.decoding[row] -= 1
        else:
            self._unpend(row, tokens)

    def expire(self, pending_before: float, decoding_before: float) -> tuple[int, int]:
        """Drop requests sent before `pending_before` with no first token, and those past their first token
        before `decoding_before` with no end (their owner stopped reporting); returns how many of each."""
        stale = [
            rid
            for rid, (_, _, decoding, _, at) in self._req.items()
            if at < (decoding_before if decoding else pending_before)
        ]
        counts = [0, 0]
        for rid in stale:
            entry = self._req.pop(rid)
            counts[entry[2]] += 1
            self._settle(entry)
        return counts[0], counts[1]

    def row_of(self, rid: Hashable) -> int | None:
        """The row `rid` was sent to, while it is open."""
        entry = self._req.get(rid)
        return None if entry is None else entry[0]

    def clear(self, row: int) -> None:
        """Forget every open request on `row` (its engine restarted: none of them will report)."""
        for rid in [r for r, entry in self._req.items() if entry[0] == row]:
            del self._req[rid]
        self.pending[row] = self.pending_prefill[row] = self.decoding[row] = 0.0

    def resize(self, rows: int) -> None:
        """Grow to `rows` rows (new rows empty)."""
        grow = rows - len(self.pending)
        if grow > 0:
            self.pending = np.concatenate([self.pending, np.zeros(grow)])
            self.pending_prefill = np.concatenate([self.pending_prefill, np.zeros(grow)])
            self.decoding = np.concatenate([self.decoding, np.zeros(grow)])

    def compact(self, keep: np.ndarray) -> None:
        """Keep only rows `keep` (in that order) at the front, renumbering open requests; other rows' requests go."""
        new_of = {int(old): new for new, old in enumerate(keep)}
        self._req = {r: (new_of[e[0]], *e[1:]) for r, e in self._req.items() if e[0] in new_of}
        n = len(keep)
        for col in (self.pending, self.pending_prefill, self.decoding):
            col[:n] = col[keep]
            col[n:] = 0.0

    def _unpend(self, row: int, tokens: float) -> None:
        self.pending[row] -= 1
        self.pending_prefill[row] -= tokens
        if self.pending[row] == 0:  # exact anyway for integer tokens; guards a caller's float tokens
            self.pending_prefill[row] = 0.0


class RecentSends:
    """Sends per row, each decaying as exp(-age / `tau_s`): ``recent_sends``, read with `at`.

    The column is updated in place (a snapshot may hold it): `at(now)` decays it to `now`, `sent(row, now)`
    adds one send. Times may come slightly out of order (another replica's decision): a send stamped before
    the column's time counts as already decayed, and the column never decays backwards."""

    def __init__(self, rows: int, tau_s: float = RECENT_TAU_S) -> None:
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        if not tau_s > 0:
            raise ValueError(f"tau_s must be > 0, got {tau_s}")
        self.tau_s = float(tau_s)
        self.column = np.zeros(rows)
        self.time = -math.inf

    def __len__(self) -> int:
        return len(self.column)

    def at(self, now: float) -> np.ndarray:
        """The column decayed to `now` (the array itself; later than `now` already: unchanged)."""
        if now > self.time:
            if self.time > -math.inf:
                self.column *= math.exp((self.time - now) / self.tau_s)
            self.time = now
        return self.column

    def sent(self, row: int, now: float) -> None:
        """One request sent to `row` at `now`."""
        if not 0 <= row < len(self.column):
            raise ValueError(f"row {row} out of range 0..{len(self.column) - 1}")
        self.at(now)
        self.column[row] += math.exp(min(now - self.time, 0.0) / self.tau_s)

    def resize(self, rows: int) -> None:
        """Grow to `rows` rows (new rows empty; the array is replaced)."""
        grow = rows - len(self.column)
        if grow > 0:
            self.column = np.concatenate([self.column, np.zeros(grow)])

    def compact(self, keep: np.ndarray) -> None:
        """Keep only rows `keep` (in that order) at the front; the others empty."""
        n = len(keep)
        self.column[:n] = self.column[keep]
        self.column[n:] = 0.0
