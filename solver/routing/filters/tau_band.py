"""ELDR's τ band (seed 000): the engines serving a centroid within τ of the request's best similarity.

``{k : sim_k ≥ max_j sim_j − τ}``, through `tables.members` (centroid → engines; `solver.routing.tables`).
An engine is in the band iff its most similar centroid is, so one gather (or a [K, D] max) gives both the
band and the picker's tie preference (the engine's similarity). The comparison is made in the similarities'
dtype. Without a signature or an artifact the filter does not apply (``no_signature``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.framework import Admission
from switchyard.solver.routing.query import RouteQuery
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables


@dataclass(frozen=True)
class TauBand:
    name: str = "tau-band"
    needs: frozenset[str] = need("similarity")
    relaxable: bool = True
    band: bool = True

    def admit(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> Admission:
        sims = query.sims
        if sims is None or tables.members is None:
            return Admission(None, "no_signature")
        if tables.engine_centroid is not None:
            engine_sim = sims.take(tables.engine_centroid)
        else:
            engine_sim = np.where(tables.members, sims[:, None], -np.inf).max(axis=0)
        return Admission(engine_sim >= sims.max() - tables.tau, None, engine_sim)
