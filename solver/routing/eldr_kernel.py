"""ELDR's default composition fused into one Python pass over the engines, for small fleets.

ELDR (seed 000) is the τ-band filter (centroids within τ of the best similarity, and the live engines serving
them), the load scorer, and the least-cost picker whose ties go to the engine whose centroid is most similar;
when the band has no live engine the request goes to the least-loaded live engine (``fallback="band_empty"``),
without a signature likewise (``"no_signature"``). `eldr_kernel` does that in one pass over at most
`LOOP_MAX_ENGINES` engines where every engine serves one centroid: cheaper than the dozen numpy calls of the
composition (far cheaper when the caches are cold, as on a router woken by each request). It declines (None)
everywhere else, and the composition decides; tests/test_routing_decode.py checks both give the same pick.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from switchyard.solver.routing.query import Choice, RouteQuery, RouterState

if TYPE_CHECKING:
    from switchyard.solver.routing.snapshot import FleetSnapshot
    from switchyard.solver.routing.tables import RoutingTables

__all__ = ["LOOP_MAX_ENGINES", "eldr_kernel"]


#: Up to this many engines the ELDR kernel is one Python pass over the engines; beyond, the composition.
LOOP_MAX_ENGINES = 64


def eldr_kernel(snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Choice | None:
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
    return Choice(best, band_size=band) if best_load != math.inf else None
