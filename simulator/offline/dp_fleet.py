"""A DP fleet simulation's configuration (`DPFleetConfig`) and result (`DPSimResult`: per-request times and
engines, per-step records, per-engine counters, how well the prefix indexes predicted the cache).

Kept apart from the simulation loop (`simulator.offline.dp`, which re-exports both) so the loop's module stays
one job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from switchyard.simulator.core.defaults import (
    COORDINATOR_INTERVAL_S,
    DP_MAX_RUNNING,
    INFLIGHT_GRACE_S,
    TELEMETRY_INTERVAL_S,
    TOKEN_BUDGET,
)
from switchyard.simulator.core.dp_engine import DPCost
from switchyard.simulator.core.ep import EpTopology
from switchyard.simulator.core.physics import CostModel
from switchyard.simulator.core.placements import placement_names
from switchyard.simulator.core.workload import Workload
from switchyard.solver.routing.dispatch import GimbalParams
from switchyard.solver.routing.profiles import dp_profile

__all__ = ["PREFIX_INDEXES", "DPFleetConfig", "DPSimResult"]

#: The prefix indexes a dispatcher can read ``cached_tokens`` from (`dp_dispatch`'s docstring), default first.
PREFIX_INDEXES: tuple[str, ...] = ("precise", "approximate")


@dataclass(frozen=True)
class DPFleetConfig:
    """N DP engines of one model on `cost.gpus` (= TP) GPUs each; vLLM V1 defaults for an H100-class GPU."""

    engines: int
    cost: CostModel
    coupled: bool = True
    max_running: int = DP_MAX_RUNNING
    token_budget: int = TOKEN_BUDGET
    kv_blocks: int | None = None  # per engine; default: what the weights leave
    telemetry_interval_s: float = TELEMETRY_INTERVAL_S
    coordinator_interval_s: float = COORDINATOR_INTERVAL_S
    inflight_grace_s: float = INFLIGHT_GRACE_S
    telemetry_aligned: bool = False  # every engine reports at the same instants (default: a random phase each)
    #: Experiment: a decision's tokens stop counting as in flight as fast as an engine could prefill them
    #: (tokens/s) instead of lasting until the next report (0: the router's rule). See docs/gimbal-dispatch.md.
    inflight_drain_tokens_per_s: float = 0.0
    params: GimbalParams = field(default_factory=GimbalParams)
    #: Scorer weights by name (the router's `SWITCHYARD_ROUTER_DP_WEIGHTS`), each applied to the dispatch
    #: profiles that have that scorer (`weights_for`).
    dispatch_weights: tuple[tuple[str, float], ...] = ()
    #: vLLM's automatic prefix caching (on by default in V1); it acts only on traces that carry `hash_ids`.
    prefix_caching: bool = True
    #: Where a profile reading ``cached_tokens`` gets it: "precise" (the engines' caches, as their KV events tell)
    #: or "approximate" (what this dispatcher routed where, `prefix_ttl_s`); `PREFIX_INDEXES`.
    prefix_index: str = "precise"
    prefix_ttl_s: float = 600.0
    #: A CPU prefix tier behind each engine's GPU cache (tokens; 0: none): blocks the GPU evicts, loaded back
    #: instead of recomputed (`core.prefix_cache`, issue 42). The precise index credits a block held there at
    #: `prefix_cpu_weight` (the router's `prefix_tier_cpu`; 0: GPU-only credit, the tier unreported).
    prefix_cpu_tokens: int = 0
    prefix_cpu_weight: float = 0.0
    #: Expert placement over the EP ranks (`simulator.offline.dp_ep`): "off" keeps the even-spread MoE model
    #: without all-to-all (the figures before issue 26); a control name (`core.placements`: "none" = vLLM's
    #: contiguous layout, "eplb", "gimbal") prices each step under the layout in force, all-to-all included.
    placement: str = "off"
    #: GPUs per NVLink domain (H100 HGX: 8); ranks on different nodes talk over the network.
    ep_ranks_per_node: int = 8
    #: The exact ledger's control (`dp.LEDGER_CONTROLS`): "shuffled" gives a profile its facts on random engines.
    ledger_control: str = "none"
    #: The expert-affinity signature feed's control (`dp_affinity.AFFINITY_CONTROLS`): "shuffled" records every
    #: request's prefill signature as another request's (docs/expert-affinity.md).
    affinity_control: str = "none"

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("need at least one engine")
        if self.placement != "off":
            if not self.coupled:
                raise ValueError(f"placement {self.placement!r} needs the lock-step DP+EP fleet (coupled)")
            names = placement_names()
            if self.placement not in names:
                raise ValueError(f"unknown placement {self.placement!r}; choose from off, {', '.join(names)}")
        if self.prefix_index not in PREFIX_INDEXES:
            raise ValueError(f"prefix_index must be one of {', '.join(PREFIX_INDEXES)}, got {self.prefix_index!r}")

    def weights_for(self, dispatch: str) -> dict[str, float]:
        """`dispatch_weights` restricted to the scorers of profile `dispatch` (a fleet runs several)."""
        names = dp_profile(dispatch, self.params).weights
        return {name: weight for name, weight in self.dispatch_weights if name in names}

    @cached_property
    def dp_cost(self) -> DPCost:
        ranks = self.engines * self.cost.gpus if self.coupled else self.cost.gpus
        return DPCost(self.cost, ep_ranks=ranks)

    @cached_property
    def ep_topology(self) -> EpTopology:
        """The EP group's ranks and links (`core.ep`; bandwidths and latencies from DeepEP's measurements)."""
        m = self.cost.model
        return EpTopology(
            ranks=self.dp_cost.ep_ranks, hidden=m.hidden, tp=self.cost.gpus, ranks_per_node=self.ep_ranks_per_node
        )

    @property
    def engine_kv_blocks(self) -> int:
        return int(self.kv_blocks if self.kv_blocks is not None else self.dp_cost.kv_capacity_blocks)

    @property
    def label(self) -> str:
        tp = self.cost.gpus
        ep = f"EP{self.dp_cost.ep_ranks}" + (" lock-step" if self.coupled else "")
        return f"DP{self.engines} TP{tp} {ep}"


@dataclass
class DPSimResult:
    """Per-request times and engines, per-step records (one row per engine per step), per-engine counters."""

    dispatch: str
    order: str
    fleet: DPFleetConfig
    workload: Workload
    arrival: np.ndarray
    engine: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    tokens: np.ndarray
    step_engine: np.ndarray
    step_start: np.ndarray
    step_duration: np.ndarray
    step_tokens: np.ndarray
    step_prefill: np.ndarray
    step_decode: np.ndarray
    step_running: np.ndarray
    step_waiting: np.ndarray
    engine_requests: np.ndarray
    engine_tokens: np.ndarray
    engine_prompt_tokens: np.ndarray
    engine_busy: np.ndarray
    engine_preemptions: np.ndarray
    engine_max_kv_blocks: np.ndarray
    engine_aged_admissions: np.ndarray
    engine_prefix_query_tokens: np.ndarray
    engine_prefix_hit_tokens: np.ndarray
    engine_prefix_evictions: np.ndarray
    kv_first_decisions: int
    makespan: float
    #: Per request, prompt tokens found in the prefix cache at its first admission (0 without caching).
    prefix_hit: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: `[n, 2]`, per request, the cached tokens the (precise, approximate) index predicted on the engine chosen,
    #: at the decision; -1 where none was asked (a profile that reads no prefix index, a request without keys).
    prefix_predicted: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    #: With a placement: the run's ``ep_*`` figures (`dp_ep.EpRun.summary`); empty when placement is off.
    ep: dict[str, float] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        """Fleet prompt tokens found cached over prompt tokens looked up (vLLM's hits / queries; 0 if none)."""
        q = int(self.engine_prefix_query_tokens.sum())
        return int(self.engine_prefix_hit_tokens.sum()) / q if q else 0.0

    def prefix_index_accuracy(self) -> dict[str, float]:
        """Per index, how well its predictions matched the hit found at admission, over requests it predicted:
        ``prefix_<index>_mae`` (mean |predicted − found| tokens), ``prefix_<index>_exact`` (fraction equal),
        ``prefix_<index>_bias`` (mean predicted − found); empty when no request was predicted."""
        out: dict[str, float] = {}
        for col, name in enumerate(PREFIX_INDEXES):
            pred = self.prefix_predicted[:, col] if len(self.prefix_predicted) else np.zeros(0)
            asked = pred >= 0
            if not asked.any():
                continue
            err = pred[asked] - self.prefix_hit[asked]
            out[f"prefix_{name}_mae"] = float(np.abs(err).mean())
            out[f"prefix_{name}_exact"] = float((err == 0).mean())
            out[f"prefix_{name}_bias"] = float(err.mean())
        return out

    @property
    def label(self) -> str:
        """``dispatch+order``, plus ``+placement`` when the fleet places experts."""
        tail = f"+{self.fleet.placement}" if self.fleet.placement != "off" else ""
        return f"{self.dispatch}+{self.order}{tail}"
