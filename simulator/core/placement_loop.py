"""The placement loop closed in a simulated DP+EP fleet: Gimbal's coordinated loop and vLLM's EPLB beside it.

Two `PlacementControl`s (simulator/core/placement_control.py) that a fleet feeds every step's expert selections
by source DP engine and asks, every telemetry tick, whether to move:

- `GimbalLoop` ("gimbal"): the placement service's loop, on its own rules and defaults. The steps' counts are
  summed into report windows of `report_interval_s` (1 s: the vLLM agent's `expert_load_interval_s`,
  engine_agents/vllm/config.py) and folded into the service's decayed window (`solver.placement.window`,
  half-life 300 s); it plans on the service's trigger (`solver.placement.policy.trigger`: start, every 30 s,
  or on a drift of 0.1 after at least 5 s: `shared.placement_terms`), runs the service's decision
  (`solver.placement.policy.decide`: the online greedy with the calibrated `DEFAULT_PARAMS`, source-aware
  communication, migration cost, gain threshold, and with a fleet's `step_cost` the step-time payoff: the step
  time the layout saves until the next plan, the window's skew counted at its measured persistence, against its
  migration's, `solver.placement.payoff`) and moves only
  when the decision publishes. Each published plan's prediction is checked against the saving measured on the
  windows after it (`checks`).
  "gimbal-uncalibrated" is the same loop with the seed's weights (`SEED_PARAMS`); "gimbal-load-only" the same
  loop without the source counts (placement blind to dispatch: the uncoordinated variant); "gimbal-staged" the
  same loop publishing at most `STAGED_BYTES` per GPU per plan, the hottest experts first (`stages.stage`), the
  rest continued in the next plans (issue 40 item 2); "gimbal-queue-blind" the same loop pricing a migration as
  if no request were waiting (the rule before the queue factor, `payoff.StepContext.queue_factor`: a control).
- `EplbLoop` ("eplb"): vLLM's EPLB as deployed (vllm/distributed/eplb/eplb_state.py and
  vllm/config/parallel.py `EPLBConfig`, vllm-project/vllm at commit 00193b82b0e2): a sliding window of the
  last `window_size` = 1000 steps' load, a fresh layout every `step_interval` = 3000 steps (the first after
  750: vLLM starts its counter at 3/4 of the interval), load only, ignoring where tokens come from and where
  experts are now; DeepSeek's hierarchical policy when the expert groups divide over the nodes the EP group
  spans, else the global one (`solver.placement.eplb_baseline`); `num_redundant_experts` = 0, vLLM's default.

Both are pure and deterministic: no clock (the fleet passes `now`), no randomness, no I/O. Sources are DP
engines: engine s owns GPUs [s·tp, (s+1)·tp) of the EP group, so a token of engine s is local on those GPUs
(`decide`'s distance D[s, g] = 0 there; on another GPU of the same node the NVLink/network cost ratio when
the fleet gives the nodes, else 1; 1 across nodes).

`PLACEMENT_CONTROLS` maps each name to a factory `(num_layers, num_experts, num_gpus, tp, **options)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from switchyard.shared.placement_terms import DEFAULT_HALF_LIFE_S, DEFAULT_PAYOFF_MARGIN
from switchyard.simulator.core.placement_control import PlacementControl, StaticPlacement
from switchyard.solver.placement import DEFAULT_PARAMS, SEED_PARAMS, GreedyParams, PlacementError
from switchyard.solver.placement.eplb_baseline import eplb_global, eplb_hierarchical
from switchyard.solver.placement.layouts import default_layout
from switchyard.solver.placement.payoff import MigrationPrice, StepContext, saving_per_step
from switchyard.solver.placement.policy import (
    Decision,
    LastRun,
    Policy,
    TriggerRule,
    decide,
    distance_matrix,
    trigger,
)
from switchyard.solver.placement.problem import hosts_from_slots, slots_from_hosts
from switchyard.solver.placement.step_time import StepCost, origin_matrix
from switchyard.solver.placement.window import DecayedLoad

__all__ = ["PLACEMENT_CONTROLS", "EplbLoop", "GimbalLoop", "PlanRecord"]

#: The vLLM agent's default expert-load report interval (engine_agents/vllm/config.py `expert_load_interval_s`).
REPORT_INTERVAL_S = 1.0
#: vLLM's `EPLBConfig` defaults (vllm/config/parallel.py, vllm-project/vllm commit 00193b82b0e2).
EPLB_WINDOW_SIZE = 1000
EPLB_STEP_INTERVAL = 3000
EPLB_REDUNDANT_EXPERTS = 0
#: GPUs per node (8 on the H100/H200 HGX boards the seed and DeepEP measure).
RANKS_PER_NODE = 8


@dataclass(frozen=True)
class PlanRecord:
    """One run of a loop's planner: when, why, and whether it moved (for reports and tests)."""

    at: float
    trigger: str
    moved: bool
    reason: str


