"""An engine signal as a cost, unchanged: ``load`` (JSQ), Gimbal's prefill-token terms, vLLM's counts. The
column is a registry name (`shared.signals`): ``Column("lod")`` fails where it is written.

The column is returned as is (no copy): the profile never writes into a cost, and a weight other than 1
makes a new array.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouteQuery
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables


@dataclass(frozen=True)
class Column:
    column: str
    name: str = ""
    needs: frozenset[str] = field(default=frozenset(), init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "needs", need(self.column))  # an unknown column fails here, at import
        if not self.name:
            object.__setattr__(self, "name", self.column)

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        return snap.column(self.column)
