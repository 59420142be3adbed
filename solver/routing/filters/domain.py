"""The oracle Domain baseline's filter: the engines of the request's label partition (`tables.domains`,
`solver.routing.tables.domain_partition`). Without a known label it does not apply (``no_label``)."""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.shared.signals import need
from switchyard.solver.routing.framework import Admission
from switchyard.solver.routing.query import RouteQuery
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables


@dataclass(frozen=True)
class DomainPartition:
    name: str = "domain"
    needs: frozenset[str] = need("label")
    relaxable: bool = True
    band: bool = True

    def admit(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> Admission:
        part = tables.domains.get(query.label) if query.label is not None else None
        return Admission(None, "no_label") if part is None else Admission(part)
