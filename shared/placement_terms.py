"""The placement objective's vocabulary: term names, their default weights, and every placement default.

The placement objective is a weighted sum of named terms (`solver/placement/terms.py` builds it). Terms
and weights travel as name→value maps through the solver, the wire (`PlacementPlan.objective`,
`PlacementPlan.params`), the database (JSON columns) and the API, so adding a term changes none of them:
its default weight here is the one line outside the solver. This module is the single owner of the
placement defaults (the solver, `PlacementSettings`, the decision policy and `switchyard calibrate` read
them from here); it imports nothing, so settings and the CLI can read them without loading numpy.

Built-in terms, in canonical units (per layer, the mean GPU load is 1):

| term | what it prices |
|---|---|
| `load` | imbalance: Σ_g (L_g − L̄)² |
| `comm` | tokens served on a GPU remote from the DP rank that sent them |
| `mig`  | host changes against the engines' current layout, `migration_cost` each |
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

#: The built-in terms, in the order the objective sums them (a term added later sums after these).
BUILTIN_TERMS = ("load", "comm", "mig")

#: Objective weight of each term when none is configured. 50 on load prices balance and locality equally
#: at a GPU deviation of δ* = w_comm / (2·w_load) = 1 % (solver/placement/README.md, "Units"). A new term
#: that should weigh something other than 1 by default gets one line here.
DEFAULT_WEIGHTS: MappingProxyType[str, float] = MappingProxyType({"load": 50.0, "comm": 1.0, "mig": 1.0})

#: Weight of a term that `DEFAULT_WEIGHTS` does not list (its cost arrays are already in objective units).
DEFAULT_EXTRA_WEIGHT = 1.0

#: Migration cost of changing whether one GPU hosts one expert, in canonical units (the remote traffic, in
#: mean GPU loads, that one host change is worth); charged at both ends of a move.
DEFAULT_MIGRATION_COST = 0.005

#: The placement service publishes only when (improvement − migration cost) exceeds this fraction of the
#: current objective.
DEFAULT_GAIN_THRESHOLD = 0.05

#: Extra expert copies per layer (EPLB-style replicas of hot experts); 0: one copy of each expert.
DEFAULT_REDUNDANT_SLOTS = 0

#: The placement loop's triggers (the service's, and the simulated loop's: `solver.placement.policy.TriggerRule`):
#: plan a group at least every period, early when its load distribution has drifted this far (total variation,
#: mean over layers) but never more often than the minimum interval; the decayed window's half-life.
DEFAULT_PERIOD_S = 30.0
DEFAULT_DRIFT_THRESHOLD = 0.1
DEFAULT_MIN_INTERVAL_S = 5.0
DEFAULT_HALF_LIFE_S = 300.0

#: Calibration: CP-SAT time limit per layer (seconds), layers solved at once, CP-SAT workers per layer.
DEFAULT_TIME_LIMIT_S = 1.0
DEFAULT_PARALLEL_LAYERS = 2
DEFAULT_WORKERS_PER_LAYER = 1
#: Calibration: the fitted greedy may cost this fraction more than the cheapest greedy on the grid.
DEFAULT_OBJECTIVE_TOLERANCE = 0.01

#: Term names: lower-case identifiers (they become JSON keys, metric labels and log words).
TERM_NAME_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"
#: Most terms one map may carry (wire, database and API bound every map by this).
MAX_TERMS = 32
#: "total" is the weighted sum, never a term.
RESERVED_NAMES = frozenset({"total"})

#: The greedy's multipliers were three fixed fields named after Gimbal's score (α·comm + β·load + γ·mig);
#: messages and rows written before terms became maps are read through this.
GREEK_TO_TERM: MappingProxyType[str, str] = MappingProxyType({"alpha": "comm", "beta": "load", "gamma": "mig"})


def default_weight(term: str) -> float:
    """The objective weight of `term` when none is configured."""
    return DEFAULT_WEIGHTS.get(term, DEFAULT_EXTRA_WEIGHT)


def greek_to_terms(values: dict[str, Any]) -> dict[str, Any]:
    """`{alpha, beta, gamma}` (the old fixed fields) as `{comm, load, mig}`; other keys are dropped."""
    return {term: values[greek] for greek, term in GREEK_TO_TERM.items() if greek in values}


#: What a rearrangement of a group's experts costs its engines: the Gimbal paper's measurement on its 4 x H100
#: testbed (seed 003: "Expert migration costs average 1.08s for first rearrangement and 0.72s for subsequent
#: ones"), and the slowdown of the steps it overlaps (an assumption: weight copies share HBM and links with the
#: serving kernels). The live simulated engines (`engine_agents.sim.live.migration.MigrationCost`) and the DP
#: simulation (`simulator.offline.dp_ep.MigrationPricing`) both price migrations with these.
MIGRATION_FIRST_S = 1.08
MIGRATION_LATER_S = 0.72
MIGRATION_SLOWDOWN = 2.0

#: Migrations priced by the bytes they move (issue 40 item 2). Each GPU receives and sends expert weights over
#: NVLink inside its node and over the network across nodes, at DeepEP's measured kernel bandwidths (153 GB/s,
#: 43 GB/s: `simulator.core.ep.EpTopology`) scaled by one efficiency. That efficiency is calibrated so that a
#: full later rearrangement of the seed's deployment (Qwen3-30B-A3B at EP 4 on one NVLink node: every GPU
#: receives all of its 48 layers x 32 slots of 3 x 2048 x 768 BF16 weights, 14.5 GB) takes the seed's 0.72 s;
#: the first one adds 1.08 - 0.72 = 0.36 s. Linearity in bytes and the network/NVLink ratio are assumptions.
MIGRATION_NVLINK_BYTES_PER_S = 153e9
MIGRATION_NETWORK_BYTES_PER_S = 43e9
MIGRATION_REFERENCE_BYTES_PER_GPU = 48 * 32 * 3 * 2048 * 768 * 2
MIGRATION_EFFICIENCY = MIGRATION_REFERENCE_BYTES_PER_GPU / MIGRATION_NVLINK_BYTES_PER_S / MIGRATION_LATER_S

#: The step-time publish rule (issue 40 item 1): publish only when the predicted step time the new layout saves
#: over the horizon exceeds what its migration costs by this fraction of that cost (0.25: a quarter more).
DEFAULT_PAYOFF_MARGIN = 0.25
#: Step time assumed when the group's engines report none (telemetry `step_time_ema`), in seconds.
DEFAULT_STEP_S = 0.03
#: GPUs per NVLink domain when the service prices links (H100/H200 HGX boards: 8).
DEFAULT_RANKS_PER_NODE = 8
