"""When to plan a group, and whether to move it to the online placement: pure functions of the load window,
the last run and the current layout (the placement service and the simulated loop both call these).

Trigger (`trigger`): plan when the group has never been planned, every `period_s`, or early when its load
distribution has drifted by `drift_threshold` (total variation, mean over layers: `window.drift`) from the one
the last run saw, but never sooner than `min_interval_s` after it.

Decision (`decide`):

    improvement = (w_load·load + w_comm·comm)(current) − (w_load·load + w_comm·comm)(new)
    cost        = w_mig·mig(new)                          (what the moves cost, in the same units)
    publish  ⇔  improvement − cost > gain_threshold · total(current)   (and the new layout differs)

All terms come from the solver's objective on the solver's canonical units (per layer, mean GPU load = 1),
so the threshold is a fraction of the current objective and does not depend on traffic volume or window
length. Communication is priced by D[s, g] = 0 when GPU g belongs to source DP rank s, else 1; without
per-source counts (or without knowing which rank owns which GPU) the placement balances load alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from switchyard.shared.placement_terms import (
    DEFAULT_DRIFT_THRESHOLD,
    DEFAULT_GAIN_THRESHOLD,
    DEFAULT_MIGRATION_COST,
    DEFAULT_MIN_INTERVAL_S,
    DEFAULT_PERIOD_S,
    DEFAULT_REDUNDANT_SLOTS,
)
from switchyard.solver.placement.greedy import GreedyParams
from switchyard.solver.placement.moves import plan_moves
from switchyard.solver.placement.objective import objective
from switchyard.solver.placement.problem import PlacementProblem, Weights
from switchyard.solver.placement.refine import place
from switchyard.solver.placement.window import drift

__all__ = ["Decision", "LastRun", "Policy", "TriggerRule", "decide", "distance_matrix", "trigger"]

#: When a group was last planned and the load distribution `[L, E]` that run saw (None: no load yet).
LastRun = tuple[float, np.ndarray | None]


@dataclass(frozen=True)
class TriggerRule:
    """The service's triggers (`PlacementSettings.period_s`, `drift_threshold`, `min_interval_s`), in seconds."""

    period_s: float = DEFAULT_PERIOD_S
    drift_threshold: float = DEFAULT_DRIFT_THRESHOLD
    min_interval_s: float = DEFAULT_MIN_INTERVAL_S


def trigger(rule: TriggerRule, now: float, last: LastRun | None, distribution: np.ndarray | None) -> str | None:
    """Why the group is planned at `now` ("start", "period", "drift 0.123"), or None: not yet.

    `last`: the last run of this planner for the group (None: never); `distribution`: the group's load
    distribution now (`DecayedLoad.distribution()`, rows sum to 1)."""
    if last is None:
        return "start"
    elapsed = now - last[0]
    if elapsed >= rule.period_s:
        return "period"
    moved = drift(last[1], distribution)
    if elapsed >= rule.min_interval_s and moved >= rule.drift_threshold:
        return f"drift {moved:.3f}"
    return None


@dataclass(frozen=True)
class Policy:
    gain_threshold: float = DEFAULT_GAIN_THRESHOLD
    migration_cost: float = DEFAULT_MIGRATION_COST
    redundant_slots: int = DEFAULT_REDUNDANT_SLOTS
    weights: Weights = field(default_factory=Weights)


@dataclass(frozen=True)
class Decision:
    placement: np.ndarray
    moves: np.ndarray
    current: dict[str, float]
    new: dict[str, float]
    improvement: float
    cost: float
    threshold: float
    publish: bool

    @property
    def reason(self) -> str:
        if not len(self.moves):
            return "the greedy keeps the current placement"
        verdict = "exceeds" if self.publish else "does not exceed"
        return (
            f"net gain {self.improvement - self.cost:.4g} (improvement {self.improvement:.4g} - migration cost "
            f"{self.cost:.4g}) {verdict} the threshold {self.threshold:.4g}"
        )


def distance_matrix(
    num_sources: int,
    gpu_ranks: list[int | None],
    gpu_nodes: list[int] | None = None,
    same_node_cost: float = 1.0,
) -> np.ndarray:
    """D[S, G]: 0 where GPU g belongs to source DP rank s, 1 otherwise (unknown owners count as remote).

    With `gpu_nodes` (the node of each GPU), a remote GPU on a node that holds one of source s's GPUs costs
    `same_node_cost` instead of 1: a token crossing NVLink is cheaper than one crossing the network (the DP
    simulation passes the ratio of the two links' bandwidths). Without it every remote GPU costs 1, as the
    service prices it (it does not know the nodes).
    """
    ranks = np.array([-1 if r is None else r for r in gpu_ranks])
    remote = (np.arange(num_sources)[:, None] != ranks[None, :]).astype(np.float64)
    if gpu_nodes is None:
        return remote
    nodes = np.asarray(gpu_nodes)
    source_nodes = [set(nodes[ranks == s].tolist()) for s in range(num_sources)]
    near = np.array([[int(nodes[g]) in source_nodes[s] for g in range(len(nodes))] for s in range(num_sources)])
    return np.where(near, remote * same_node_cost, remote)


def decide(
    load: np.ndarray,
    source_load: np.ndarray | None,
    gpu_ranks: list[int | None] | None,
    current: np.ndarray,
    params: GreedyParams,
    policy: Policy,
    distance: np.ndarray | None = None,
) -> Decision:
    """Run the online placement (`solver.placement.place`: the greedy and the current layout, both refined by
    swaps) from `current` on the decayed window, and weigh its gain against its migration cost.

    `distance[S, G]` replaces `distance_matrix(S, gpu_ranks)` when given (e.g. with the nodes' links priced)."""
    _, num_gpus, slots = current.shape
    by_source = source_load is not None and gpu_ranks is not None and any(r is not None for r in gpu_ranks)
    if by_source and distance is None:
        distance = distance_matrix(source_load.shape[1], gpu_ranks)  # type: ignore[union-attr, arg-type]
    problem = PlacementProblem.from_counts(
        source_load if by_source else load,  # type: ignore[arg-type]
        num_gpus,
        slots,
        distance=distance if by_source else None,
        current=current,
        migration_cost=policy.migration_cost,
        redundant_slots=policy.redundant_slots,
        weights=policy.weights,
    )
    new = place(problem, params).astype(np.int32)
    before, after = objective(problem, current), objective(problem, new)
    cost = policy.weights.mig * float(after.mig.sum())
    improvement = before.total - (after.total - cost)
    threshold = policy.gain_threshold * before.total
    moves = plan_moves(current, new, buffer=True).astype(np.int32)
    return Decision(
        placement=new,
        moves=moves,
        current=before.totals(),
        new=after.totals(),
        improvement=improvement,
        cost=cost,
        threshold=threshold,
        publish=bool(len(moves)) and improvement - cost > threshold,
    )
