"""Routing: decode-engine choice at the prefill→decode handoff and data-parallel dispatch, as one framework
of filters, scorers and pickers over numpy columns (`framework`), composed into named profiles
(`profiles`). Pure functions and explicit state, shared by the router service, the simulator and the
benchmarks. `experiments` names the simulator's policies (profiles plus experiment-only options)."""

from switchyard.solver.routing.defaults import DEFAULT_INFLIGHT_GRACE_S, DEFAULT_TAU
from switchyard.solver.routing.experiments import DECODE_POLICIES, DecodePolicy, get_policy
from switchyard.solver.routing.framework import Profile
from switchyard.solver.routing.ledger import InflightLedger
from switchyard.solver.routing.profiles import DECODE_PROFILES, DP_PROFILES, decode_profile, dp_profile
from switchyard.solver.routing.query import Choice, RouteQuery, RouterState
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables, centroid_members, domain_partition

__all__ = [
    "DECODE_POLICIES",
    "DECODE_PROFILES",
    "DEFAULT_INFLIGHT_GRACE_S",
    "DEFAULT_TAU",
    "DP_PROFILES",
    "Choice",
    "DecodePolicy",
    "FleetSnapshot",
    "InflightLedger",
    "Profile",
    "RouteQuery",
    "RouterState",
    "RoutingTables",
    "centroid_members",
    "decode_profile",
    "domain_partition",
    "dp_profile",
    "get_policy",
]
