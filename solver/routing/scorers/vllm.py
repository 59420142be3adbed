"""vLLM main's DP load-balancing score (commit 00080ee1; see `solver.routing.dispatch`), as two terms:

- `VllmMainLoad`: max(clients · outstanding, waiting + running);
- `VllmMainKv`: 6 · waiting · max(0, kv − 0.5), KV pressure on queued work.

vLLM's default rule (4 · waiting + running) needs no scorer of its own: it is the columns ``waiting``
(weight 4) and ``running`` summed (profile ``vllm``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouteQuery
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables


@dataclass(frozen=True)
class VllmMainLoad:
    client_count: int = 1
    name: str = "vllm_main_load"
    needs: frozenset[str] = need("outstanding", "waiting", "running")

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        waiting_running = snap.column("waiting") + snap.column("running")
        return np.maximum(self.client_count * snap.column("outstanding"), waiting_running)


@dataclass(frozen=True)
class VllmMainKv:
    name: str = "vllm_main_kv"
    needs: frozenset[str] = need("waiting", "kv_usage")

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        return snap.column("waiting") * 6.0 * np.maximum(0.0, snap.kv_usage - 0.5)
