"""The DP profiles' default compositions fused into one Python pass over the engines, for small fleets.

A DP profile's composition (`solver.routing.profiles.dp_profile`) is a dozen numpy calls over arrays of a
few engines, and numpy's fixed cost per call is all of it: ~110 of the ~250 µs `sy.route.dp` took on a
router woken by each request (cold caches, a gateway's single request), 10 µs warm. A kernel computes the
same scores with the same floating-point operations in the same order (terms summed left to right, a weight
of 1 applied without a multiplication) and keeps the first minimum, so its pick is the composition's bit for
bit, ties included. It declines (None) where that would need more care than it is worth, and the composition
decides: a fleet over `LOOP_MAX_ENGINES` (where numpy is as fast warm), a column that is not float64, a NaN
or -inf score (the composition's `NonFiniteCost`), no finite score, no live engine (the composition's error);
for Gimbal also a scan that does not start at engine 0 and a KV floor of 0. A +inf score is skipped, as the
composition excludes it. Re-weighting a profile drops its kernel (`Profile.weighted`).
tests/test_routing_dp_kernels.py checks kernels against compositions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from switchyard.solver.routing.dispatch import GimbalParams
from switchyard.solver.routing.eldr_kernel import LOOP_MAX_ENGINES
from switchyard.solver.routing.query import Choice, RouteQuery, RouterState

if TYPE_CHECKING:
    from switchyard.solver.routing.framework import Weighted
    from switchyard.solver.routing.snapshot import FleetSnapshot
    from switchyard.solver.routing.tables import RoutingTables

__all__ = ["ColumnsKernel", "GimbalKernel"]

_F64 = np.dtype(np.float64)


def _as_lists(columns: tuple[np.ndarray, ...]) -> list[list[float]] | None:
    """The columns as Python lists, or None when one is not float64 (numpy would compute in its dtype)."""
    for column in columns:
        if column.dtype is not _F64:
            return None
    return [column.tolist() for column in columns]


@dataclass(frozen=True)
class GimbalKernel:
    """Profile ``gimbal``: alive, KV first, remaining + waiting prefill + in-flight tokens + P_kv + P_moe, first
    minimum (`solver.routing.dispatch` has the formulas). With `prefix_weight`, profile ``switchyard``: the same
    plus that weight times the request's uncached prompt on each engine (`scorers.prefix.UncachedPrompt`)."""

    params: GimbalParams
    prefix_weight: float | None = None

    def __call__(
        self, snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables
    ) -> Choice | None:
        n, p = snap.size, self.params
        if not 0 < n <= LOOP_MAX_ENGINES or state.scan_start % n or not p.kv_floor > 0.0:  # x / 0.0 raises
            return None
        extra = snap.columns
        try:
            columns = _as_lists(
                (
                    snap.kv_usage,
                    extra["remaining_prefill"],
                    extra["waiting_prefill"],
                    extra["inflight_tokens"],
                    extra["expert_pressure"],
                )
            )
        except KeyError:  # the composition says which
            return None
        if columns is None:
            return None
        kv, remaining, waiting, inflight, pressure = columns
        uncached = self._uncached(query, n)
        if uncached is False:
            return None
        alive = snap.alive.tolist()
        c_kv, kv_floor, c_moe = p.kv_cost_tokens, p.kv_floor, p.moe_cost_tokens
        best, best_score = -1, math.inf  # first minimum of the score
        freest, kv_min, kv_max, freest_score = -1, math.inf, -math.inf, math.inf  # KV first: first minimum of kv
        # Conditional expressions, not min() and max() (three times slower here), with numpy's NaN semantics:
        # a NaN usage or pressure gives a NaN score. Indexing, not zip(): cheaper, warm and cold.
        for i in range(n):
            if not alive[i]:
                continue
            usage = kv[i]
            clipped = 0.0 if usage < 0.0 else 1.0 if usage > 1.0 else usage  # np.clip(kv, 0, 1)
            free = 1.0 - clipped
            excess = pressure[i] - 1.0
            score = (
                remaining[i]
                + waiting[i]
                + inflight[i]
                + c_kv * clipped / (free if free > kv_floor else kv_floor)  # P_kv
                + c_moe * (0.0 if excess < 0.0 else excess)  # P_moe
            )
            if uncached is not None:
                score = score + uncached[i]
            if score < best_score:
                best, best_score = i, score
            elif score != score:  # NaN: numpy's argmin would take it
                return None
            if usage < kv_min:
                freest, kv_min, freest_score = i, usage, score
            if usage > kv_max:
                kv_max = usage
        if kv_max > p.kv_high and kv_max - kv_min > p.kv_spread:  # `dispatch.kv_first_applies`
            best, best_score = freest, freest_score
        return Choice(best) if -math.inf < best_score < math.inf else None

    def _uncached(self, query: RouteQuery, n: int) -> list[float] | Literal[False] | None:
        """The weighted uncached-prompt term per engine, None without `prefix_weight`, False to decline (a
        `cached` column the composition would compute in another dtype, or of another length)."""
        weight = self.prefix_weight
        if weight is None:
            return None
        prompt = float(query.prompt_tokens)
        if query.cached is None:  # np.full(n, prompt)
            terms = [prompt] * n
        else:
            cached = query.cached
            if len(cached) != n or not (cached.dtype is _F64 or cached.dtype.kind in "iu"):
                return False  # (a float32 column: numpy would subtract in float32)
            # np.maximum(prompt - cached, 0.0), NaN kept as numpy keeps it
            terms = [u if u > 0.0 or u != u else 0.0 for u in (prompt - c for c in cached.tolist())]
        return terms if weight == 1.0 else [weight * u for u in terms]


@dataclass(frozen=True)
class ColumnsKernel:
    """Profiles ``jsq`` and ``vllm``: alive, Σ weight·column, first minimum scanning from `state.scan_start`."""

    terms: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, scorers: tuple[Weighted, ...]) -> ColumnsKernel:
        """The kernel of column scorers (`scorers.Column`), with their weights."""
        return cls(tuple((w.scorer.column, w.weight) for w in scorers))  # type: ignore[attr-defined]

    def __call__(
        self, snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables
    ) -> Choice | None:
        n = snap.size
        if not 0 < n <= LOOP_MAX_ENGINES:
            return None
        columns = _as_lists(tuple(snap.column(name) for name, _ in self.terms))
        if columns is None:
            return None
        scores: list[float] | None = None
        for column, (_, weight) in zip(columns, self.terms, strict=True):
            term = column if weight == 1.0 else [weight * x for x in column]
            scores = term if scores is None else [a + b for a, b in zip(scores, term, strict=True)]
        if scores is None:
            return None
        alive = snap.alive.tolist()
        start = state.scan_start % n
        best, best_score = -1, math.inf
        for i in range(n) if start == 0 else (*range(start, n), *range(start)):
            if alive[i]:
                score = scores[i]
                if score < best_score:
                    best, best_score = i, score
                elif score != score:
                    return None
        return Choice(best) if -math.inf < best_score < math.inf else None
