"""The decayed expert-load window of one engine group (pure): what the placement loop plans from.

Each window is added with weight 1 and everything before it fades with half-life `half_life_s` (by window
end time, so replaying the stream after a restart rebuilds the same state). `B[L, E]` is the decayed token
count per expert; `A[L, S, E]` the same split by source DP rank, where the engines report it. The placement
service folds its engines' `ExpertLoad` messages in (`add`); a simulated fleet folds arrays (`add_counts`),
so both plan from the same state. `drift` is the distance the service's early trigger measures.

`span_s` is the window's length in decayed seconds (what its counts are a rate over, for the step-time rule);
`mark(t)` starts an undecayed tally of the windows that start at or after t (`recent`, `recent_sources`,
`recent_span_s`): the load after a plan, on which its saving is measured.

`persistence` is how well the window predicts the load that follows it: the regression coefficient (through the
origin, clipped to [0, 1]) of each incoming window's per-expert share deviations (share − 1/E) on the decayed
window's just before it is folded in, summed over layers and faded with the same half-life. 1: the skew the
window shows comes back; 0: it does not (or there is no evidence yet: no window has followed another). With one
or two requests running a window's skew is those requests' and the next requests use other experts (issue 40:
at RPS 2 the first plans saved 10-20 % of their prediction); the step-time rule shrinks the window's skew by it.
In the service, windows are one engine's each, so a pair may also be two engines' windows of one interval: the
coefficient then also measures how alike the engines' loads are, which the group's layout equally relies on.
"""

from __future__ import annotations

import numpy as np

from switchyard.shared.schemas import ExpertLoad