def _check_load(load: np.ndarray, num_layers: int, num_sources: int, num_experts: int) -> np.ndarray:
    load = np.asarray(load, dtype=np.float64)
    if load.shape != (num_layers, num_sources, num_experts):
        raise ValueError(
            f"expert selections must be [L, S, E] = [{num_layers}, {num_sources}, {num_experts}], got {load.shape}"
        )
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("expert selections must be finite and non-negative")
    return load


def _check_shape(num_layers: int, num_experts: int, num_gpus: int, tp: int) -> int:
    if min(num_layers, num_experts, num_gpus, tp) < 1:
        raise ValueError("num_layers, num_experts, num_gpus and tp must be positive")
    if num_gpus % tp:
        raise ValueError(f"tp ({tp}) must divide the EP group's {num_gpus} GPUs (one DP engine per tp GPUs)")
    return num_gpus // tp


@dataclass
class PlanCheck:
    """A published plan's predicted saving and, once the windows after it are in, the saving measured on them
    (the same formula on the load that came, so the two differ only by what the prediction could not know)."""

    at: float
    predicted_gain_s: float
    predicted_cost_s: float
    before: np.ndarray
    after: np.ndarray
    duration_s: float
    measured_gain_s: float | None = None


class _Loop:
    """What both loops share: the layout in force, the one migration in flight, the record of plans."""

    name = "loop"

    def __init__(self, num_layers: int, num_experts: int, num_gpus: int, tp: int, layout: np.ndarray | None) -> None:
        self.num_sources = _check_shape(num_layers, num_experts, num_gpus, tp)
        self.num_layers, self.num_experts, self.num_gpus, self.tp = num_layers, num_experts, num_gpus, tp
        self._layout = default_layout(num_layers, num_experts, num_gpus) if layout is None else np.asarray(layout)
        self.in_flight = False
        self.plans: list[PlanRecord] = []

    def layout(self) -> np.ndarray:
        return self._layout

    def applied(self, now: float, layout: np.ndarray) -> None:
        self._layout = np.asarray(layout).astype(np.int32)
        self.in_flight = False
        self._migrated = True

    def _propose(self, now: float, why: str, new: np.ndarray | None, reason: str) -> np.ndarray | None:
        moved = new is not None and not np.array_equal(new, self._layout)
        self.plans.append(PlanRecord(now, why, moved, reason))
        if not moved:
            return None
        self.in_flight = True
        return new


