"""Gimbal's KV-first rule (seed 003, Algorithm 1) as a filter.

When some live KV cache is nearly full and live caches are unevenly used, KV is the binding constraint: only
the live engine with the most free KV (the first of equals) is admitted, whatever the pressure scores say.
Otherwise the filter does not apply and the scorers decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.dispatch import GimbalParams, kv_first_applies
from switchyard.solver.routing.framework import Admission
from switchyard.solver.routing.query import RouteQuery
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables


@dataclass(frozen=True)
class KvFirst:
    params: GimbalParams = field(default_factory=GimbalParams)
    name: str = "kv-first"
    needs: frozenset[str] = need("alive", "kv_usage")
    relaxable: bool = False
    band: bool = False

    def admit(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> Admission:
        if not kv_first_applies(snap.alive, snap.kv_usage, self.params):
            return Admission(None)
        only = np.zeros(snap.size, dtype=bool)
        only[int(np.argmin(np.where(snap.alive, snap.kv_usage, np.inf)))] = True
        return Admission(only)
