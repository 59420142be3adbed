"""Placement evidence on real expert loads (SGLang's DeepSeek-V3 statistics): speed, balance, calibration.

    .venv/bin/python bench/bench_placement.py                    # everything (a few minutes on 2 cores)
    .venv/bin/python bench/bench_placement.py --sections speed   # greedy and MINLP timings only

Sections:
- speed: greedy at 48 layers x 128 experts x 8 GPUs (budget 50 ms); MINLP at 48 x 128 x 4 (budget 15 s, the
  seed's figure) with its optimality gap, for 1 and 2 layers solved at once.
- balance: max/mean GPU load (per layer, averaged over layers; and the worst layer), remote share of the
  traffic and expert copies moved from the default contiguous layout, for EPLB-style global packing, the
  greedy, the online placement (`place`) and the MINLP, each without and with replicas, all at equal
  slots per GPU; both for a fresh placement (no migration term) and rebalancing from contiguous.
- calibration: `calibrate` on the three windows at 48 x 128 x 4: fitted weights, agreement and
  communication gap against the MINLP of the online placement and of the greedy alone, beside the
  uncalibrated greedy (α = β = γ = 1) and the seed's weights.

Windows: each SGLang workload file plays one source DP rank (see services/calibration.py); 48 x 128 cuts
are the first 48 MoE layers and the first 128 experts of the real counts. Results go to stdout (markdown)
and bench/out/placement.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import _single_core  # before numpy: one BLAS thread; and the machine line
import numpy as np

from switchyard.data import SHIPPED_DIR
from switchyard.services.calibration import Window, sglang_windows, window_problem
from switchyard.shared.placement_terms import DEFAULT_MIGRATION_COST
from switchyard.solver.placement import (
    MinlpOptions,
    PlacementProblem,
    Weights,
    gpu_loads,
    greedy,
    greedy_hosts,
    hosts_from_slots,
    objective,
    place,
    solve_minlp,
)
from switchyard.solver.placement.calibrate import calibrate
from switchyard.solver.placement.eplb_baseline import eplb_global

SGLANG = SHIPPED_DIR / "expert_load" / "sglang_deepseek_v3"
OUT = Path(__file__).resolve().parent / "out"
MIGRATION_COST = DEFAULT_MIGRATION_COST  # per host change, in mean-GPU-loads (the `switchyard calibrate` default)


def problem_for(
    window: Window, gpus: int, *, redundant: int = 0, fresh: bool = False, layers=None, experts=None
) -> PlacementProblem:
    """The window on `gpus` GPUs with `redundant` spare slots per layer (E + R slots in all), from the
    engines' default contiguous layout with migration cost, or `fresh` (no current layout, no migration)."""
    problem = window_problem(
        window, gpus, migration_cost=MIGRATION_COST, weights=Weights(), layers=layers, experts=experts
    )
    extra = -(-redundant // gpus)
    return replace(
        problem,
        slots_per_gpu=problem.slots_per_gpu + extra,
        migration_cost=0.0 if fresh else problem.migration_cost,
        current=None if fresh else _pad(problem.current, extra),
        redundant_slots=redundant,
    )


def _pad(slot_map: np.ndarray, extra: int) -> np.ndarray:
    return np.concatenate([slot_map, np.full((*slot_map.shape[:2], extra), -1, dtype=slot_map.dtype)], axis=2)


def speed(windows: list[Window], repeats: int) -> dict:
    decode = windows[0]
    problem = problem_for(decode, 8, layers=48, experts=128)
    greedy(problem)  # warm-up
    began = time.perf_counter()
    place(problem)
    place_ms = (time.perf_counter() - began) * 1e3
    hosts_ms, slots_ms, slots_cpu_ms = [], [], []
    for _ in range(repeats):
        began = time.perf_counter()
        greedy_hosts(problem)
        hosts_ms.append((time.perf_counter() - began) * 1e3)
        began, began_cpu = time.perf_counter(), time.thread_time()
        greedy(problem)
        slots_ms.append((time.perf_counter() - began) * 1e3)
        slots_cpu_ms.append((time.thread_time() - began_cpu) * 1e3)
    out = {
        "greedy_48x128x8_ms_median": statistics.median(slots_ms),
        "greedy_48x128x8_ms_p90": float(np.percentile(slots_ms, 90)),
        "greedy_48x128x8_cpu_ms_median": statistics.median(slots_cpu_ms),
        "greedy_hosts_only_ms_median": statistics.median(hosts_ms),
        "place_48x128x8_ms": place_ms,
        "minlp_48x128x4": [],
    }
    problem = problem_for(decode, 4, layers=48, experts=128)
    for parallel, limit in ((1, 0.25), (2, 0.5)):
        began_cpu = time.process_time()
        result = solve_minlp(problem, MinlpOptions(time_limit_s=limit, parallel_layers=parallel))
        cpu = time.process_time() - began_cpu
        found = objective(problem, result.slot_map).total
        out["minlp_48x128x4"].append(
            {
                "parallel_layers": parallel,
                "time_limit_per_layer_s": limit,
                "wall_s": result.wall_seconds,
                "cpu_s": cpu,
                "gap": result.gap,
                "optimal_layers": result.optimal_layers,
                "objective_vs_greedy": found / objective(problem, greedy(problem)).total - 1,
                "objective_vs_place": found / objective(problem, place(problem)).total - 1,
            }
        )
    return out


def layout_stats(problem: PlacementProblem, slot_map: np.ndarray, contiguous: np.ndarray) -> dict:
    """Max/mean GPU load (mean over layers, worst layer), remote share, copies moved from `contiguous`."""
    hosts = hosts_from_slots(slot_map, problem.num_experts)
    loads = gpu_loads(problem, hosts)
    ratio = loads.max(axis=1) / loads.mean(axis=1)
    terms = objective(problem, slot_map)
    return {
        "max_mean": float(ratio.mean()),
        "max_mean_worst_layer": float(ratio.max()),
        "remote_share": float(terms.comm.sum() / problem.load.sum()),
        "copies_moved": int((hosts > hosts_from_slots(contiguous, problem.num_experts)).sum()),
        "objective": terms.total,
    }


def balance(windows: list[Window], configs: list[tuple[int, int]], time_limit: float) -> list[dict]:
    """Every method at equal slots per GPU (E + R slots per layer), fresh and rebalancing from contiguous."""
    rows = []
    options = MinlpOptions(time_limit_s=time_limit, parallel_layers=2)
    for window in windows:
        for gpus, redundant in configs:
            contiguous = problem_for(window, gpus, redundant=redundant).current
            for fresh in (True, False):
                single = problem_for(window, gpus, redundant=redundant, fresh=fresh)
                no_replicas = np.ones(single.load.shape, dtype=np.int64)
                row = {"window": window.name.split(":")[0], "gpus": gpus, "redundant": redundant, "fresh": fresh}
                row["slots_per_gpu"] = single.slots_per_gpu
                row["contiguous"] = layout_stats(single, contiguous, contiguous)
                row["eplb"] = layout_stats(single, eplb_global(single.load, gpus, redundant), contiguous)
                methods = {
                    "greedy": lambda p, r: greedy(p, replicas=r),
                    "place": lambda p, r: place(p, replicas=r),
                    "minlp": lambda p, r: solve_minlp(p, options, replicas=r).slot_map,
                }
                for name, method in methods.items():
                    row[name] = layout_stats(single, method(single, no_replicas), contiguous)
                    if redundant:
                        row[f"{name}+replicas"] = layout_stats(single, method(single, None), contiguous)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def balance_table(rows: list[dict]) -> str:
    """Markdown: max/mean (mean over layers) and copies moved, one line per window and configuration."""
    methods = ["contiguous", "eplb", "greedy", "greedy+replicas", "place", "place+replicas", "minlp", "minlp+replicas"]
    lines = [
        "| window | G | R | start | " + " | ".join(methods) + " |",
        "|" + "---|" * (4 + len(methods)),
    ]
    for row in rows:
        cells = [
            f"{row[m]['max_mean']:.3f} / {row[m]['remote_share']:.3f} / {row[m]['copies_moved']}" if m in row else "—"
            for m in methods
        ]
        start = "fresh" if row["fresh"] else "contiguous"
        lines.append(f"| {row['window']} | {row['gpus']} | {row['redundant']} | {start} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def calibration(windows: list[Window], time_limit: float) -> dict:
    problems = [problem_for(w, 4, layers=48, experts=128) for w in windows]
    result = calibrate(problems, MinlpOptions(time_limit_s=time_limit, parallel_layers=2))
    summary = {
        "params": vars(result.params),
        "online": {"agreement": result.agreement, "comm_gap": result.comm_gap, "objective_gap": result.objective_gap},
        "greedy": result.greedy,
        "methods": result.methods,  # per method, against a reference MINLP not started from it
        "reference_agreement": result.reference_agreement,
        "minlp_gap": result.minlp_gap,
        "minlp_seconds": result.minlp_seconds,
        "fit_seconds": result.fit_seconds,
    }
    for name in ("greedy_unit", "greedy_seed"):
        copies = sum(w[name]["copies"] for w in result.windows)
        comm_minlp = sum(w["minlp"]["comm"] for w in result.windows)
        total_minlp = sum(w["minlp"]["total"] for w in result.windows)
        summary[name] = {
            "agreement": sum(w[name]["matched"] for w in result.windows) / copies,
            "comm_gap": sum(w[name]["comm"] for w in result.windows) / comm_minlp - 1,
            "objective_gap": sum(w[name]["total"] for w in result.windows) / total_minlp - 1,
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", nargs="+", default=["speed", "balance", "calibration"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--time-limit", type=float, default=0.25, help="MINLP seconds per layer (balance, calibration)")
    parser.add_argument("--data", type=Path, default=SGLANG)
    args = parser.parse_args()
    windows = sglang_windows(args.data)
    report: dict = {"machine": _single_core.machine(), "windows": [w.name for w in windows]}
    print(report["machine"], flush=True)
    if "speed" in args.sections:
        report["speed"] = speed(windows, args.repeats)
        print(json.dumps(report["speed"], indent=1), flush=True)
    if "balance" in args.sections:
        report["balance"] = balance(windows, [(8, 0), (8, 8), (32, 0), (32, 32)], args.time_limit)
        print(balance_table(report["balance"]), flush=True)
    if "calibration" in args.sections:
        report["calibration"] = calibration(windows, args.time_limit)
        print(json.dumps(report["calibration"], indent=1), flush=True)
    OUT.mkdir(exist_ok=True)
    path = OUT / "placement.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**previous, **report}, indent=1))  # a partial run keeps the other sections


if __name__ == "__main__":
    main()