class GimbalLoop(_Loop):
    """The placement service's loop over a simulated group (see the module docstring)."""

    name = "gimbal"

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_gpus: int,
        tp: int = 1,
        *,
        params: GreedyParams = DEFAULT_PARAMS,
        rule: TriggerRule | None = None,
        policy: Policy | None = None,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        report_interval_s: float = REPORT_INTERVAL_S,
        source_aware: bool = True,
        layout: np.ndarray | None = None,
        name: str | None = None,
        ranks_per_node: int | None = None,
        nvlink_cost: float = 1.0,
        step_cost: StepCost | None = None,
        migration: MigrationPrice | None = None,
        margin: float = DEFAULT_PAYOFF_MARGIN,
        horizon_s: float | None = None,
        stage_bytes: float | None = None,
        queue_aware: bool = True,
    ) -> None:
        super().__init__(num_layers, num_experts, num_gpus, tp, layout)
        if half_life_s <= 0 or report_interval_s <= 0:
            raise ValueError("half_life_s and report_interval_s must be positive")
        self.params, self.rule, self.policy = params, rule or TriggerRule(), policy or Policy()
        self.report_interval_s, self.source_aware = report_interval_s, source_aware
        self.window = DecayedLoad(half_life_s)
        self.gpu_ranks: list[int | None] = [g // tp for g in range(num_gpus)]
        # D[s, g]: 0 on engine s's own GPUs; `nvlink_cost` on the other GPUs of its node(s) when the nodes are
        # given (the fleet passes network / NVLink bandwidth: a token over NVLink costs that fraction of one
        # over the network); 1 elsewhere.
        nodes = None if ranks_per_node is None else [g // ranks_per_node for g in range(num_gpus)]
        self.distance = distance_matrix(self.num_sources, self.gpu_ranks, nodes, nvlink_cost)
        self.last_decision: Decision | None = None
        # The step-time rule (the fleet passes its step cost and migration price; without them the screen alone)
        self.step_cost, self.migration, self.margin = step_cost, migration, margin
        self.horizon_s = horizon_s if horizon_s is not None else self.rule.period_s
        if stage_bytes is not None:
            self.policy = replace(self.policy, stage_bytes=stage_bytes)
        self.step_s: float | None = None  # EMA of the step length, from successive `observe` times
        self._last_observe: float | None = None
        self._migrated = False
        self._unfinished = False
        self._deferred = False
        self.deferred_plans = 0  # plans that would have paid but for the requests waiting
        #: Requests running and waiting at the group's engines in the last step (what their telemetry says).
        self.queue_aware = queue_aware
        self._queue = (0, 0)
        self.checks: list[PlanCheck] = []
        self._last: LastRun | None = None
        self._pending: np.ndarray | None = None  # [L, S, E] of the report window being filled
        self._pending_index = 0
        if name is not None:
            self.name = name

    def observe(self, now: float, load: np.ndarray, running: int = 0, waiting: int = 0) -> None:
        load = _check_load(load, self.num_layers, self.num_sources, self.num_experts)
        if running < 0 or waiting < 0:
            raise ValueError("running and waiting must be >= 0")
        self._queue = (running, waiting) if self.queue_aware else (0, 0)
        if self._last_observe is not None and now > self._last_observe:  # the engines' step_time_ema, in effect
            dt = now - self._last_observe
            self.step_s = dt if self.step_s is None else 0.9 * self.step_s + 0.1 * dt
        self._last_observe = now
        index = int(np.floor(now / self.report_interval_s))
        self._flush(index)
        if self._pending is None:
            self._pending, self._pending_index = load.copy(), index
        else:
            self._pending += load

    def _flush(self, index: int) -> None:
        """Fold the report window being filled into the decayed window once time has left it."""
        if self._pending is None or index <= self._pending_index:
            return
        start = self._pending_index * self.report_interval_s
        sources = self._pending if self.source_aware else None
        self.window.add_counts(self._pending.sum(axis=1), sources, start, start + self.report_interval_s)
        self._pending = None

    def replan(self, now: float) -> np.ndarray | None:
        if self.in_flight:  # the service never plans over an unfinished migration
            return None
        self._flush(int(np.floor(now / self.report_interval_s)))
        if self.window.load is None:
            return None
        why = trigger(self.rule, now, self._last, self.window.distribution(), self._unfinished, self._deferred)
        if why is None:
            return None
        self._last = (now, self.window.distribution())
        step = self._step_context()
        self._measure(step)
        try:
            decision = decide(
                self.window.load,
                self.window.source_load,
                self.gpu_ranks,
                self._layout,
                self.params,
                self.policy,
                self.distance,
                step,
            )
        except PlacementError as exc:
            return self._propose(now, why, None, f"cannot place this window: {exc}")
        self.last_decision = decision
        self._unfinished = decision.publish and decision.partial
        self._deferred = decision.deferred
        self.deferred_plans += decision.deferred
        if decision.publish and decision.payoff is not None:
            p = decision.payoff
            self.checks.append(
                PlanCheck(now, p.gain_s, p.cost_s, self._layout.copy(), decision.placement, p.duration_s)
            )
            self.window.mark(now)
        return self._propose(now, why, decision.placement if decision.publish else None, decision.reason)

    def _step_context(self) -> StepContext | None:
        """What the step-time rule needs now (None without a step cost, or before a step time or a window)."""
        if self.step_cost is None or self.migration is None or self.step_s is None or self.window.span_s <= 0:
            return None
        return StepContext(
            self.step_cost,
            self.migration,
            self.step_s,
            self.horizon_s,
            self.window.span_s,
            not self._migrated,
            self.margin,
            self.window.persistence,
            *self._queue,
        )

    def _measure(self, step: StepContext | None) -> None:
        """Fill in the last check's measured saving from the windows tallied since its plan."""
        check = self.checks[-1] if self.checks else None
        if step is None or check is None or check.measured_gain_s is not None or self.window.recent is None:
            return
        span = self.window.recent_span_s
        if span <= 0:
            return
        sources = self.window.recent_sources if self.source_aware else None
        counts = sources if sources is not None else self.window.recent[:, None, :]
        origin = origin_matrix(counts.shape[1], self.gpu_ranks if sources is not None else [None] * self.num_gpus)
        seen = replace(step, window_s=span)
        saving = saving_per_step(counts, origin, check.before, check.after, seen)
        check.measured_gain_s = saving * max(self.horizon_s - check.duration_s, 0.0) / step.step_s


class EplbLoop(_Loop):
    """vLLM's EPLB over a simulated group (see the module docstring)."""

    name = "eplb"

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_gpus: int,
        tp: int = 1,
        *,
        window_size: int = EPLB_WINDOW_SIZE,
        step_interval: int = EPLB_STEP_INTERVAL,
        redundant_slots: int = EPLB_REDUNDANT_EXPERTS,
        num_groups: int = 1,
        ranks_per_node: int = RANKS_PER_NODE,
        layout: np.ndarray | None = None,
        nvlink_cost: float = 1.0,  # accepted for a common signature; EPLB prices no communication
        step_cost: StepCost | None = None,  # likewise: vLLM's EPLB rearranges on its step counter alone
        migration: MigrationPrice | None = None,
    ) -> None:
        if window_size < 1 or step_interval < 1 or redundant_slots < 0 or num_groups < 1 or ranks_per_node < 1:
            raise ValueError("window_size, step_interval, num_groups and ranks_per_node must be positive")
        if (num_experts + redundant_slots) % num_gpus:
            raise ValueError(f"EPLB needs the GPUs ({num_gpus}) to divide experts + redundant slots")
        if layout is None:
            slots = (num_experts + redundant_slots) // num_gpus
            layout = default_layout(num_layers, num_experts, num_gpus, slots)
        super().__init__(num_layers, num_experts, num_gpus, tp, layout)
        self.window_size, self.step_interval, self.redundant_slots = window_size, step_interval, redundant_slots
        self.num_groups = num_groups
        self.num_nodes = -(-num_gpus // ranks_per_node)
        self._ring = np.zeros((window_size, num_layers, num_experts), dtype=np.float32)  # vLLM keeps int32 counts
        self._steps = 0
        self._since = step_interval - step_interval // 4  # vLLM: "initial progress of rearrangement to 3/4"
        self._due = False

    @property
    def hierarchical(self) -> bool:
        """vLLM's rule: the hierarchical policy when expert groups divide over the nodes (and nodes over GPUs)."""
        return self.num_nodes > 1 and self.num_groups % self.num_nodes == 0 and self.num_gpus % self.num_nodes == 0

    def observe(self, now: float, load: np.ndarray, running: int = 0, waiting: int = 0) -> None:
        load = _check_load(load, self.num_layers, self.num_sources, self.num_experts)
        self._ring[self._steps % self.window_size] = load.sum(axis=1)
        self._steps += 1
        self._since += 1
        if self._since >= self.step_interval and not self.in_flight:  # vLLM waits out an async rearrangement
            self._since, self._due = 0, True

    def replan(self, now: float) -> np.ndarray | None:
        if self.in_flight or not self._due:
            return None
        self._due = False
        load = self._ring.sum(axis=0, dtype=np.float64)
        if self.hierarchical:
            fresh = eplb_hierarchical(load, self.num_gpus, self.num_nodes, self.num_groups, self.redundant_slots)
        else:
            fresh = eplb_global(load, self.num_gpus, self.redundant_slots)
        # An expert that stays on its GPU keeps its slot (a local copy at most): only host changes migrate.
        slots = self._layout.shape[2]
        new = slots_from_hosts(hosts_from_slots(fresh, self.num_experts), slots, self._layout).astype(np.int32)
        policy = "hierarchical" if self.hierarchical else "global"
        return self._propose(now, f"step {self._steps}", new, f"EPLB {policy} over the last {self.window_size} steps")


def _static(num_layers: int, num_experts: int, num_gpus: int, tp: int = 1, **options: Any) -> PlacementControl:
    """``none``: the layout never moves (``layout=[L, G, slots]`` may give one; the links do not matter)."""
    _check_shape(num_layers, num_experts, num_gpus, tp)
    for link_option in ("ranks_per_node", "nvlink_cost", "step_cost", "migration"):
        options.pop(link_option, None)
    return StaticPlacement(num_layers, num_experts, num_gpus, **options)


def _uncalibrated(num_layers: int, num_experts: int, num_gpus: int, tp: int = 1, **options: Any) -> PlacementControl:
    options.setdefault("params", SEED_PARAMS)
    return GimbalLoop(num_layers, num_experts, num_gpus, tp, name="gimbal-uncalibrated", **options)


#: "gimbal-staged": bytes any GPU may receive per plan. 512 MiB is ~26 ms of copying at the calibrated rate (a full
#: rearrangement of the seed's deployment, 14.5 GB per GPU, in 0.72 s): a few steps slowed per stage instead of
#: the whole move at once. A choice, not a measured optimum (docs/gimbal-seed.md measures it against the full plan).
STAGED_BYTES = 512 * 1024 * 1024


def _staged(num_layers: int, num_experts: int, num_gpus: int, tp: int = 1, **options: Any) -> PlacementControl:
    options.setdefault("stage_bytes", STAGED_BYTES)
    return GimbalLoop(num_layers, num_experts, num_gpus, tp, name="gimbal-staged", **options)


def _queue_blind(num_layers: int, num_experts: int, num_gpus: int, tp: int = 1, **options: Any) -> PlacementControl:
    options.setdefault("queue_aware", False)
    return GimbalLoop(num_layers, num_experts, num_gpus, tp, name="gimbal-queue-blind", **options)


def _load_only(num_layers: int, num_experts: int, num_gpus: int, tp: int = 1, **options: Any) -> PlacementControl:
    options.setdefault("source_aware", False)
    return GimbalLoop(num_layers, num_experts, num_gpus, tp, name="gimbal-load-only", **options)


#: Placement name -> factory `(num_layers, num_experts, num_gpus, tp, **options) -> PlacementControl`.
#: Options are the classes' keyword arguments (e.g. `rule=TriggerRule(...)`, `window_size=...`, `layout=...`).
PLACEMENT_CONTROLS: dict[str, Callable[..., PlacementControl]] = {
    "none": _static,
    "eplb": EplbLoop,
    "gimbal": GimbalLoop,
    "gimbal-uncalibrated": _uncalibrated,
    "gimbal-load-only": _load_only,
    "gimbal-staged": _staged,
    "gimbal-queue-blind": _queue_blind,
}
