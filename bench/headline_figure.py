"""The README's headline figure, drawn from the committed results (nothing is simulated here).

Three panels, each a change against the strongest baseline of its experiment, with the control that erases it
where the experiment ran one:
1. ELDR (docs/results/eldr/results.json, `switchyard report`): median TPOT of `eldr` vs the best of the load
   balancers (random, rr, jsq, p2c) per request rate, 8P16D, ESFT routing; `domain` (the true task labels) beside.
2. Prefix routing (docs/results/prefix/runs.json, `bench/prefix_routing.py`): mean TTFT of `switchyard` vs the best
   peer (vllm, llm-d, dynamo, sglang-cache) on the Mooncake window, DP2, mean of 3 seeds; the shuffled-prefix
   control beside.
3. Gimbal dispatch (docs/results/gimbal/exact_runs.csv, `bench/gimbal_exact.py`): mean TTFT of `gimbal-exact` vs
   vLLM's rule on both Azure traces per load, mean of 3 seeds.

Usage: python bench/headline_figure.py [--out docs/results/headline.png]
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
PEERS = ("vllm", "llm-d", "dynamo", "sglang-cache")


def _pct(value: float, base: float) -> float:
    return 100.0 * (value / base - 1.0)


def eldr_rows() -> tuple[list[float], list[float], list[float]]:
    rows = json.loads((RESULTS / "eldr" / "results.json").read_text())["fig11"]
    return (
        [r["rate"] for r in rows],
        [r["eldr_vs_best_p50_pct"] for r in rows],
        [r["domain_vs_best_p50_pct"] for r in rows],
    )


def prefix_rows() -> tuple[list[float], list[float], list[float]]:
    ttft: dict[tuple[str, str, float, str], list[float]] = defaultdict(list)
    for r in json.loads((RESULTS / "prefix" / "runs.json").read_text()):
        if r["trace"] == "mooncake":
            ttft[(r["section"], r["variant"], r["time_scale"], r["profile"])].append(r["ttft_mean"])
    mean = {k: float(np.mean(v)) for k, v in ttft.items()}
    scales = sorted({k[2] for k in mean if k[0] == "main"})
    best = {s: min(mean[("main", "", s, p)] for p in PEERS) for s in scales}
    ours = [_pct(mean[("main", "", s, "switchyard")], best[s]) for s in scales]
    shuffled = [_pct(mean[("controls", "shuffled", s, "switchyard")], best[s]) for s in scales]
    return scales, ours, shuffled


def gimbal_rows() -> dict[str, tuple[list[float], list[float]]]:
    ttft: dict[tuple[str, float, str], list[float]] = defaultdict(list)
    with (RESULTS / "gimbal" / "exact_runs.csv").open() as f:
        for r in csv.DictReader(f):
            if r["section"] == "exact" and r["variant"] == "baseline":
                ttft[(r["trace"], float(r["time_scale"]), r["combo"])].append(float(r["ttft_mean"]))
    out = {}
    for trace in ("code", "conv"):
        scales = sorted({s for t, s, _ in ttft if t == trace})
        change = [
            _pct(np.mean(ttft[(trace, s, "gimbal-exact+fcfs")]), np.mean(ttft[(trace, s, "vllm+fcfs")])) for s in scales
        ]
        out[trace] = (scales, change)
    return out


def draw(out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.9))
    rates, eldr, domain = eldr_rows()
    ax = axes[0]
    ax.plot(rates, eldr, "o-", lw=2.5, label="eldr")
    ax.plot(rates, domain, "s--", lw=1, label="domain (true task labels)")
    ax.set(
        xscale="log",
        xlabel="request rate (req/s)",
        ylabel="change vs best baseline (%)",
        title="ELDR: median TPOT vs best load balancer",
    )
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())

    scales, ours, shuffled = prefix_rows()
    ax = axes[1]
    x = np.arange(len(scales))
    top = 40.0  # the control's bars run to several hundred percent: clipped, their values written on them
    ax.bar(x - 0.2, ours, 0.4, label="switchyard")
    ax.bar(x + 0.2, np.minimum(shuffled, top), 0.4, label="control: prefixes shuffled")
    for xi, (a, b) in enumerate(zip(ours, shuffled, strict=True)):
        ax.annotate(f"{a:+.0f}%", (xi - 0.2, a), ha="center", va="bottom" if a >= 0 else "top", fontsize=7)
        ax.annotate(f"{b:+.0f}%", (xi + 0.2, min(b, top)), ha="center", va="top", fontsize=7, color="white")
    ax.set_ylim(-25, top + 5)
    ax.set_xticks(x, [f"÷{s:g}" for s in scales])
    ax.set(xlabel="Mooncake arrivals (time divided by)", title="Prefix routing: mean TTFT vs best peer")

    ax = axes[2]
    for trace, (loads, change) in gimbal_rows().items():
        ax.plot(loads, change, "o-", label=f"gimbal-exact, Azure {trace}")
    ax.set(xlabel="Azure arrivals (time divided by)", title="Gimbal dispatch: mean TTFT vs vLLM's rule")
    for ax in axes:
        ax.axhline(0.0, color="k", lw=0.6)
        ax.legend(fontsize=7)
    fig.suptitle(
        "Below zero is better than the strongest baseline (simulated engines, real traces; docs/results)", fontsize=9
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "headline.png")
    draw(parser.parse_args().out)


if __name__ == "__main__":
    main()
