"""Liveness: only engines with fresh telemetry (and not draining) take requests. Never relaxed."""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.shared.signals import need
from switchyard.solver.routing.framework import Admission
from switchyard.solver.routing.query import RouteQuery
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables


@dataclass(frozen=True)
class Alive:
    name: str = "alive"
    needs: frozenset[str] = need("alive")
    relaxable: bool = False
    band: bool = False

    def admit(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> Admission:
        return Admission(snap.alive)
