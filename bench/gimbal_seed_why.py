"""Why full Gimbal loses at 100 and 400 req/s in the seed's grid, staged plans, and the static control at every load.

Issue 40's left-overs, beside `bench/gimbal_seed.py` (same fleet, workload and `sim-dp` commands; its runs are
deterministic, so a row here with the same configuration equals the grid's row in `runs.csv`):

- **decomposition**: at 100 and 400 req/s each part of full Gimbal alone against vLLM (`vllm+fcfs+none`: vLLM's
  dispatch and order, the static layout): Gimbal's dispatch (`gimbal+…+none`), SJF with aging (`vllm+sjf-aging
  +none`), the moving placement (`…+gimbal`), and Gimbal's dispatch on the exact ledger (`gimbal-exact`,
  docs/gimbal-exact-ledger.md: the fix for the in-flight compensation that follows telemetry phases);
- **staged plans** (`gimbal-staged`: at most `STAGED_BYTES` received per GPU per plan, hottest experts first)
  against the full plan, same loads;
- **the static control at the seed's loads and at 400 req/s** (the grid runs `none` at 100 req/s only);
- **full Gimbal on the exact ledger at the seed's loads** (`gimbal-exact+sjf-aging+gimbal`, with its static layout).

Each (dispatch, order) is one `sim-dp` call with its placements; every row goes to `--out` (CSV, appended as
runs finish, so a partial run is usable). Seeds run in order (all of seed 0 first).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import _single_core  # noqa: F401  (before numpy: one BLAS thread)
from gimbal_seed import EP_EXTRA, EXTRA, METRICS, REQUESTS_AT, command, run_group

ROOT = Path(__file__).resolve().parent.parent
#: rate -> [(dispatch, order, placements)]
PLAN: dict[float, list[tuple[str, str, tuple[str, ...]]]] = {
    400.0: [
        ("vllm", "fcfs", ("none", "gimbal", "gimbal-staged")),
        ("gimbal", "sjf-aging", ("none", "gimbal", "gimbal-staged")),
        ("gimbal-exact", "sjf-aging", ("none", "gimbal")),
        ("vllm", "sjf-aging", ("none",)),
    ],
    100.0: [
        ("vllm", "fcfs", ("gimbal-staged",)),
        ("gimbal", "sjf-aging", ("none", "gimbal-staged")),
        ("gimbal-exact", "sjf-aging", ("none", "gimbal")),
    ],
    2.0: [
        ("vllm", "fcfs", ("none", "gimbal")),
        ("gimbal", "sjf-aging", ("none",)),
        ("gimbal-exact", "sjf-aging", ("none", "gimbal")),
    ],
    3.0: [
        ("vllm", "fcfs", ("none", "gimbal")),
        ("gimbal", "sjf-aging", ("none",)),
        ("gimbal-exact", "sjf-aging", ("none", "gimbal")),
    ],
    4.0: [
        ("vllm", "fcfs", ("none", "gimbal")),
        ("gimbal", "sjf-aging", ("none",)),
        ("gimbal-exact", "sjf-aging", ("none", "gimbal")),
    ],
}
FIELDS = ("key", "dispatch", "order", "placement", "rate", "seed", "requests", *METRICS, *EXTRA, *EP_EXTRA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "gimbal_seed" / "why.csv")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rates", default="400,100,2,3,4")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    new = not args.out.exists()
    with args.out.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        for seed in (int(s) for s in args.seeds.split(",")):
            for rate in rates:
                for dispatch, order, placements in PLAN[rate]:
                    members = [(p, p) for p in placements]
                    task = {"dispatch": dispatch, "order": order, "weights": "", "members": members}
                    task.update(rate=rate, seed=seed)
                    task["args"] = command(dispatch, order, "", list(placements), rate, REQUESTS_AT[rate], seed)
                    for row in run_group(task):
                        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
                    f.flush()
    print(f"rows appended to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
