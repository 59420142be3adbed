"""Whether a migration pays: the step time a new layout saves against the step time moving to it costs.

The publish rule of the placement service and of the simulated placement loop (`policy.decide`), in seconds of
serving time over a horizon (the time until the next plan):

    expected load    = mean + ρ × (window − mean)                 (per layer and source, over its experts)
    saving per step  = step(current) − step(new)                   (`step_time.expected_step`, both terms)
    gain             = saving per step × (horizon − duration) / step_s
    duration         = `migration_seconds`(current → new)         (bytes moved over each link, calibrated)
    cost             = duration × (1 − 1 / slowdown) × queue       (the steps it overlaps run `slowdown` × longer)
    queue            = 1 + waiting / max(running, 1)                 (requests the lost service time delays)
    publish          ⇔ gain − cost > margin × cost

Per-step counts are the window's per-second rates × `step_s` (the engines' mean step time), their skew shrunk
by ρ, the window's measured persistence (`window.DecayedLoad.persistence`: how well the window has predicted the
windows after it; 0 before any window has followed another, so a layout is credited only with skew that has been
seen to come back). A layout saves step time only through the skew (a uniform load is served alike by every
layout of equal slots), so ρ is the part of the saving expected to hold; ρ = 1 is the rule before it.

The queue factor prices a migration made while requests wait (vLLM's `num_waiting`: requests its scheduler
could not admit), in request-seconds: the service time a migration takes away delays the requests running then
and every request waiting behind them, while the step time a layout saves later speeds the requests running
then, and a queue is assumed to drain (a transient queue: a burst, the knee of a load ramp). So near saturation a
migration must save `queue` times its cost; it is deferred, not dropped (`Payoff.deferred`: it would pay with
the queue empty, and the planner asks again soon). Under a queue that never drains this never moves, which is
the static layout's behaviour, not a loss against it. Everything here is a pure function of arrays: the service
and the simulator pass what they know (`StepContext`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.placement_terms import (
    DEFAULT_PAYOFF_MARGIN,
    MIGRATION_EFFICIENCY,
    MIGRATION_FIRST_S,
    MIGRATION_LATER_S,
    MIGRATION_NETWORK_BYTES_PER_S,
    MIGRATION_NVLINK_BYTES_PER_S,
    MIGRATION_SLOWDOWN,
)
from switchyard.solver.placement.problem import hosts_from_slots
from switchyard.solver.placement.step_time import StepCost, expected_step

__all__ = [
    "MigrationPrice",
    "Payoff",
    "StepContext",
    "expected_load",
    "migration_bytes",
    "migration_seconds",
    "predict",
]


@dataclass(frozen=True)
class MigrationPrice:
    """What moving expert weights costs (`shared.placement_terms`: the calibration and its assumptions).

    A GPU that gains a copy of an expert receives `expert_bytes` from a GPU that holds it (one in its own node
    when there is one); each GPU's sends and receives run over NVLink or the network at `efficiency` × the
    link's bandwidth, both links at once; the migration lasts as long as its busiest GPU, plus `first_extra_s`
    for a group's first rearrangement. Steps overlapping it run `slowdown` times longer.
    """

    expert_bytes: float
    ranks_per_node: int = 8
    nvlink_bytes_per_s: float = MIGRATION_NVLINK_BYTES_PER_S
    network_bytes_per_s: float = MIGRATION_NETWORK_BYTES_PER_S
    efficiency: float = MIGRATION_EFFICIENCY
    first_extra_s: float = MIGRATION_FIRST_S - MIGRATION_LATER_S
    slowdown: float = MIGRATION_SLOWDOWN

    def __post_init__(self) -> None:
        if self.expert_bytes < 0 or self.ranks_per_node < 1 or self.first_extra_s < 0 or self.slowdown < 1:
            raise ValueError("need expert_bytes >= 0, ranks_per_node >= 1, first_extra_s >= 0, slowdown >= 1")
        if min(self.nvlink_bytes_per_s, self.network_bytes_per_s, self.efficiency) <= 0:
            raise ValueError("link bandwidths and efficiency must be > 0")


def migration_bytes(current: np.ndarray, target: np.ndarray, price: MigrationPrice) -> np.ndarray:
    """`[2, 2, G]` bytes each GPU sends (0) and receives (1) over NVLink (0) and the network (1)."""
    num_experts = int(max(current.max(), target.max())) + 1
    before = hosts_from_slots(current, num_experts) > 0  # [L, E, G]
    after = hosts_from_slots(target, num_experts) > 0
    num_gpus = current.shape[1]
    node = np.arange(num_gpus) // price.ranks_per_node
    out = np.zeros((2, 2, num_gpus))
    for layer, expert, gpu in np.argwhere(after & ~before):
        holders = np.flatnonzero(before[layer, expert])
        if not len(holders):  # a new expert has no source on the group: nothing to copy from here
            continue
        near = holders[node[holders] == node[gpu]]
        src = int(near[0] if len(near) else holders[0])
        link = 0 if node[src] == node[gpu] else 1
        out[0, link, src] += price.expert_bytes
        out[1, link, gpu] += price.expert_bytes
    return out


def migration_seconds(current: np.ndarray, target: np.ndarray, price: MigrationPrice, first: bool) -> float:
    """Seconds to move from slot map `current` to `target` (0 when no GPU gains an expert)."""
    moved = migration_bytes(np.asarray(current), np.asarray(target), price)
    if not moved.any():
        return 0.0
    rates = np.array([price.nvlink_bytes_per_s, price.network_bytes_per_s]) * price.efficiency
    busiest = float((moved / rates[None, :, None]).max())  # links run at once; sends and receives too
    return busiest + (price.first_extra_s if first else 0.0)


@dataclass(frozen=True)
class StepContext:
    """What the payoff needs beyond the layouts: the step model, the migration price, the engines' step time,
    the horizon until the next plan, the seconds the window's counts span, and whether the group has never
    migrated (its first rearrangement costs more)."""

    cost: StepCost
    price: MigrationPrice
    step_s: float
    horizon_s: float
    window_s: float
    first: bool = False
    margin: float = DEFAULT_PAYOFF_MARGIN
    #: ρ, the share of the window's skew expected to persist over the horizon (`DecayedLoad.persistence`).
    persistence: float = 1.0
    #: Requests running and waiting (not admitted) at the group's engines when it plans.
    running: int = 0
    waiting: int = 0

    def __post_init__(self) -> None:
        if self.step_s <= 0 or self.horizon_s <= 0 or self.window_s <= 0 or self.margin < 0:
            raise ValueError("step_s, horizon_s and window_s must be > 0, margin >= 0")
        if not 0.0 <= self.persistence <= 1.0:
            raise ValueError("persistence must be within [0, 1]")
        if self.running < 0 or self.waiting < 0:
            raise ValueError("running and waiting must be >= 0")

    @property
    def queue_factor(self) -> float:
        """How many times a migration's lost service time counts: 1 with nobody waiting (module docstring)."""
        return 1.0 + self.waiting / max(self.running, 1)