class DecayedLoad:
    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._reset()

    def _reset(self) -> None:
        self.load: np.ndarray | None = None  # B[L, E]
        self.source_load: np.ndarray | None = None  # A[L, S, E], None once any window lacks it
        self.start: float | None = None
        self.end: float | None = None
        self.windows = 0
        self.engines: set[str] = set()
        self._sources_complete = True
        self._persist_xy = 0.0  # faded Σ d_prev·d_next over (layer, expert)
        self._persist_xx = 0.0  # faded Σ d_prev²
        self.mark(None)

    @property
    def persistence(self) -> float:
        """How well the window has predicted the windows after it (module docstring; 0 before any evidence)."""
        if self._persist_xx <= 0.0:
            return 0.0
        return float(np.clip(self._persist_xy / self._persist_xx, 0.0, 1.0))

    def _persist(self, counts: np.ndarray, fade_old: float, fade_new: float) -> None:
        """Add the pair (the window before `counts`, `counts`) to the persistence sums (layers with tokens)."""
        before = self.distribution()
        totals = counts.sum(axis=1, keepdims=True)
        rows = totals[:, 0] > 0
        if before is None or not rows.any():
            return
        uniform = 1.0 / counts.shape[1]
        d_prev = before[rows] - uniform
        d_next = counts[rows] / totals[rows] - uniform
        self._persist_xy = self._persist_xy * fade_old + fade_new * float((d_prev * d_next).sum())
        self._persist_xx = self._persist_xx * fade_old + fade_new * float((d_prev * d_prev).sum())

    def mark(self, at: float | None) -> None:
        """Tally the windows starting at or after `at` afresh (None: stop tallying)."""
        self._mark = at
        self.recent: np.ndarray | None = None  # B[L, E] since the mark
        self.recent_sources: np.ndarray | None = None  # A[L, S, E] since the mark (None if any window lacks it)
        self._recent_range: tuple[float, float] | None = None
        self._recent_complete = True

    @property
    def recent_span_s(self) -> float:
        """Seconds the windows tallied since the mark cover (first start to last end; 0 if none)."""
        return 0.0 if self._recent_range is None else self._recent_range[1] - self._recent_range[0]

    @property
    def span_s(self) -> float:
        """The window's length in decayed seconds: ∫ 0.5^(age / half-life) over [start, end] (0 when empty)."""
        if self.start is None or self.end is None:
            return 0.0
        h = self.half_life_s
        return float(h / np.log(2.0) * (1.0 - 0.5 ** ((self.end - self.start) / h)))

    def _fade(self, age: float) -> float:
        return float(0.5 ** (max(age, 0.0) / self.half_life_s))

    def add(self, window: ExpertLoad) -> None:
        """Fold one engine's `ExpertLoad` window in (see `add_counts`)."""
        self.add_counts(
            window.expert_counts, window.source_counts, window.window_start, window.window_end, window.engine_id
        )

    def add_counts(
        self, counts: np.ndarray, sources: np.ndarray | None, start: float, end: float, engine_id: str = ""
    ) -> None:
        """Fold one window in: `counts` B[L, E], `sources` A[L, S, E] or None, over [start, end] (seconds).

        A window of another model shape starts the group afresh; a window ending before the newest one (another
        engine's, late) is faded by its own age instead of fading the past."""
        counts = np.asarray(counts, dtype=np.float64)
        if self.load is not None and self.load.shape != counts.shape:
            self._reset()
        sources = None if sources is None else np.asarray(sources, dtype=np.float64)
        if self.load is None or self.end is None:
            self.load, self.source_load = counts, sources
            self._sources_complete = sources is not None
            self.start, self.end = start, end
        else:
            if end >= self.end:  # fade the past to the new window's end
                fade_old, fade_new = self._fade(end - self.end), 1.0
                self.end = end
            else:  # a late window (another engine of the group): fade it instead
                fade_old, fade_new = 1.0, self._fade(self.end - end)
            self._persist(counts, fade_old, fade_new)
            self.load = self.load * fade_old + counts * fade_new
            self._add_sources(sources, fade_old, fade_new)
            self.start = min(self.start or start, start)
        self.windows += 1
        self.engines.add(engine_id)
        if self._mark is not None and start >= self._mark:
            self._tally(counts, sources, start, end)

    def _tally(self, counts: np.ndarray, sources: np.ndarray | None, start: float, end: float) -> None:
        if self.recent is not None and self.recent.shape != counts.shape:
            self.mark(self._mark)
        first = self.recent is None
        self.recent = counts.copy() if first else self.recent + counts
        lo, hi = (start, end) if self._recent_range is None else self._recent_range
        self._recent_range = (min(lo, start), max(hi, end))
        if sources is None or not self._recent_complete:
            self._recent_complete, self.recent_sources = False, None
        elif first or self.recent_sources is None:
            self.recent_sources = sources.copy()
        else:
            num_sources = max(self.recent_sources.shape[1], sources.shape[1])
            self.recent_sources = _pad(self.recent_sources, num_sources) + _pad(sources, num_sources)

    def _add_sources(self, sources: np.ndarray | None, fade_old: float, fade_new: float) -> None:
        if sources is None or not self._sources_complete or self.source_load is None:
            self._sources_complete, self.source_load = False, None
            return
        num_sources = max(self.source_load.shape[1], sources.shape[1])
        self.source_load = _pad(self.source_load, num_sources) * fade_old + _pad(sources, num_sources) * fade_new

    def distribution(self) -> np.ndarray | None:
        """Each layer's share of tokens per expert (rows sum to 1; an idle layer is uniform)."""
        if self.load is None:
            return None
        totals = self.load.sum(axis=1, keepdims=True)
        uniform = np.full_like(self.load, 1.0 / self.load.shape[1])
        return np.where(totals > 0, self.load / np.where(totals > 0, totals, 1.0), uniform)


def drift(before: np.ndarray | None, after: np.ndarray | None) -> float:
    """Total-variation distance between two load distributions, averaged over layers (0: same, 1: disjoint)."""
    if before is None or after is None or before.shape != after.shape:
        return 1.0
    return float(0.5 * np.abs(after - before).sum(axis=1).mean())


def _pad(source_load: np.ndarray, num_sources: int) -> np.ndarray:
    missing = num_sources - source_load.shape[1]
    return np.pad(source_load, ((0, 0), (0, missing), (0, 0))) if missing else source_load
