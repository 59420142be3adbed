"""How to add a decode scorer (docs/architecture.md): keep requests off engines that are moving experts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing import FleetSnapshot, Profile, RouteQuery, RoutingTables
from switchyard.solver.routing.filters import Alive
from switchyard.solver.routing.framework import Weighted
from switchyard.solver.routing.pickers import LeastCost
from switchyard.solver.routing.scorers import Column


@dataclass(frozen=True)
class Migration:
    """Cost: 1 while the engine's EP group moves experts (its steps are slower), else 0. Weighted w, a
    migrating engine costs as much as w more requests on it."""

    name: str = "migration"  # the key of its weight in SWITCHYARD_ROUTER_DECODE_WEIGHTS
    needs: frozenset[str] = need("migrating")  # registry names (shared/signals.py): a misspelt one fails here

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        return snap.column("migrating")  # float[D]; never written into, so no copy


#: Join the shortest queue, an engine moving experts counting as 4 more requests.
JSQ_MIGRATION = Profile(
    "jsq-migration",
    filters=(Alive(),),
    scorers=(Weighted(Column("load"), 1.0), Weighted(Migration(), 4.0)),
    picker=LeastCost(),
    doc="least load + 4 while migrating",
)
