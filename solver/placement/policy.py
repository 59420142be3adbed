"""When to plan a group, and whether to move it to the online placement: pure functions of the load window,
the last run and the current layout (the placement service and the simulated loop both call these).

Trigger (`trigger`): plan when the group has never been planned, every `period_s`, or early when its load
distribution has drifted by `drift_threshold` (total variation, mean over layers: `window.drift`) from the one
the last run saw, but never sooner than `min_interval_s` after it; and `min_interval_s` after a plan that
published a prefix of its target or was deferred because requests were waiting (`Decision.deferred`).

Decision (`decide`), two gates:

    improvement = (w_load·load + w_comm·comm)(current) − (w_load·load + w_comm·comm)(new)
    cost        = w_mig·mig(new)                          (the solver's own price of the moves, same units)
    screen      ⇔  improvement − cost > gain_threshold · total(current)   (the solver prefers it clearly)
    publish     ⇔  screen and the migration pays in step time (`payoff.predict`: the step time the layout
                   saves over the horizon beats what its migration costs, with a margin; the window's
                   skew counted at its measured persistence, `window.DecayedLoad.persistence`, and its
                   cost at the requests waiting then, `payoff.StepContext.queue_factor`)

The screen's terms come from the solver's objective on the solver's canonical units (per layer, mean GPU load
= 1), so its threshold is a fraction of the current objective; the step-time rule is what decides whether to
move (issue 40: the screen alone published migrations that cost more than they saved). Without a step model
(`step=None`: the placement-quality benches, which apply moves instantly) the screen alone decides. With
`Policy.stage_bytes` the plan is a prefix of the target (`stages.stage`: hottest experts first, at most that
many bytes received per GPU), and the payoff is that of the prefix.

Communication is priced by D[s, g] = 0 when GPU g belongs to source DP rank s, else 1; without per-source counts
(or without knowing which rank owns which GPU) the placement balances load alone.
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
from switchyard.solver.placement.payoff import Payoff, StepContext, predict
from switchyard.solver.placement.problem import PlacementProblem, Weights
from switchyard.solver.placement.refine import place
from switchyard.solver.placement.stages import stage
from switchyard.solver.placement.step_time import origin_matrix
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


def trigger(
    rule: TriggerRule,
    now: float,
    last: LastRun | None,
    distribution: np.ndarray | None,
    unfinished: bool = False,
    deferred: bool = False,
) -> str | None:
    """Why the group is planned at `now` ("start", "period", "continue", "deferred", "drift 0.123"), or None.

    `last`: the last run of this planner for the group (None: never); `distribution`: the group's load
    distribution now (`DecayedLoad.distribution()`, rows sum to 1); `unfinished`: the last plan published a
    prefix of its target (`stages`), so the rest is planned as soon as `min_interval_s` allows; `deferred`: the
    last plan would have paid but for the requests waiting (`Decision.deferred`), so it is asked again as soon."""
    if last is None:
        return "start"
    elapsed = now - last[0]
    if elapsed >= rule.period_s:
        return "period"
    if unfinished and elapsed >= rule.min_interval_s:
        return "continue"
    if deferred and elapsed >= rule.min_interval_s:
        return "deferred"
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
    #: Most bytes one plan may have any GPU receive (None: the whole target at once), `stages.stage`.
    stage_bytes: float | None = None


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
    #: The step-time prediction for `placement` (None without a step model).
    payoff: Payoff | None = None
    #: `placement` is a prefix of the full target (more moves follow in the next plan).
    partial: bool = False

    @property
    def screened(self) -> bool:
        """The solver's objective prefers the new layout by more than the threshold."""
        return self.improvement - self.cost > self.threshold

    @property
    def deferred(self) -> bool:
        """Screened, and its migration would pay but for the requests waiting now (`Payoff.deferred`)."""
        return self.screened and bool(len(self.moves)) and self.payoff is not None and self.payoff.deferred

    @property
    def reason(self) -> str:
        if not len(self.moves):
            return "the greedy keeps the current placement"
        verdict = "exceeds" if self.screened else "does not exceed"
        text = (
            f"net gain {self.improvement - self.cost:.4g} (improvement {self.improvement:.4g} - migration cost "
            f"{self.cost:.4g}) {verdict} the threshold {self.threshold:.4g}"
        )
        if self.payoff is not None and self.screened:
            p = self.payoff
            verdict = "pays" if p.pays else "does not pay"
            text += (
                f"; in step time it {verdict}: saves {p.gain_s:.4g} s over the horizon against "
                f"{p.cost_s:.4g} s of migration ({p.duration_s:.3g} s at {p.margin:.0%} margin; the window's "
                f"skew counted at its persistence {p.persistence:.2f})"
            )
            if p.queue_factor > 1.0:
                text += f"; its cost counted {p.queue_factor:.3g}× for the requests waiting"
                text += " (deferred: it would pay with none waiting)" if p.deferred else ""
        return text + (" [a prefix of the target]" if self.partial else "")


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
    step: StepContext | None = None,
) -> Decision:
    """Run the online placement (`solver.placement.place`: the greedy and the current layout, both refined by
    swaps) from `current` on the decayed window, and weigh its gain against its migration cost.

    `distance[S, G]` replaces `distance_matrix(S, gpu_ranks)` when given (e.g. with the nodes' links priced);
    `step` prices the move in step time (the module docstring)."""
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
    target = place(problem, params).astype(np.int32)
    new = target
    payoff = None
    if step is not None:
        new = stage(current, target, load, step.price, policy.stage_bytes).astype(np.int32)
        counts = source_load if by_source else np.asarray(load, dtype=np.float64)[:, None, :]
        origin = origin_matrix(counts.shape[1], gpu_ranks if by_source else [None] * num_gpus)  # type: ignore[union-attr, arg-type]
        payoff = predict(counts, origin, current, new, step)  # type: ignore[arg-type]
    before, after = objective(problem, current), objective(problem, new)
    cost = policy.weights.mig * float(after.mig.sum())
    improvement = before.total - (after.total - cost)
    threshold = policy.gain_threshold * before.total
    moves = plan_moves(current, new, buffer=True).astype(np.int32)
    screened = improvement - cost > threshold
    return Decision(
        placement=new,
        moves=moves,
        current=before.totals(),
        new=after.totals(),
        improvement=improvement,
        cost=cost,
        threshold=threshold,
        publish=bool(len(moves)) and screened and (payoff is None or payoff.pays),
        payoff=payoff,
        partial=not np.array_equal(new, target),
    )
