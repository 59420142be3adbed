"""Expert placement: the problem, its objective, the online greedy, the exact MINLP, calibration, moves.

Pure functions over numpy arrays (no I/O); see README.md in this folder for the model.
"""

from switchyard.solver.placement.greedy import DEFAULT_PARAMS, SEED_PARAMS, GreedyParams, greedy, greedy_hosts
from switchyard.solver.placement.minlp import MinlpCancelled, MinlpOptions, MinlpResult, solve_minlp
from switchyard.solver.placement.objective import Objective, gpu_loads, objective, objective_of_hosts
from switchyard.solver.placement.problem import (
    PlacementError,
    PlacementProblem,
    Weights,
    check_slot_map,
    contiguous_slots,
    hosts_from_slots,
    locality_distance,
    slots_from_hosts,
)
from switchyard.solver.placement.refine import place, refine_swaps
from switchyard.solver.placement.replication import replica_counts

__all__ = [
    "DEFAULT_PARAMS",
    "SEED_PARAMS",
    "GreedyParams",
    "MinlpCancelled",
    "MinlpOptions",
    "MinlpResult",
    "Objective",
    "PlacementError",
    "PlacementProblem",
    "Weights",
    "check_slot_map",
    "contiguous_slots",
    "gpu_loads",
    "greedy",
    "greedy_hosts",
    "hosts_from_slots",
    "locality_distance",
    "objective",
    "objective_of_hosts",
    "place",
    "refine_swaps",
    "replica_counts",
    "slots_from_hosts",
    "solve_minlp",
]
