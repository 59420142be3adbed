"""In-flight compensation as one ledger: requests dispatched to an engine that its telemetry does not show yet.

Telemetry lags a dispatcher by up to one reporting interval; every dispatcher routing on the same stale
numbers would herd onto one engine. So each decision is written down (when, prompt tokens) and counted on
its engine (`count`, `tokens`) until a report received at least `grace_s` after it arrives (`settle`), which
then includes it. The router's telemetry view (`services.router.telemetry_view`) and the DP simulator's
dispatcher (`simulator.offline.dp`) both keep one; Gimbal's `comp` term is `tokens`.

A row's FIFO holds at most `max_per_row` decisions when given (the router gives it: an engine that says hello
but never reports would otherwise keep every request routed to it); beyond it the oldest is dropped, counted
in `dropped`. An engine that many requests behind its reports is the most loaded either way.

No clock and no I/O: the caller passes times in. Columns are float64 so a caller may add them to others
without a cast; they are exact for integer token counts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

__all__ = ["InflightLedger"]


class InflightLedger:
    """Per-engine FIFO of (sent at, prompt tokens) with running totals, indexed by row 0..n-1."""

    def __init__(self, rows: int, max_per_row: int | None = None) -> None:
        self.max_per_row = max_per_row
        self.dropped = 0  # decisions dropped unsettled because their row held max_per_row
        self.count = np.zeros(rows)  # decisions in flight per row
        self.tokens = np.zeros(rows)  # their prompt tokens
        self._sent: list[deque[tuple[float, float]]] = [deque() for _ in range(rows)]

    def __len__(self) -> int:
        return len(self._sent)

    def add(self, row: int, now: float, tokens: float) -> None:
        """One more request sent to `row` at `now`."""
        sent = self._sent[row]
        if self.max_per_row is not None and len(sent) >= self.max_per_row:
            _, oldest = sent.popleft()
            self.count[row] -= 1
            self.tokens[row] -= oldest
            self.dropped += 1
        sent.append((now, tokens))
        self.count[row] += 1
        self.tokens[row] += tokens

    def settle(self, row: int, before: float) -> None:
        """`row` reported: decisions sent before `before` (= report time − grace) are in its numbers now."""
        sent = self._sent[row]
        while sent and sent[0][0] < before:
            _, tokens = sent.popleft()
            self.count[row] -= 1
            self.tokens[row] -= tokens
        if not sent:  # guard against float drift
            self.count[row] = 0.0
            self.tokens[row] = 0.0

    def clear(self, row: int) -> None:
        """Forget what was in flight to `row` (its engine restarted: the new process never saw it)."""
        self._sent[row].clear()
        self.count[row] = 0.0
        self.tokens[row] = 0.0

    def entries(self, row: int) -> Sequence[tuple[float, float]]:
        """(sent at, tokens) of each decision still in flight to `row`, oldest first."""
        return self._sent[row]

    def resize(self, rows: int) -> None:
        """Grow to `rows` rows (new rows empty)."""
        grow = rows - len(self._sent)
        if grow > 0:
            self.count = np.concatenate([self.count, np.zeros(grow)])
            self.tokens = np.concatenate([self.tokens, np.zeros(grow)])
            self._sent.extend(deque() for _ in range(grow))

    def compact(self, keep: np.ndarray) -> None:
        """Keep only rows `keep` (in that order) at the front; the rows after them are emptied."""
        n = len(keep)
        self.count[:n] = self.count[keep]
        self.tokens[:n] = self.tokens[keep]
        self.count[n:] = 0.0
        self.tokens[n:] = 0.0
        kept = [self._sent[i] for i in keep]
        self._sent = kept + [deque() for _ in range(len(self._sent) - n)]
