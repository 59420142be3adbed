"""The publish decision: moved to `solver.placement.policy` (the simulated placement loop decides by the same
rule); re-exported here for the service's modules, benches and tests."""

from switchyard.solver.placement.policy import Decision, Policy, decide, distance_matrix

__all__ = ["Decision", "Policy", "decide", "distance_matrix"]
