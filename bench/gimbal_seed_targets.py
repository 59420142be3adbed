"""Issue 40's targets, read from the committed grid: each moving placement against its static layout, and full
Gimbal (Algorithm 1, and on the exact ledger) against vLLM, at every load.

Reads `docs/results/gimbal_seed/runs.csv` (`bench/gimbal_seed.py`) and `why.csv` (`bench/gimbal_seed_why.py`):
the runs are deterministic, so a configuration both ran is the same row in both. Prints markdown tables for
`docs/gimbal-seed.md`: mean of the seeds' changes [smallest, largest]; + is a loss. Runs nothing.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "gimbal_seed"
VLLM = "vllm+fcfs+eplb"
VLLM_STATIC = "vllm+fcfs+none"
#: (label, moving key, static key)
MOVING = (
    ("Gimbal's placement in full Gimbal", "gimbal+sjf-aging+gimbal", "gimbal+sjf-aging+none"),
    ("EP side (vLLM dispatch + FCFS)", "vllm+fcfs+gimbal", "vllm+fcfs+none"),
    ("full Gimbal on the exact ledger", "gimbal-exact+sjf-aging+gimbal", "gimbal-exact+sjf-aging+none"),
    ("vLLM's EPLB", "vllm+fcfs+eplb", "vllm+fcfs+none"),
)
#: (label, key) against vLLM
VERSUS = (
    ("full Gimbal (Algorithm 1)", "gimbal+sjf-aging+gimbal"),
    ("full Gimbal on the exact ledger", "gimbal-exact+sjf-aging+gimbal"),
    ("vLLM, static layout", "vllm+fcfs+none"),
)


def rows(results: Path) -> dict[tuple[str, float, int], dict[str, str]]:
    """(key, rate, seed) -> row, from both files (the ablation's P_moe-off rows left out)."""
    out: dict[tuple[str, float, int], dict[str, str]] = {}
    for name in ("runs.csv", "why.csv"):
        path = results / name
        if not path.exists():
            continue
        for r in csv.DictReader(path.open()):
            if not r.get("dp_weights"):
                out[(r["key"], float(r["rate"]), int(r["seed"]))] = r
    return out


def change(table: dict, key: str, base: str, rate: float, metric: str) -> str:
    values = [
        100.0 * (float(table[(key, rate, s)][metric]) / float(table[(base, rate, s)][metric]) - 1.0)
        for s in range(3)
        if (key, rate, s) in table and (base, rate, s) in table
    ]
    if not values:
        return "—"
    return f"{np.mean(values):+.1f} % [{min(values):+.1f}, {max(values):+.1f}]"


def migrations(table: dict, key: str, rate: float) -> str:
    values = [float(table[(key, rate, s)].get("ep_migrations") or 0) for s in range(3) if (key, rate, s) in table]
    return f"{np.mean(values):.1f}" if values else "—"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS)
    table = rows(ap.parse_args().results)
    rates = sorted({rate for _, rate, _ in table})
    print("**Moving against static** (same dispatch and order), TTFT / TPOT, migrations per run:\n")
    print("| RPS | " + " | ".join(f"{label}: `{key}` vs `…+none`" for label, key, _ in MOVING) + " |")
    print("|---|" + "---|" * len(MOVING))
    for rate in rates:
        cells = [
            f"{change(table, k, b, rate, 'ttft_mean')} / {change(table, k, b, rate, 'tpot_mean')} "
            f"({migrations(table, k, rate)})"
            for _, k, b in MOVING
        ]
        print(f"| {rate:g} | " + " | ".join(cells) + " |")
    for base, what in ((VLLM, "vLLM"), (VLLM_STATIC, "vLLM with its layout static")):
        print(f"\n**Against {what}** (`{base}`), TTFT / TPOT:\n")
        versus = [(label, key) for label, key in VERSUS if key != base]
        print("| RPS | " + " | ".join(f"{label} (`{key}`)" for label, key in versus) + " |")
        print("|---|" + "---|" * len(versus))
        for rate in rates:
            cells = [
                f"{change(table, k, base, rate, 'ttft_mean')} / {change(table, k, base, rate, 'tpot_mean')}"
                for _, k in versus
            ]
            print(f"| {rate:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
