"""The report's simulation runs, each run once and cached (`Runner`), and what every section shares with them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from switchyard.simulator.core.workload import RequestTrace
from switchyard.simulator.offline.metrics import summarize
from switchyard.simulator.offline.report.options import LOAD_BALANCERS, ReportOptions
from switchyard.simulator.offline.scenario import Scenario
from switchyard.solver.routing import get_policy

__all__ = ["ReportContext", "Runner", "best_lb", "pct"]


class Runner:
    """Runs (and caches) one simulation per (fleet, rate, policy); collects rows for the CSV."""

    def __init__(self, sc: Scenario, requests: RequestTrace, opts: ReportOptions) -> None:
        self.sc, self.requests, self.opts = sc, requests, opts
        self.rows: list[dict[str, object]] = []
        self._cache: dict[tuple[int, float, str, float | None, tuple[float, bool]], dict[str, object]] = {}
        first = requests.arrival[: opts.n]
        self._native = (len(first) - 1) / float(first[-1] - first[0])

    def run(
        self,
        decoders: int,
        rate: float,
        policy: str,
        tau: float | None = None,
        costs: tuple[float, bool] = (0.0, False),
    ) -> dict[str, object]:
        """One simulation; `costs` = (per-step CPU overhead in s, all-to-all on) for the bracket's sweep."""
        key = (decoders, rate, policy, tau, costs)
        if key in self._cache:
            return self._cache[key]
        pol = get_policy(policy)
        if tau is not None:
            pol = replace(pol, name=f"{policy}-tau{tau:g}", tau=tau)
        fleet = self.sc.fleet(8, decoders)
        if costs != (0.0, False):
            fleet = replace(fleet, cost=replace(self.sc.cost, step_overhead_s=costs[0], a2a=costs[1]))
        wl = self.sc.workload(
            self.opts.n,
            seed=self.opts.seed,
            requests=self.requests,
            time_scale=rate / self._native,
            max_tokens=fleet.decode_kv_blocks * self.sc.cost.block_size,
        )
        t0 = time.perf_counter()
        res = self.sc.run(wl, fleet, pol, seed=self.opts.seed)
        s = summarize(res)
        expert_s = fleet.cost.b * float(res.step_distinct.sum()) * self.sc.bank.num_layers
        s.update(
            rate=rate,
            decoders=decoders,
            tau=tau,
            step_overhead_ms=costs[0] * 1e3,
            a2a=costs[1],
            expert_share=expert_s / float(res.step_duration.sum()),
            wall_s=time.perf_counter() - t0,
        )
        self._cache[key] = s
        self.rows.append(s)
        return s


@dataclass(frozen=True)
class ReportContext:
    """What every section builds from: the options, the scenario, the cached runs, where figures go, a logger."""

    opts: ReportOptions
    sc: Scenario
    runner: Runner
    out_dir: Path
    log: Callable[[str], None]

    @property
    def model(self) -> str:
        return self.sc.model.name

    @property
    def gpu(self) -> str:
        return self.sc.cost.gpu.name


def pct(new: float, base: float) -> float:
    return 100.0 * (new - base) / base


def best_lb(
    runner: Runner, decoders: int, rate: float, key: str, costs: tuple[float, bool] = (0.0, False)
) -> tuple[str, float]:
    """The load balancer with the lowest `key` at this fleet, rate and costs, and that value."""
    vals = {p: float(runner.run(decoders, rate, p, costs=costs)[key]) for p in LOAD_BALANCERS}
    best = min(vals, key=vals.__getitem__)
    return best, vals[best]
