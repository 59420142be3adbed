"""Decode routing's request-level types, and the fused ELDR kernel for small fleets.

A decode decision reads

- `snap` (`FleetSnapshot`): per-engine load, KV usage, alive mask (and any other engine column);
- `query` (`RouteQuery`): what is known about the request (its similarity to each ELDR centroid, computed by
  `solver.scoring` from the prefill signature; its domain label, for the oracle baseline);
- `state` (`RouterState`): the router's mutable state, explicit rather than global (round-robin cursor,
  random generator), one per router replica;
- `tables` (`RoutingTables`, `solver.routing.tables`): per-fleet lookup tables built once per change.

The decision itself is a `Profile` (`solver.routing.framework`) of filters, scorers and a picker; the named
ones are in `solver.routing.profiles`. ELDR (seed 000) is the τ-band filter (centroids within τ of the
best similarity, and the live engines serving them), the load scorer, and the least-cost picker whose ties go
to the engine whose centroid is most similar; when the band has no live engine the request goes to the
least-loaded live engine (``fallback="band_empty"``), without a signature likewise (``"no_signature"``).

`eldr_kernel` is that composition fused into one Python pass over the engines, for fleets of at most
`LOOP_MAX_ENGINES` where every engine serves one centroid: cheaper than the dozen numpy calls of the
composition (far cheaper when the caches are cold, as on a router woken by each request). It declines (None)
everywhere else, and the composition decides; tests/test_routing_decode.py checks both give the same pick.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from switchyard.solver.routing.snapshot import FleetSnapshot
    from switchyard.solver.routing.tables import RoutingTables

__all__ = ["LOOP_MAX_ENGINES", "Decision", "RouteQuery", "RouterState", "eldr_kernel"]


@dataclass(frozen=True)
class RouteQuery:
    """What a routing decision may know about one request."""

    sims: np.ndarray | None = None  # [K] similarity of the request's signature to each centroid
    label: str | None = None  # domain label (oracle; only the Domain baseline reads it)
    prompt_tokens: int = 0
    #: [D] prompt tokens each engine holds cached (the prefix index's longest match, snapshot order); None when
    #: no index answered (no keys, no index): prefix scorers then see nothing cached anywhere.
    cached: np.ndarray | None = None


class Decision(NamedTuple):
    """One pick (a tuple: built on every request, a frozen dataclass costs twice as much to make)."""

    index: int  # into the snapshot's engines
    band_size: int = 0  # engines the band filter admitted (0 for load-only profiles)
    fallback: str | None = None


@dataclass
class RouterState:
    """Mutable per-router state: cursors and the generator for random choices."""

    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    rr_next: int = 0  # round robin: the next engine to try
    scan_start: int = 0  # first-minimum scans start here (vLLM's rules)

    @classmethod
    def seeded(cls, seed: int) -> RouterState:
        return cls(rng=np.random.default_rng(seed))


#: Up to this many engines the ELDR kernel is one Python pass over the engines; beyond, the composition.
LOOP_MAX_ENGINES = 64


def eldr_kernel(snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Decision | None:
    """ELDR's default composition in one pass, or None (a large fleet, a fallback): see the module doc."""
    sims, centroid_of = query.sims, tables.centroid_of
    if sims is None or centroid_of is None or tables.members is None or snap.size > LOOP_MAX_ENGINES:
        return None
    # The threshold exactly as the band filter compares it, in the similarities' dtype (as a double, exactly).
    threshold = float(sims.dtype.type(sims.max() - tables.tau))
    sim, alive, load = sims.tolist(), snap.alive.tolist(), snap.load.tolist()
    band, best, best_load, best_sim = 0, -1, math.inf, -math.inf
    for i, k in enumerate(centroid_of):
        if alive[i] and sim[k] >= threshold:
            band += 1
            if load[i] < best_load or (load[i] == best_load and sim[k] > best_sim):
                best, best_load, best_sim = i, load[i], sim[k]
    return Decision(best, band_size=band) if best_load != math.inf else None
