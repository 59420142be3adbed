"""Gimbal's penalty terms (seed 003), in prefill-token equivalents so they add to the token columns.

P_kv(kv) = c_kv · kv / max(1 − kv, floor) and P_moe(moe) = c_moe · max(moe − 1, 0); the formulas and their
rationale are in `solver.routing.dispatch`. Gimbal's pressure score is the sum of the columns
``remaining_prefill``, ``waiting_prefill``, ``inflight_tokens`` and these two (profile ``gimbal``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.dispatch import GimbalParams, kv_penalty, moe_penalty
from switchyard.solver.routing.query import RouteQuery
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables


@dataclass(frozen=True)
class KvPenalty:
    params: GimbalParams = field(default_factory=GimbalParams)
    name: str = "kv_penalty"
    needs: frozenset[str] = need("kv_usage")

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        return kv_penalty(snap.kv_usage, self.params)


@dataclass(frozen=True)
class MoePenalty:
    params: GimbalParams = field(default_factory=GimbalParams)
    name: str = "moe_penalty"
    needs: frozenset[str] = need("expert_pressure")

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        return moe_penalty(snap.column("expert_pressure"), self.params)
