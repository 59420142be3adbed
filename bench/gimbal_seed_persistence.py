"""Gimbal's moving placement against its static layout under the persistence-discounted step-time rule.

Issue 40: at RPS 2 the placement loop's first plans were predicted to save 0.40-0.46 s and saved 0.04-0.09 s (one
or two requests' expert load does not persist into the next requests). The rule now counts the window's skew
at its measured persistence (`solver.placement.window.DecayedLoad.persistence`). This reruns only the rows that
answer whether that fixed it: full Gimbal's placement (`gimbal+sjf-aging+gimbal`) against the same dispatch and
order with the layout static (`gimbal+sjf-aging+none`), at the grid's RPS 2, 3, 4, 100 and 400 with the grid's
request counts, three seeds; each (rate, seed) is the grid's `sim-dp` command (`gimbal_seed.command`), its JSON kept in
`--out`. Without `--run` it prints the table from the JSONs, beside the same rows of the grid as the rule
before left it (`step_time_rule/runs.csv`, `why.csv`; the grid itself has been rerun since), and says whether
the static rows came out identical (they must: the rule does not touch a layout that never moves).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

import _single_core  # noqa: F401  (before numpy: one BLAS thread)
import numpy as np
from gimbal_seed import REQUESTS_AT, command

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "gimbal_seed"
#: The grid as the step-time rule before the persistence discount left it (`runs.csv`, `why.csv` there).
BEFORE = RESULTS / "step_time_rule"
STATIC, MOVING, VLLM = "gimbal+sjf-aging+none", "gimbal+sjf-aging+gimbal", "vllm+fcfs+eplb"


def _run(out: Path, rates: list[float], seeds: list[int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for rate in rates:
        for seed in seeds:
            args = command("gimbal", "sjf-aging", "", ["none", "gimbal"], rate, REQUESTS_AT[rate], seed)
            path = out / f"r{rate:g}_s{seed}.json"
            subprocess.run([sys.executable, "-m", "switchyard.cli", *args, "--json", str(path)], cwd=ROOT, check=True)
            print(f"  rate {rate:g} seed {seed}: {path}", file=sys.stderr, flush=True)


def _old_rows() -> dict[tuple[str, float, int], dict[str, str]]:
    rows = {}
    for name in ("runs.csv", "why.csv"):
        for r in csv.DictReader((BEFORE / name).open()):
            if not r.get("dp_weights"):
                rows[(r["key"], float(r["rate"]), int(r["seed"]))] = r
    return rows


def _pct(a: float, b: float) -> float:
    return 100.0 * (a / b - 1.0)


def _span(values: list[float]) -> str:
    return f"{np.mean(values):+.1f} % [{min(values):+.1f}, {max(values):+.1f}]"


def report(out: Path, rates: list[float], seeds: list[int]) -> None:
    old = _old_rows()
    print(
        "| RPS | moving vs static now: TTFT / TPOT | before (grid) | full Gimbal vs vLLM now: TTFT / TPOT "
        "| before (grid) | migrations now (before) | predicted / measured s, by seed |"
    )
    print("|---|---|---|---|---|---|---|")
    for rate in rates:
        now_t, now_p, old_t, old_p, migr, old_migr, pred, meas = [], [], [], [], [], [], [], []
        vs_t, vs_p, old_vs_t, old_vs_p = [], [], [], []
        for seed in seeds:
            path = out / f"r{rate:g}_s{seed}.json"
            if not path.exists():
                continue
            runs = json.loads(path.read_text())["runs"]
            static, moving = runs[STATIC], runs[MOVING]
            o_static, o_moving = old[(STATIC, rate, seed)], old[(MOVING, rate, seed)]
            if abs(float(o_static["ttft_mean"]) / static["ttft_mean"] - 1) > 1e-5:
                print(f"WARNING: rate {rate:g} seed {seed}: the static row differs from the grid's", file=sys.stderr)
            now_t.append(_pct(moving["ttft_mean"], static["ttft_mean"]))
            now_p.append(_pct(moving["tpot_mean"], static["tpot_mean"]))
            old_t.append(_pct(float(o_moving["ttft_mean"]), float(o_static["ttft_mean"])))
            old_p.append(_pct(float(o_moving["tpot_mean"]), float(o_static["tpot_mean"])))
            vllm = old[(VLLM, rate, seed)]  # EPLB has no payoff rule: the grid's vLLM rows stand
            vs_t.append(_pct(moving["ttft_mean"], float(vllm["ttft_mean"])))
            vs_p.append(_pct(moving["tpot_mean"], float(vllm["tpot_mean"])))
            old_vs_t.append(_pct(float(o_moving["ttft_mean"]), float(vllm["ttft_mean"])))
            old_vs_p.append(_pct(float(o_moving["tpot_mean"]), float(vllm["tpot_mean"])))
            migr.append(moving["ep_migrations"])
            old_migr.append(float(o_moving["ep_migrations"]))
            pred.append(f"{moving.get('ep_predicted_gain_s', 0.0):.2f}")
            checked = moving.get("ep_predicted_gain_checked_s", 0.0)
            meas.append(f"{moving.get('ep_measured_gain_s', 0.0):.2f}" if checked else "—")
        if now_t:
            checks = ", ".join(f"{p}/{m}" for p, m in zip(pred, meas, strict=True))
            print(
                f"| {rate:g} | {_span(now_t)} / {_span(now_p)} | {_span(old_t)} / {_span(old_p)} | "
                f"{_span(vs_t)} / {_span(vs_p)} | {_span(old_vs_t)} / {_span(old_vs_p)} | "
                f"{np.mean(migr):.1f} ({np.mean(old_migr):.1f}) | {checks} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "persistence")
    ap.add_argument("--rates", default="2,3,4,100,400")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--run", action="store_true", help="run the sim-dp commands first (else: report only)")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.run:
        _run(args.out, rates, seeds)
    report(args.out, rates, seeds)


if __name__ == "__main__":
    main()
