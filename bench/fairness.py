"""Fairness in expert load (issue 42 item 2, docs/gateway.md "Fairness in expert load"): two tenants of equal tokens
and different expert footprints on a saturated simulated DP fleet, behind the gateway's admission queue
(`simulator/offline/fairness.py`, the policy of `solver/fairness.py`), under FCFS, token fairness and expert-load
fairness, with the control: tenant labels shuffled over requests (expert-load's advantage must vanish), and
token fairness with shuffled labels beside it.

Prints a Markdown table (mean over seeds, min..max for throughput) and writes `--json` and `--png`. Every
consumer of randomness draws from its own stream of `--seeds` (`shared/streams.py`). About 2 s per run on one core;
run it with `nice`.

    .venv/bin/python bench/fairness.py --seeds 0 1 2 --rates 30 60 \\
        --json docs/results/fairness/fairness.json --png docs/results/fairness/fairness.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _single_core  # before numpy: one BLAS thread; and the machine line
import matplotlib
import numpy as np

from switchyard.simulator.offline.fairness import TENANTS, FairnessConfig, simulate_fairness

matplotlib.use("Agg")
import matplotlib.pyplot as plt

#: (label, policy, labels shuffled): the rows of the table, in order.
ROWS = (
    ("FCFS", "fcfs", False),
    ("token fairness", "tokens", False),
    ("expert-load fairness", "expert-load", False),
    ("token fairness, labels shuffled", "tokens", True),
    ("expert-load fairness, labels shuffled (control)", "expert-load", True),
)


def run(rates: list[float], seeds: list[int], requests: int) -> list[dict[str, object]]:
    out = []
    for rate in rates:
        for label, policy, shuffled in ROWS:
            for seed in seeds:
                config = FairnessConfig(policy=policy, shuffle_labels=shuffled, rate=rate, requests=requests, seed=seed)
                started = time.perf_counter()
                row = simulate_fairness(config).row()
                row.update(label=label, rate=rate, wall_s=time.perf_counter() - started)
                out.append(row)
                print(f"rate {rate:g} {label} seed {seed}: {row['wall_s']:.1f} s", file=sys.stderr)
    return out


def _mean(rows: list[dict[str, object]], key: str) -> float:
    return float(np.mean([float(r[key]) for r in rows]))  # type: ignore[arg-type]


def table(rows: list[dict[str, object]], rate: float) -> str:
    head = (
        "| policy | narrow TTFT P50 / P90 (s) | wide TTFT P50 / P90 (s) | narrow TPOT P50 (ms) | wide TPOT P50 (ms) "
        "| fleet throughput (tok/s, min..max) | distinct experts / layer / step |\n|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for label, _policy, _shuffled in ROWS:
        mine = [r for r in rows if r["label"] == label and r["rate"] == rate]
        tput = [float(r["throughput_tok_s"]) for r in mine]  # type: ignore[arg-type]
        cells = [label]
        for t in TENANTS:
            cells.append(f"{_mean(mine, f'{t}_ttft_p50_s'):.2f} / {_mean(mine, f'{t}_ttft_p90_s'):.2f}")
        cells += [f"{1e3 * _mean(mine, f'{t}_tpot_p50_s'):.2f}" for t in TENANTS]
        cells.append(f"{np.mean(tput):,.0f} ({min(tput):,.0f}..{max(tput):,.0f})")
        cells.append(f"{_mean(mine, 'mean_distinct'):.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _means(rows: list[dict[str, object]], rate: float, key: str) -> list[float]:
    return [_mean([r for r in rows if r["label"] == label and r["rate"] == rate], key) for label, *_ in ROWS]


def _runs(rows: list[dict[str, object]], rate: float, key: str) -> list[list[float]]:
    """Per row of the table, `key` of each seed's run at `rate`."""
    return [[float(r[key]) for r in rows if r["label"] == label and r["rate"] == rate] for label, *_ in ROWS]  # type: ignore[arg-type]


def plot(rows: list[dict[str, object]], rates: list[float], path: Path) -> None:
    """Per rate: TTFT P50 per tenant and the fleet's throughput, per policy (mean over seeds; min..max bars)."""
    fig, axes = plt.subplots(len(rates), 2, figsize=(9, 2.6 * len(rates)), squeeze=False)
    short = ("FCFS", "tokens", "expert-load", "tokens\nshuffled", "expert-load\nshuffled")
    x = np.arange(len(ROWS))
    for i, rate in enumerate(rates):
        ax_t, ax_p = axes[i]
        for j, (t, color) in enumerate(zip(TENANTS, ("tab:green", "tab:purple"), strict=True)):
            ys = [float(np.mean(v)) for v in _runs(rows, rate, f"{t}_ttft_p50_s")]
            ax_t.bar(x + (j - 0.5) * 0.38, ys, 0.38, label=f"tenant {t}", color=color)
        ax_t.set_ylabel("TTFT P50 (s)")
        ax_t.set_title(f"{rate:g} req/s per tenant: TTFT P50, queue wait included", fontsize=9)
        runs = _runs(rows, rate, "throughput_tok_s")
        ys = [float(np.mean(v)) for v in runs]
        err = np.array(
            [[y - min(v) for y, v in zip(ys, runs, strict=True)], [max(v) - y for y, v in zip(ys, runs, strict=True)]]
        )
        ax_p.bar(x, ys, 0.6, color="tab:gray", yerr=err, capsize=3)
        ax_p.set_ylim(min(ys) * 0.95, max(ys) * 1.03)
        ax_p.set_ylabel("fleet output tok/s")
        ax_p.set_title("fleet throughput (axis cut; bars: min..max over seeds)", fontsize=9)
        for ax in (ax_t, ax_p):
            ax.set_xticks(x, short, fontsize=7)
        if i == 0:
            ax_t.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rates", type=float, nargs="+", default=[30.0, 60.0], help="requests/s per tenant")
    parser.add_argument("--requests", type=int, default=600, help="per tenant")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    rows = run(args.rates, args.seeds, args.requests)
    print(f"machine: {_single_core.machine()}; simulated time, so the figures do not depend on it")
    for rate in args.rates:
        print(f"\n{rate:g} req/s per tenant, {args.requests} requests per tenant, seeds {args.seeds}\n")
        print(table(rows, rate))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"seeds": args.seeds, "rates": args.rates, "rows": rows}, indent=1) + "\n")
    if args.png is not None:
        plot(rows, args.rates, args.png)


if __name__ == "__main__":
    main()
