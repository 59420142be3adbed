"""How to add a decode scorer (docs/architecture.md): prefer engines with free KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.solver.routing import FleetSnapshot, Profile, RouteQuery, RoutingTables
from switchyard.solver.routing.filters import Alive
from switchyard.solver.routing.framework import Weighted
from switchyard.solver.routing.pickers import LeastCost
from switchyard.solver.routing.scorers import Column


@dataclass(frozen=True)
class KvPressure:
    """Cost: the fraction of the engine's KV cache in use, lower is better. Weighted w, a full cache costs as
    much as w more requests on the engine."""

    name: str = "kv_pressure"  # the key of its weight in SWITCHYARD_ROUTER_DECODE_WEIGHTS
    needs: frozenset[str] = frozenset({"kv_usage"})  # engine columns and request inputs it reads

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        return snap.kv_usage  # float[D]; never written into, so no copy


#: Join the shortest queue, a nearly full cache counting as 4 more requests.
JSQ_KV = Profile(
    "jsq-kv",
    filters=(Alive(),),
    scorers=(Weighted(Column("load"), 1.0), Weighted(KvPressure(), 4.0)),
    picker=LeastCost(),
    doc="least load + 4 × KV usage",
)
