"""Routing policies: decode-engine choice at the prefill->decode handoff (`decode`, over a `FleetSnapshot`),
and data-parallel dispatch (`dispatch`). Pure functions, shared by the router service and the simulator."""

from switchyard.solver.routing.decode import (
    DECODE_POLICIES,
    DEFAULT_TAU,
    Decision,
    DecodePolicy,
    RouteQuery,
    RouterState,
    RoutingTables,
    centroid_members,
    domain_partition,
    get_policy,
)
from switchyard.solver.routing.snapshot import FleetSnapshot

__all__ = [
    "DECODE_POLICIES",
    "DEFAULT_TAU",
    "Decision",
    "DecodePolicy",
    "FleetSnapshot",
    "RouteQuery",
    "RouterState",
    "RoutingTables",
    "centroid_members",
    "domain_partition",
    "get_policy",
]
