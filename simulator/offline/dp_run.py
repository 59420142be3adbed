"""`switchyard sim-dp`: one workload through one DP fleet under each (dispatch rule, queue order) pair.

Metrics (seconds, tokens/s):

- TTFT: arrival → first output token (dispatch, queueing, chunked prefill; the token is sampled at the end
  of the step that computes the prompt's last chunk). TPOT: (last − first token) / (output − 1), requests
  with more than one output token. Mean, median and p99 over requests.
- throughput: output tokens per second, first arrival → last finish; `prompt_throughput` likewise for
  prefill tokens computed (recomputation after preemption included).
- `prompt_tput_gap`: Gimbal's cross-engine imbalance figure: in windows of `window_s` (10 s, vLLM's stats
  logging interval) over the arrival span, each engine's prefill tokens per second; the gap is max − min
  over engines, averaged over windows. `prompt_tput_cov`: the same windows' coefficient of variation.
- `mean_running`: running requests per engine, time-weighted over the run, averaged over engines.
- `prefix_hit_rate`: prompt tokens found in the engines' prefix caches over prompt tokens looked up at
  admissions (vLLM's hits / queries, readmissions after preemption included); `prefix_hit_request_mean`: the
  mean over requests of the hit at its first admission over its prompt. Both 0 on traces without `hash_ids`.
- `prefix_precise_mae`, `prefix_precise_exact`, `prefix_precise_bias` and the same for `approximate` (profiles
  that read ``cached_tokens``, traces with `hash_ids`): how well each prefix index predicted, at the decision,
  the cached tokens the request then found at admission on the engine chosen (`DPSimResult.prefix_index_accuracy`).
- `dispatch_run_mean`: mean length of the runs of consecutive arrivals sent to the same engine (1 = strict
  alternation between engines). In lock-step DP+EP, runs put several new prompts on one engine in the same
  step, and that engine's dense and attention time sets the step for everyone.
- With `--placement` (`DPSimOptions.placements`), one run per (dispatch, order, placement), keyed
  ``dispatch+order+placement``, each step priced under the layout in force (`dp_ep`, docs/ep-simulation.md),
  plus the ``ep_*`` keys: `ep_migrations`, `ep_moves`, `ep_migration_s` (seconds migrating), `ep_slowed_s`
  (seconds the migration slowdown added to steps), `ep_a2a_nvlink_bytes_per_token` and
  `ep_a2a_network_bytes_per_token` (dispatch + combine, all layers, per computed token), `ep_a2a_fraction`
  (all-to-all share of step time), `ep_load_max_mean` (busiest rank's expert pairs over the mean rank's, mean
  over layers and steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from switchyard.simulator.core.defaults import (
    DP_MAX_RUNNING,
    INFLIGHT_GRACE_S,
    TELEMETRY_INTERVAL_S,
    TOKEN_BUDGET,
)
from switchyard.simulator.core.dp_engine import ORDERS
from switchyard.simulator.core.placements import placement_names
from switchyard.simulator.core.workload import RequestTrace, Workload, load_requests
from switchyard.simulator.offline.dp import DPFleetConfig, DPSimResult, simulate_dp
from switchyard.simulator.offline.dp_affinity import AFFINITY_CONTROLS
from switchyard.simulator.offline.metrics import percentile, write_json
from switchyard.simulator.offline.scenario import Scenario, prepare
from switchyard.solver.routing.profiles import DP_PROFILES, dp_profile

__all__ = ["DP_SUMMARY_KEYS", "DPSimOptions", "prompt_throughput_gap", "run_sim_dp", "summarize_dp", "trace_window"]

#: Scalar keys of `summarize_dp`, in table/CSV order.
DP_SUMMARY_KEYS = (
    "ttft_mean",
    "ttft_p50",
    "ttft_p99",
    "tpot_mean",
    "tpot_p50",
    "tpot_p99",
    "throughput",
    "prompt_throughput",
    "prompt_tput_gap",
    "prompt_tput_cov",
    "mean_running",
    "busy_fraction",
    "preemptions",
    "max_kv_usage",
    "kv_first_decisions",
    "aged_admissions",
    "requests",
    "offered_rate",
    "prefix_hit_rate",
)


def prompt_throughput_gap(res: DPSimResult, window_s: float = 10.0) -> tuple[float, float]:
    """(mean max−min, mean CoV) over windows of each engine's prefill tokens/s; see the module docstring."""
    t0 = float(res.arrival.min())
    span = float(res.arrival.max()) - t0
    if span <= 0:
        return 0.0, 0.0
    width = min(window_s, span)
    windows = max(int(span // width), 1)
    w = ((res.step_start - t0) // width).astype(np.int64)
    keep = (w >= 0) & (w < windows)
    n = res.fleet.engines
    per = np.zeros((windows, n))
    np.add.at(per, (w[keep], res.step_engine[keep]), res.step_prefill[keep])
    per /= width
    gap = float((per.max(axis=1) - per.min(axis=1)).mean())
    mean = per.mean(axis=1)
    cov = float(np.where(mean > 0, per.std(axis=1) / np.where(mean > 0, mean, 1), 0).mean())
    return gap, cov


def summarize_dp(res: DPSimResult, window_s: float = 10.0) -> dict[str, object]:
    """Headline numbers of one run (see the module docstring)."""
    out = res.workload.output
    ttft = res.first_token - res.arrival
    multi = out > 1
    tpot = (res.finish[multi] - res.first_token[multi]) / (out[multi] - 1)
    span = float(np.nanmax(res.finish) - res.arrival.min())
    gap, cov = prompt_throughput_gap(res, window_s)
    n = res.fleet.engines
    running = np.bincount(res.step_engine, weights=res.step_running * res.step_duration, minlength=n)
    kv_blocks = res.fleet.engine_kv_blocks
    e = res.engine
    runs = np.diff(np.flatnonzero(np.r_[True, e[1:] != e[:-1], True])) if len(e) else np.zeros(1)
    return {
        "dispatch": res.dispatch,
        "order": res.order,
        "fleet": res.fleet.label,
        "requests": int(res.workload.size),
        "offered_rate": res.workload.offered_rate,
        "ttft_mean": float(ttft.mean()),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot_mean": float(tpot.mean()) if len(tpot) else float("nan"),
        "tpot_p50": percentile(tpot, 50),
        "tpot_p99": percentile(tpot, 99),
        "throughput": float(res.tokens.sum() / span) if span > 0 else float("nan"),
        "prompt_throughput": float(res.engine_prompt_tokens.sum() / span) if span > 0 else float("nan"),
        "prompt_tput_gap": gap,
        "prompt_tput_cov": cov,
        "mean_running": float(running.mean() / span) if span > 0 else 0.0,
        "busy_fraction": float(res.engine_busy.mean() / span) if span > 0 else 0.0,
        "preemptions": int(res.engine_preemptions.sum()),
        "max_kv_usage": float(res.engine_max_kv_blocks.max() / kv_blocks),
        "kv_first_decisions": int(res.kv_first_decisions),
        "prefix_hit_rate": res.prefix_hit_rate,
        "prefix_hit_request_mean": float((res.prefix_hit / res.workload.prompt).mean()) if len(res.prefix_hit) else 0.0,
        **res.prefix_index_accuracy(),
        **res.ep,  # with a placement: migrations, all-to-all bytes per token, rank load (`dp_ep.EpRun.summary`)
        "aged_admissions": int(res.engine_aged_admissions.sum()),
        "dispatch_run_mean": float(runs.mean()),
        "makespan_s": span,
        "per_engine": {
            "requests": res.engine_requests.tolist(),
            "prompt_tokens": res.engine_prompt_tokens.tolist(),
            "output_tokens": res.engine_tokens.tolist(),
            "busy_fraction": [round(float(b / span), 4) for b in res.engine_busy] if span > 0 else [],
            "preemptions": res.engine_preemptions.tolist(),
            "prefix_hit_rate": [
                round(float(h / q), 4) if q else 0.0
                for h, q in zip(res.engine_prefix_hit_tokens, res.engine_prefix_query_tokens, strict=True)
            ],
        },
    }


def trace_window(trace: RequestTrace, start: int) -> RequestTrace:
    """The trace from request `start` on, times shifted to start at 0 (another stretch of the same day)."""
    if not 0 <= start < len(trace.arrival):
        raise ValueError(f"start {start} outside the trace's {len(trace.arrival)} requests")
    a = trace.arrival[start:]
    ids = trace.hash_ids[start:] if trace.hash_ids is not None else None
    return RequestTrace(
        a - a[0], trace.prompt[start:], trace.output[start:], f"{trace.source}[{start}:]", ids, trace.hash_block
    )


@dataclass(frozen=True)
class DPSimOptions:
    trace: Path
    requests: Path | None = None
    time_scale: float = 1.0
    rate: float | None = None
    start: int = 0  # first request of the CSV to replay
    engines: int = 2
    tp: int = 2
    coupled: bool = True
    dispatch: tuple[str, ...] = ("vllm", "gimbal")
    orders: tuple[str, ...] = ("fcfs", "sjf-aging")
    num_requests: int = 2000
    seed: int = 0
    gpu: str = "H100"
    model: str | None = None
    prefill_fraction: float = 0.5
    max_running: int = DP_MAX_RUNNING
    token_budget: int = TOKEN_BUDGET
    kv_blocks: int | None = None
    window_s: float = 10.0
    telemetry_interval_s: float = TELEMETRY_INTERVAL_S
    inflight_grace_s: float = INFLIGHT_GRACE_S
    telemetry_aligned: bool = False
    inflight_drain_tokens_per_s: float = 0.0
    dispatch_weights: tuple[tuple[str, float], ...] = ()  # scorer name → weight (`DPFleetConfig`)
    prefix_caching: bool = True  # vLLM's automatic prefix caching (acts on traces with hash_ids)
    prefix_index: str = "precise"  # where cached_tokens comes from (`dp.PREFIX_INDEXES`)
    borrow_routing: bool = False  # `model` on the trace's routed shape (`core.borrowed_routing`)
    #: Placement controls to run (`core.placements`); empty: placement off, keys ``dispatch+order`` as before.
    placements: tuple[str, ...] = ()
    ep_ranks_per_node: int = 8
    ledger_control: str = "none"  # the exact ledger's control (`dp.LEDGER_CONTROLS`)
    affinity_control: str = "none"  # expert affinity's signature feed (`dp_affinity.AFFINITY_CONTROLS`)


def fleet_for(sc: Scenario, opts: DPSimOptions) -> DPFleetConfig:
    return DPFleetConfig(
        engines=opts.engines,
        cost=sc.cost,
        coupled=opts.coupled,
        max_running=opts.max_running,
        token_budget=opts.token_budget,
        kv_blocks=opts.kv_blocks,
        telemetry_interval_s=opts.telemetry_interval_s,
        inflight_grace_s=opts.inflight_grace_s,
        telemetry_aligned=opts.telemetry_aligned,
        inflight_drain_tokens_per_s=opts.inflight_drain_tokens_per_s,
        dispatch_weights=opts.dispatch_weights,
        prefix_caching=opts.prefix_caching,
        prefix_index=opts.prefix_index,
        ep_ranks_per_node=opts.ep_ranks_per_node,
        ledger_control=opts.ledger_control,
        affinity_control=opts.affinity_control,
    )


def workload_for(sc: Scenario, opts: DPSimOptions, fleet: DPFleetConfig) -> Workload:
    requests = load_requests(opts.requests) if opts.requests is not None else None
    if requests is not None and opts.start:
        requests = trace_window(requests, opts.start)
    return sc.workload(
        opts.num_requests,
        seed=opts.seed,
        rate=opts.rate,
        requests=requests,
        time_scale=opts.time_scale,
        max_tokens=fleet.engine_kv_blocks * sc.cost.block_size,
    )


def run_sim_dp(
    opts: DPSimOptions,
    json_path: Path | None = None,
    scenario: Scenario | None = None,
    on_run: Callable[[int, int, str, float], None] | None = None,
    out_dir: Path | None = None,
) -> dict[str, object]:
    """Every (dispatch, order) pair on one workload; returns (and writes) {config, runs: {"d+o": summary}}.

    `out_dir`: also draw the runs' latency CDFs and per-engine shares there (`plots.plot_dp_runs`), with the JSON.
    `on_run(done, total, label, wall_s)` is called after each run (the CLI prints progress with it: a grid of
    runs takes minutes)."""
    if opts.requests is None and opts.rate is None:
        raise ValueError("give either --requests TRACE (with --time-scale) or --rate (or both: Poisson, CSV lengths)")
    for d in opts.dispatch:
        if d not in DP_PROFILES:
            raise ValueError(f"unknown dispatch {d!r}; choose a DP profile: {', '.join(DP_PROFILES)}")
    scorers = {name for d in opts.dispatch for name in dp_profile(d).weights}
    unknown = sorted({name for name, _ in opts.dispatch_weights} - scorers)
    if unknown:
        raise ValueError(
            f"no dispatched profile has a scorer {', '.join(map(repr, unknown))}; theirs: {', '.join(sorted(scorers))}"
        )
    for o in opts.orders:
        if o not in ORDERS:
            raise ValueError(f"unknown order {o!r}; choose from {', '.join(ORDERS)}")
    if opts.affinity_control not in AFFINITY_CONTROLS:
        known_controls = ", ".join(AFFINITY_CONTROLS)
        raise ValueError(f"unknown affinity control {opts.affinity_control!r}; choose from {known_controls}")
    known = placement_names()
    for p in opts.placements:
        if p not in known:
            raise ValueError(f"unknown placement {p!r}; choose from {', '.join(known)}")
    sc = scenario or prepare(
        opts.trace,
        model=opts.model,
        gpu=opts.gpu,
        gpus=opts.tp,
        prefill_fraction=opts.prefill_fraction,
        seed=opts.seed,
        borrow_routing=opts.borrow_routing,
    )
    fleet = fleet_for(sc, opts)
    wl = workload_for(sc, opts, fleet)
    prefill_counts = sc.counts.prefill[sc.replay]
    runs: dict[str, dict[str, object]] = {}
    kept: dict[str, DPSimResult] = {}  # the runs themselves, only when they are drawn
    total = len(opts.dispatch) * len(opts.orders) * max(1, len(opts.placements))
    for d in opts.dispatch:
        for o in opts.orders:
            for p in opts.placements or ("off",):
                t0 = time.perf_counter()
                placed = replace(fleet, placement=p)
                res = simulate_dp(wl, sc.bank, placed, d, o, seed=opts.seed, prefill_counts=prefill_counts)  # type: ignore[arg-type]
                summary = summarize_dp(res, opts.window_s)
                summary["wall_s"] = time.perf_counter() - t0
                runs[res.label] = summary
                if out_dir is not None:
                    kept[res.label] = res
                if on_run is not None:
                    on_run(len(runs), total, res.label, float(summary["wall_s"]))
    config = {
        "trace": str(opts.trace),
        "requests": str(opts.requests) if opts.requests else None,
        "model": sc.model.name,
        "gpu": sc.cost.gpu.name,
        "fleet": fleet.label,
        "engines": fleet.engines,
        "tp": sc.cost.gpus,
        "ep_ranks": fleet.dp_cost.ep_ranks,
        "coupled": fleet.coupled,
        "num_requests": opts.num_requests,
        "seed": opts.seed,
        "workload": wl.description,
        "start": opts.start,
        "time_scale": opts.time_scale if opts.rate is None else None,
        "rate": opts.rate,
        "offered_rate": wl.offered_rate,
        "mean_prompt": float(wl.prompt.mean()),
        "mean_output": float(wl.output.mean()),
        "kv_blocks_per_engine": fleet.engine_kv_blocks,
        "max_running": fleet.max_running,
        "token_budget": fleet.token_budget,
        "telemetry_interval_s": fleet.telemetry_interval_s,
        "inflight_grace_s": fleet.inflight_grace_s,
        "telemetry_aligned": fleet.telemetry_aligned,
        "inflight_drain_tokens_per_s": fleet.inflight_drain_tokens_per_s,
        "age_threshold_s": fleet.params.age_threshold_s,
        "window_s": opts.window_s,
        "prefix_caching": fleet.prefix_caching,
        "prefix_block_tokens": wl.hash_block or None,
        "prefix_index": fleet.prefix_index,
        "prefix_ttl_s": fleet.prefix_ttl_s,
        "affinity_control": opts.affinity_control,
    }
    if opts.placements:
        topo = fleet.ep_topology
        config["placements"] = list(opts.placements)
        config["ep_ranks_per_node"] = topo.ranks_per_node
        config["ep_nvlink_bytes_per_s"] = topo.nvlink_bytes_per_s
        config["ep_network_bytes_per_s"] = topo.network_bytes_per_s
    if opts.dispatch_weights:
        config["dispatch_weights"] = dict(opts.dispatch_weights)
    payload = {"config": config, "runs": runs}
    if json_path is not None:
        write_json(json_path, payload)
    if out_dir is not None:
        from switchyard.simulator.offline.plots import plot_dp_runs  # matplotlib only when drawing

        write_json(out_dir / "summary.json", payload)
        plot_dp_runs(kept, out_dir, f"{fleet.label}, {wl.description}")
    return payload
