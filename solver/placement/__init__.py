"""Expert placement: the problem, its objective, the online greedy, the exact MINLP, calibration, moves.

Pure functions over numpy arrays (no I/O); see README.md in this folder for the model.

The MINLP's names (`solve_minlp`, `MinlpOptions`, …) load `minlp.py`, and with it OR-Tools (~0.3 s, ~100 MB),
on first use: routers, engine agents and the API import this package for its layouts and types alone
(`tests/test_layering.py` checks it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from switchyard.solver.placement.greedy import DEFAULT_PARAMS, SEED_PARAMS, GreedyParams, greedy, greedy_hosts
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

if TYPE_CHECKING:
    from switchyard.solver.placement.minlp import MinlpCancelled, MinlpOptions, MinlpResult, solve_minlp

_LAZY = {"MinlpCancelled", "MinlpOptions", "MinlpResult", "solve_minlp"}


def __getattr__(name: str) -> Any:
    """The MINLP's names, imported on first access (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module("switchyard.solver.placement.minlp"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
