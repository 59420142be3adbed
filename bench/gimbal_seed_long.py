"""Gimbal's moving placement in runs long enough for a second plan: at the knee (400 req/s) and at the seed's RPS 2.

Issue 40's two open questions after the persistence discount, on the grid's fleet and `sim-dp` commands
(`gimbal_seed.command`), with more requests than the grid runs:

- **knee**: at 400 req/s requests queue (the engines' `num_waiting` > 0). The grid's 1.5 s of arrivals end
  before the placement loop has a second window's evidence, so its moving placement never moved there; here
  the arrivals last past the loop's period (30 s), so its second plan falls among them. EP side alone (vLLM's
  dispatch, FCFS) so that only the placement differs: the static layout (`none`), the loop (`gimbal`: its
  migration's cost counted at the requests waiting, `payoff.StepContext.queue_factor`) and the loop without the
  queue factor (`gimbal-queue-blind`, the rule before it: the control).
- **minute-ep**, **minute-full**: the one-minute run at 100 req/s (6,000 requests; the grid runs 600), the EP side
  alone (with staged plans) and full Gimbal, each against its static layout.
- **rps2**: at RPS 2 the grid's moving placement migrates once, about 34 s in, credited for 30 s, and the
  grid's 100 requests end about 50 s in (TPOT +0.8 % against static, every seed). Here 300 requests (~150 s),
  full Gimbal (`gimbal+sjf-aging`) with the layout static and moving: does the move pay over its horizon?
  **rps3**, **rps4**: the same at RPS 3 and 4 (450 and 600 requests, ~150 s).

Each configuration is one `sim-dp` subprocess (`--jobs` at once); JSON per run in `--out`. Without `--run` it
prints the tables from the JSONs. Deterministic (fixed seeds); CPU-bound: the knee runs take minutes each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _single_core  # noqa: F401  (before numpy: one BLAS thread)
import numpy as np
from gimbal_seed import command

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "results" / "gimbal_seed" / "long"
#: name -> (rate, requests, dispatch, order, placements)
EXPERIMENTS: dict[str, tuple[float, int, str, str, tuple[str, ...]]] = {
    "knee": (400.0, 14_000, "vllm", "fcfs", ("none", "gimbal", "gimbal-queue-blind")),
    "rps2": (2.0, 300, "gimbal", "sjf-aging", ("none", "gimbal")),
    "rps3": (3.0, 450, "gimbal", "sjf-aging", ("none", "gimbal")),
    "rps4": (4.0, 600, "gimbal", "sjf-aging", ("none", "gimbal")),
    # the one-minute run at 100 req/s (the grid runs 6 s): the EP side alone and full Gimbal
    "minute-ep": (100.0, 6_000, "vllm", "fcfs", ("none", "gimbal", "gimbal-staged")),
    "minute-full": (100.0, 6_000, "gimbal", "sjf-aging", ("none", "gimbal")),
}


def _path(out: Path, name: str, placement: str, seed: int) -> Path:
    return out / f"{name}_{placement}_s{seed}.json"


def _run_one(out: Path, name: str, placement: str, seed: int) -> Path:
    rate, n, dispatch, order, _ = EXPERIMENTS[name]
    path = _path(out, name, placement, seed)
    args = command(dispatch, order, "", [placement], rate, n, seed)
    subprocess.run([sys.executable, "-m", "switchyard.cli", *args, "--json", str(path)], cwd=ROOT, check=True)
    print(f"  {name} {placement} seed {seed}: {path}", file=sys.stderr, flush=True)
    return path


def _pct(a: float, b: float) -> str:
    return f"{100.0 * (a / b - 1.0):+.1f} %"


def report(out: Path, names: list[str], seeds: list[int]) -> None:
    for name in names:
        rate, n, dispatch, order, placements = EXPERIMENTS[name]
        print(f"\n{name}: {rate:g} req/s, {n} requests, `{dispatch}+{order}+…`\n")
        print(
            "| seed | placement | TTFT mean / p99 (ms) | TPOT mean (ms) | vs static TTFT / TPOT | migrations "
            "(s migrating, slowed s) | deferred plans | predicted / measured saving (s) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for seed in seeds:
            static = None
            for placement in placements:
                path = _path(out, name, placement, seed)
                if not path.exists():
                    continue
                run = json.loads(path.read_text())["runs"][f"{dispatch}+{order}+{placement}"]
                static = run if placement == "none" else static
                versus = (
                    "—"
                    if static is None or static is run
                    else (
                        f"{_pct(run['ttft_mean'], static['ttft_mean'])} / {_pct(run['tpot_mean'], static['tpot_mean'])}"
                    )
                )
                checked = run.get("ep_predicted_gain_checked_s", 0.0)
                measured = f"{run.get('ep_measured_gain_s', 0.0):.2f}" if checked else "—"
                print(
                    f"| {seed} | `{placement}` | {1e3 * run['ttft_mean']:.2f} / {1e3 * run['ttft_p99']:.1f} | "
                    f"{1e3 * run['tpot_mean']:.3f} | {versus} | {run.get('ep_migrations', 0):.0f} "
                    f"({run.get('ep_migration_s', 0.0):.2f}, {run.get('ep_slowed_s', 0.0):.2f}) | "
                    f"{run.get('ep_deferred', 0):.0f} | {run.get('ep_predicted_gain_s', 0.0):.2f} / {measured} |"
                )
        _means(out, name, seeds)


def _means(out: Path, name: str, seeds: list[int]) -> None:
    """Mean over seeds of each moving placement's change against static [smallest, largest]."""
    _, _, dispatch, order, placements = EXPERIMENTS[name]
    for placement in placements[1:]:
        ttft, tpot = [], []
        for seed in seeds:
            paths = [_path(out, name, p, seed) for p in ("none", placement)]
            if not all(p.exists() for p in paths):
                continue
            static, moving = (
                json.loads(p.read_text())["runs"][f"{dispatch}+{order}+{q}"]
                for p, q in zip(paths, ("none", placement), strict=True)
            )
            ttft.append(100.0 * (moving["ttft_mean"] / static["ttft_mean"] - 1.0))
            tpot.append(100.0 * (moving["tpot_mean"] / static["tpot_mean"] - 1.0))
        if ttft:
            spans = [f"{np.mean(v):+.1f} % [{min(v):+.1f}, {max(v):+.1f}]" for v in (ttft, tpot)]
            print(f"\n`{placement}` vs `none`, mean of {len(ttft)} seed(s): TTFT {spans[0]}, TPOT {spans[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--experiments", default="rps2,knee", help="comma-separated: " + ", ".join(EXPERIMENTS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2, help="sim-dp processes at once")
    ap.add_argument("--run", action="store_true", help="run the sim-dp commands first (else: report only)")
    args = ap.parse_args()
    names = args.experiments.split(",")
    unknown = sorted(set(names) - set(EXPERIMENTS))
    if unknown:
        ap.error(f"unknown experiment(s) {', '.join(unknown)}; choose from {', '.join(EXPERIMENTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.run:
        args.out.mkdir(parents=True, exist_ok=True)
        todo = [(name, p, seed) for name in names for seed in seeds for p in EXPERIMENTS[name][4]]
        with ThreadPoolExecutor(max(args.jobs, 1)) as pool:
            list(pool.map(lambda job: _run_one(args.out, *job), todo))
    report(args.out, names, seeds)


if __name__ == "__main__":
    main()
