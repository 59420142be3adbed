"""Expert parallelism and migrations in the lock-step DP fleet: the bookkeeping `simulate_dp` delegates.

With a placement (`DPFleetConfig.placement` ≠ "off") a lock-step step lasts

    max over engines of the dense/attention part + MoE time under the layout in force + all-to-all time

(`core.ep`: the busiest rank's expert work, the busiest rank's dispatch and combine bytes), times the
migration slowdown while a migration is in flight. `EpRun` holds the fleet's `PlacementControl`: it feeds it
every step's expert selections by source engine and the requests running and waiting at the engines
(`observe`), asks it every telemetry interval (100 ms)
whether to move (`replan`), executes a returned layout as `solver.placement.moves.plan_moves` orders the
moves, and calls `applied` when the migration's priced time has passed; the layout in force changes then
(the engines keep the old layout while the weights are copied, as vLLM's EPLB rearrangement does).

Migration price (`solver.placement.payoff.MigrationPrice`, the price the placement loop predicts with): each
GPU that gains an expert copy receives the expert's bytes (`ModelSpec.expert_bytes`) from a GPU holding it,
over NVLink inside a node and the network across, at DeepEP's measured kernel bandwidths (`EpTopology`) times
one efficiency calibrated so that a full rearrangement of the seed's deployment (Qwen3-30B-A3B, EP 4, one node)
takes the Gimbal paper's measured 0.72 s (seed 003: "Expert migration costs average 1.08s for first
rearrangement and 0.72s for subsequent ones"); the busiest GPU sets the duration, and a group's first
migration adds 0.36 s (1.08 − 0.72: buffer allocation, warm-up). While it runs, steps take `slowdown` (2.0)
times as long: weight copies share HBM and links with the serving kernels. The 2.0 is an assumption, not a
measurement; `bench/migration_overhead.py` measures only the control plane's cost (≈ ms), not the engines'.

Expert pressure (what each engine's telemetry reports, what Gimbal's dispatch reads): every step's expert
work per rank under the layout in force, fleet-wide, and each engine reports the busiest of its own GPUs over
the mean rank (`MixedEngine.take_expert_pressure` with `own_ranks`): an engine whose GPUs host hot experts
reports high pressure, so the dispatcher keeps work off GPUs the MoE phase already waits on, and a placement
that cools them lowers it. This closes the loop the seed describes (backend pressure up, migrations down).

Per run (`EpRun.summary`, the ``ep_*`` keys of `summarize_dp`): migrations, moves, seconds migrating and
seconds added by the slowdown, all-to-all bytes per computed token over NVLink and over the network, the
all-to-all's share of step time, and the busiest rank's expert load over the mean rank's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from switchyard.simulator.core.dp_engine import MixedEngine, MixedStep
from switchyard.simulator.core.ep import EpTopology, Placed, busiest, placed, rank_work, selections, step_traffic
from switchyard.simulator.core.experts import ReplayBank
from switchyard.simulator.core.physics import CostModel
from switchyard.simulator.core.placement_control import PlacementControl
from switchyard.solver.placement.moves import plan_moves
from switchyard.solver.placement.payoff import MigrationPrice, migration_bytes, migration_seconds

__all__ = ["EpRun", "migration_price"]


def migration_price(cost: CostModel, topo: EpTopology) -> MigrationPrice:
    """What moving this model's experts over this group's links costs (the module docstring)."""
    return MigrationPrice(
        expert_bytes=cost.model.expert_bytes,
        ranks_per_node=topo.ranks_per_node,
        nvlink_bytes_per_s=topo.nvlink_bytes_per_s,
        network_bytes_per_s=topo.network_bytes_per_s,
    )


class EpRun:
    """The EP side of one lock-step run: layout in force, control, migration in flight, counters."""

    def __init__(
        self,
        cost: CostModel,
        topo: EpTopology,
        bank: ReplayBank,
        control: PlacementControl,
        prefill_counts: np.ndarray | None,
        replan_interval_s: float,
        price: MigrationPrice | None = None,
    ) -> None:
        self.cost = cost
        self.topo = topo
        self.bank = bank
        self.control = control
        self.prefill_counts = prefill_counts
        self.replan_interval_s = replan_interval_s
        self.price = price or migration_price(cost, topo)
        self.num_experts = bank.num_experts
        self.placed: Placed = placed(control.layout(), self.num_experts)
        self._migration: tuple[float, np.ndarray] | None = None  # (end time, target layout)
        self._next_replan = -np.inf
        self._bound: list[MixedEngine] | None = None  # the engines whose `own_ranks` are set
        # counters
        self.migrations = 0
        self.moves = 0
        self.migration_s = 0.0
        self.migration_bytes = 0.0
        self.slowed_s = 0.0
        self.steps = 0
        self.tokens = 0
        self.nvlink_bytes = 0.0
        self.network_bytes = 0.0
        self.a2a_s = 0.0
        self.step_s = 0.0
        self._load_ratio = 0.0
        self._waiting = 0  # requests waiting (not admitted), summed over steps

    @property
    def migrating(self) -> bool:
        return self._migration is not None

    def tick(self, now: float) -> None:
        """Before a step at `now`: finish a migration that is due, then re-plan if the interval has passed."""
        if self._migration is not None and now >= self._migration[0]:
            end, target = self._migration
            self._migration = None
            self.placed = placed(target, self.num_experts)
            self.control.applied(end, target)
        if self._migration is None and now >= self._next_replan:
            self._next_replan = now + self.replan_interval_s
            target = self.control.replan(now)
            if target is not None:
                self._start(now, np.asarray(target))

    def _start(self, now: float, target: np.ndarray) -> None:
        moves = plan_moves(self.placed.layout, target, buffer=True)
        seconds = migration_seconds(self.placed.layout, target, self.price, first=self.migrations == 0)
        if seconds == 0.0:  # no GPU gains an expert (slots shuffled at most): in force at once
            self.placed = placed(target, self.num_experts)
            self.control.applied(now, target)
            return
        self.migrations += 1
        self.moves += len(moves)
        self.migration_s += seconds
        self.migration_bytes += float(migration_bytes(self.placed.layout, target, self.price)[1].sum())
        self._migration = (now + seconds, target)

    def step_seconds(
        self, now: float, nonmoe_s: float, plans: Sequence[MixedStep | None], engines: list[MixedEngine]
    ) -> float:
        """The lock-step step's duration at `now` from the engines' plans; feeds the control and the engines'
        expert-pressure windows. Runs `tick` first: a due migration lands, a due re-plan happens."""
        self.tick(now)
        dec_sel, dec_src, chunk_counts, chunk_tokens, chunk_src = self._selections(plans)
        traffic = step_traffic(
            self.topo, self.placed, dec_sel, dec_src, chunk_counts, chunk_tokens, chunk_src, self.cost.model.top_k
        )
        counts = traffic.load.sum(axis=1)  # [L, E]
        distinct, pairs = rank_work(counts, self.placed)
        moe_s, _, _ = busiest(self.cost, distinct, pairs)
        base = nonmoe_s + moe_s + traffic.a2a_s
        factor = self.price.slowdown if self._migration is not None else 1.0
        duration = base * factor
        running = sum(engine.num_running for engine in engines)
        waiting = sum(engine.num_waiting for engine in engines)
        self.control.observe(now, traffic.load, running, waiting)
        self._waiting += waiting
        if engines is not self._bound:  # once per fleet: each engine reports the EP ranks on its own GPUs
            self._bound = engines
            for i, engine in enumerate(engines):
                engine.own_ranks = slice(i * self.topo.tp, (i + 1) * self.topo.tp)
        for engine in engines:  # every engine's GPUs carry the fleet's expert load
            engine.add_expert_load(pairs)
        self.steps += 1
        self.tokens += sum(p.tokens for p in plans if p is not None)
        self.nvlink_bytes += traffic.nvlink_bytes
        self.network_bytes += traffic.network_bytes
        self.a2a_s += traffic.a2a_s * factor
        self.step_s += duration
        self.slowed_s += duration - base
        mean = pairs.mean(axis=1)
        busy = mean > 0
        if busy.any():
            self._load_ratio += float((pairs.max(axis=1)[busy] / mean[busy]).mean())
        return duration

    def _selections(
        self, plans: Sequence[MixedStep | None]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The step's decode selections `[B, L, E]` with engines `[B]`, and prefill chunks' expected pairs
        `[C, L, E]` with their tokens `[C]` and engines `[C]`."""
        bank, e_count = self.bank, self.num_experts
        rows = [p.decode_rows for p in plans if p is not None]
        dec_src = np.concatenate([np.full(len(p.decode_rows), i) for i, p in enumerate(plans) if p is not None] or [[]])
        dec_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        dec_sel = selections(bank.decode_bits[dec_rows], e_count)
        pre = [(i, p.prefill_rows, p.prefill_chunk) for i, p in enumerate(plans) if p is not None]
        chunk_src = np.concatenate([np.full(len(r), i) for i, r, _ in pre] or [[]]).astype(np.int64)
        chunk_rows = np.concatenate([r for _, r, _ in pre] or [[]]).astype(np.int64)
        chunk_tokens = np.concatenate([c for _, _, c in pre] or [[]]).astype(np.float64)
        if self.prefill_counts is not None:
            per_token = self.prefill_counts[chunk_rows] / np.maximum(bank.prefill_len[chunk_rows], 1)[:, None, None]
        else:  # the prefill union only: k selections per token spread evenly over it
            union = selections(bank.prefill_bits[chunk_rows], e_count).astype(np.float64)
            per_token = union * self.cost.model.top_k / np.maximum(union.sum(axis=2, keepdims=True), 1)
        chunk_counts = per_token * chunk_tokens[:, None, None]
        return dec_sel, dec_src.astype(np.int64), chunk_counts, chunk_tokens, chunk_src

    def summary(self) -> dict[str, float]:
        """The run's ``ep_*`` figures (the module docstring)."""
        tokens = max(self.tokens, 1)
        out = {
            "ep_migrations": float(self.migrations),
            "ep_moves": float(self.moves),
            "ep_migration_s": self.migration_s,
            "ep_migration_bytes": self.migration_bytes,
            "ep_slowed_s": self.slowed_s,
            "ep_a2a_nvlink_bytes_per_token": self.nvlink_bytes / tokens,
            "ep_a2a_network_bytes_per_token": self.network_bytes / tokens,
            "ep_a2a_fraction": self.a2a_s / self.step_s if self.step_s > 0 else 0.0,
            "ep_load_max_mean": self._load_ratio / self.steps if self.steps else 1.0,
            "ep_waiting_mean": self._waiting / self.steps if self.steps else 0.0,
        }
        # the step-time rule's published predictions and the savings measured after them (`GimbalLoop.checks`)
        checks = getattr(self.control, "checks", [])
        measured = [c for c in checks if c.measured_gain_s is not None]
        out["ep_predicted_gain_s"] = sum(c.predicted_gain_s for c in checks)
        out["ep_predicted_cost_s"] = sum(c.predicted_cost_s for c in checks)
        out["ep_measured_gain_s"] = sum(c.measured_gain_s for c in measured)
        out["ep_predicted_gain_checked_s"] = sum(c.predicted_gain_s for c in measured)
        out["ep_deferred"] = getattr(self.control, "deferred_plans", 0)  # deferred while requests waited
        return {k: float(v) for k, v in out.items()}