@dataclass(frozen=True)
class Payoff:
    """One prediction, every figure in seconds (see the module docstring)."""

    saving_per_step_s: float
    step_s: float
    duration_s: float
    gain_s: float
    cost_s: float
    margin: float
    persistence: float = 1.0
    #: `StepContext.queue_factor`: `cost_s` already includes it.
    queue_factor: float = 1.0

    @property
    def net_s(self) -> float:
        return self.gain_s - self.cost_s

    @property
    def pays(self) -> bool:
        return self.duration_s > 0 and self.net_s > self.margin * self.cost_s

    @property
    def deferred(self) -> bool:
        """It does not pay only because requests wait: with the queue drained it would (ask again soon)."""
        unqueued = self.cost_s / self.queue_factor
        return not self.pays and self.duration_s > 0 and self.gain_s - unqueued > self.margin * unqueued

    def as_dict(self) -> dict[str, float]:
        return {
            "saving_per_step_s": self.saving_per_step_s,
            "step_s": self.step_s,
            "duration_s": self.duration_s,
            "gain_s": self.gain_s,
            "cost_s": self.cost_s,
            "net_s": self.net_s,
            "persistence": self.persistence,
            "queue_factor": self.queue_factor,
        }


def per_step(counts: np.ndarray, window_s: float, step_s: float) -> np.ndarray:
    """`[L, S, E]` expected pairs per step from a window's counts over `window_s` seconds."""
    return np.asarray(counts, dtype=np.float64) * (step_s / window_s)


def expected_load(counts: np.ndarray, persistence: float) -> np.ndarray:
    """`counts[L, S, E]` with each (layer, source)'s deviation from its mean over experts scaled by
    `persistence` (the totals kept); unchanged at 1."""
    counts = np.asarray(counts, dtype=np.float64)
    if persistence >= 1.0:
        return counts
    mean = counts.mean(axis=2, keepdims=True)
    return mean + persistence * (counts - mean)


def saving_per_step(
    counts: np.ndarray, origin: np.ndarray, current: np.ndarray, new: np.ndarray, ctx: StepContext
) -> float:
    """Seconds a step saves under `new` rather than `current`, for window counts `counts[L, S, E]` whose
    sources dispatch from `origin[S, G]` (`step_time.origin_matrix`)."""
    x = per_step(counts, ctx.window_s, ctx.step_s)
    return sum(expected_step(ctx.cost, x, current, origin)) - sum(expected_step(ctx.cost, x, new, origin))


def predict(counts: np.ndarray, origin: np.ndarray, current: np.ndarray, new: np.ndarray, ctx: StepContext) -> Payoff:
    """The payoff of moving from `current` to `new` for window counts `counts[L, S, E]` (module docstring)."""
    saving = saving_per_step(expected_load(counts, ctx.persistence), origin, current, new, ctx)
    duration = migration_seconds(current, new, ctx.price, ctx.first)
    in_force = max(ctx.horizon_s - duration, 0.0)
    gain = saving * in_force / ctx.step_s
    cost = duration * (1.0 - 1.0 / ctx.price.slowdown) * ctx.queue_factor
    return Payoff(saving, ctx.step_s, duration, gain, cost, ctx.margin, ctx.persistence, ctx.queue_factor)
