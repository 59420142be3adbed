"""The Gimbal seed's experiments beside the seed's numbers, read from the committed runs of
`bench/gimbal_seed.py` (docs/results/gimbal_seed/runs.csv): full Gimbal vs vLLM at rising load, the ablation
and calibrated vs uncalibrated greedy placement. No simulation runs here: the bench runs them (≤ 15 CPU
minutes), this module only compares, so `switchyard report` and the bench's own report print the same rows.

Every change is of the mean over seeds against the reference's mean, with the smallest and largest per-seed
change (seeds paired) in brackets; losses are printed as they come (a positive Δ on a latency is a loss).
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_RESULTS",
    "SEED_GIMBAL",
    "VARIANTS",
    "build",
    "compare",
    "markdown",
    "read_runs",
]

#: Where the bench writes its runs in a source checkout (not shipped in a wheel: pass the folder then).
DEFAULT_RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results" / "gimbal_seed"

#: The seed's numbers (Gimbal, arXiv:2606.15177, as cited in the README; the summary names no table or figure, so each
#: is cited by the summary's section). Setting: Qwen3-30B-A3B, 4 x H100 SXM5 (NVLink), DP=2 TP=2 EP=4, BurstGPT
#: reshaped into five length distributions, RPS 2-4, against vLLM.
SEED_GIMBAL: dict[str, Any] = {
    "ttft_mean": -42.9,  # Overview / Conclusion: average TTFT vs vLLM
    "tpot_mean": -33.3,  # same: average TPOT vs vLLM
    "throughput": 3.0,  # same: "improving high-load throughput by 3.0 %"
    "ttft_by_rps": {2.0: -33.1, 4.0: -48.3},  # Key Results: TTFT reduction grows from 33.1 % (RPS 2) to 48.3 % (RPS 4)
    "coordination_ttft": -16.5,  # Ablation Study: coordinated vs independent DP-side + EP-side
    "coordination_tpot": -6.5,
    "calibration_ttft": -10.8,  # MINLP Calibration Impact: calibrated vs uncalibrated greedy
    "calibration_tpot": -9.2,
}

#: The configurations: label -> (dispatch, order, placement, dispatch scorer weights).
VARIANTS: dict[str, tuple[str, str, str, str]] = {
    "vllm": ("vllm", "fcfs", "eplb", ""),  # the seed's baseline: vLLM's DP rule, FCFS, load-only EPLB
    "gimbal": ("gimbal", "sjf-aging", "gimbal", ""),  # full Gimbal = the coordinated design
    "dp-only": ("gimbal", "sjf-aging", "eplb", ""),  # Algorithm 1 + 2, vLLM's placement
    "ep-only": ("vllm", "fcfs", "gimbal", ""),  # vLLM's dispatch and order, Gimbal's placement
    "uncoordinated": ("gimbal", "sjf-aging", "gimbal", "moe_penalty=0"),  # both sides, no MoE pressure fed back
    "gimbal-uncalibrated": ("gimbal", "sjf-aging", "gimbal-uncalibrated", ""),  # greedy without the MINLP weights
    "vllm-static": ("vllm", "fcfs", "none", ""),  # control: vLLM with no rebalancing at all
}

METRICS = ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99", "throughput")
TEXT = {"variant", "key", "dispatch", "order", "placement", "dp_weights", "section"}


def read_runs(path: Path) -> list[dict[str, Any]]:
    """`runs.csv` of the bench: one row per (variant, rate, seed); numbers as floats, `seed` as int."""
    rows = []
    with Path(path).open(newline="") as f:
        for r in csv.DictReader(f):
            row: dict[str, Any] = {k: (v if k in TEXT else float(v) if v else None) for k, v in r.items()}
            row["seed"] = int(row["seed"])
            rows.append(row)
    return rows


def _by(rows: list[dict[str, Any]]) -> dict[float, dict[str, list[dict[str, Any]]]]:
    """rate -> variant -> rows (one per seed)."""
    g: dict[float, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        g[float(r["rate"])][r["variant"]].append(r)
    return g


def _delta(rows: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """Δ % of the seed-mean and the smallest and largest per-seed Δ % (seeds paired); None if not comparable."""
    paired = {r["seed"]: r[key] for r in base if r.get(key)}
    per = [100.0 * (r[key] / paired[r["seed"]] - 1.0) for r in rows if r.get(key) is not None and r["seed"] in paired]
    if not per:
        return None
    mine = statistics.fmean(r[key] for r in rows if r["seed"] in paired)
    ref = statistics.fmean(paired[r["seed"]] for r in rows if r["seed"] in paired)
    return {"mean": 100.0 * (mine / ref - 1.0), "min": min(per), "max": max(per), "seeds": len(per)}


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The three experiments' changes: `headline` (Gimbal vs vLLM per rate), `ablation` (each variant vs vLLM,
    and coordinated vs uncoordinated), `calibration` (calibrated vs uncalibrated greedy)."""
    g = _by(rows)
    out: dict[str, Any] = {"headline": [], "ablation": [], "calibration": []}
    for rate in sorted(g):
        v = g[rate]
        if "vllm" in v and "gimbal" in v:
            row = {"rate": rate, "vllm": {m: statistics.fmean(r[m] for r in v["vllm"]) for m in METRICS}}
            row["gimbal"] = {m: statistics.fmean(r[m] for r in v["gimbal"]) for m in METRICS}
            row["delta"] = {m: _delta(v["gimbal"], v["vllm"], m) for m in METRICS}
            row["offered_rate"] = statistics.fmean(r["offered_rate"] for r in v["vllm"])
            row["mean_running"] = statistics.fmean(r["mean_running"] for r in v["vllm"])
            out["headline"].append(row)
        if "vllm" in v:
            for name in ("dp-only", "ep-only", "uncoordinated", "gimbal", "vllm-static"):
                if name in v and len(v) > 2:  # the headline pair alone is the headline table
                    d = {m: _delta(v[name], v["vllm"], m) for m in METRICS}
                    out["ablation"].append({"rate": rate, "variant": name, "delta": d})
        if "gimbal" in v and "uncoordinated" in v:
            d = {m: _delta(v["gimbal"], v["uncoordinated"], m) for m in METRICS}
            out["ablation"].append({"rate": rate, "variant": "coordinated vs uncoordinated", "delta": d})
        if "gimbal" in v and "gimbal-uncalibrated" in v:
            d = {m: _delta(v["gimbal"], v["gimbal-uncalibrated"], m) for m in METRICS}
            out["calibration"].append({"rate": rate, "delta": d})
    seed_rates = [h for h in out["headline"] if h["rate"] <= 4.0]
    if seed_rates:
        out["seed_rate_mean"] = {
            m: statistics.fmean(h["delta"][m]["mean"] for h in seed_rates if h["delta"][m]) for m in METRICS
        }
    return out


def _d(d: dict[str, float] | None) -> str:
    return "n/a" if d is None else f"{d['mean']:+.1f} % [{d['min']:+.1f}, {d['max']:+.1f}]"


def markdown(cmp: dict[str, Any], source: str) -> list[str]:
    """The section's Markdown from `compare`'s output; `source`: where the runs came from."""
    s = SEED_GIMBAL
    md = [
        "## Gimbal seed — full Gimbal vs vLLM, ablation, calibration",
        "",
        f"Seed: {s['ttft_mean']:+.1f} % mean TTFT and {s['tpot_mean']:+.1f} % mean TPOT vs vLLM, "
        f"{s['throughput']:+.1f} % throughput at high load (Qwen3-30B-A3B, 4 x H100, DP2 TP2 EP4, BurstGPT, "
        "RPS 2-4); TTFT −33.1 % at RPS 2 growing to −48.3 % at RPS 4; coordination "
        f"{s['coordination_ttft']:+.1f} % TTFT / {s['coordination_tpot']:+.1f} % TPOT over both sides "
        f"uncoordinated; calibrated greedy {s['calibration_ttft']:+.1f} % TTFT / {s['calibration_tpot']:+.1f} % "
        "TPOT vs uncalibrated.",
        "",
        f"Ours: `{source}` (bench/gimbal_seed.py; the model, the routing it borrows and what that changes: "
        "docs/gimbal-seed.md). Δ = change of the mean over seeds [smallest, largest per-seed change]; on a "
        "latency a + is a loss.",
        "",
    ]
    if not cmp["headline"]:
        return [*md, "No runs found: run `bench/gimbal_seed.py` first.", ""]
    md += [
        "### Full Gimbal vs vLLM",
        "",
        "| RPS | running/engine (vLLM) | vLLM TTFT / TPOT (ms) | Gimbal TTFT / TPOT (ms) | Δ TTFT mean | seed Δ TTFT "
        "| Δ TPOT mean | seed Δ TPOT | Δ TTFT p99 | Δ throughput | seed Δ tput |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for h in cmp["headline"]:
        seed_ttft = s["ttft_by_rps"].get(h["rate"])
        in_seed = h["rate"] <= 4.0
        seed_ttft_s = f"{seed_ttft:+.1f} %" if seed_ttft is not None else f"({s['ttft_mean']:+.1f} % avg)"
        seed_ttft_s = seed_ttft_s if in_seed else "—"
        seed_tpot_s = f"({s['tpot_mean']:+.1f} % avg)" if in_seed else "—"
        md.append(
            f"| {h['rate']:g} | {h['mean_running']:.1f} | {h['vllm']['ttft_mean'] * 1e3:.1f} / "
            f"{h['vllm']['tpot_mean'] * 1e3:.2f} | {h['gimbal']['ttft_mean'] * 1e3:.1f} / "
            f"{h['gimbal']['tpot_mean'] * 1e3:.2f} | {_d(h['delta']['ttft_mean'])} | {seed_ttft_s} | "
            f"{_d(h['delta']['tpot_mean'])} | {seed_tpot_s} | {_d(h['delta']['ttft_p99'])} | "
            f"{_d(h['delta']['throughput'])} | {s['throughput']:+.1f} % (high load) |"
        )
    if "seed_rate_mean" in cmp:
        m = cmp["seed_rate_mean"]
        md += [
            "",
            f"Mean over the seed's RPS 2–4: Δ TTFT {m['ttft_mean']:+.1f} % (seed {s['ttft_mean']:+.1f} %), "
            f"Δ TPOT {m['tpot_mean']:+.1f} % (seed {s['tpot_mean']:+.1f} %), Δ throughput {m['throughput']:+.1f} %.",
        ]
    md += ["", "### Ablation (each against vLLM; the last row per rate against both sides uncoordinated)", ""]
    md += ["| RPS | variant | Δ TTFT mean | Δ TTFT p99 | Δ TPOT mean | Δ throughput | seed |"]
    md += ["|---|---|---|---|---|---|---|"]
    for a in cmp["ablation"]:
        seed = (
            f"{s['coordination_ttft']:+.1f} % TTFT, {s['coordination_tpot']:+.1f} % TPOT"
            if a["variant"].startswith("coordinated")
            else "not given"
        )
        d = a["delta"]
        md.append(
            f"| {a['rate']:g} | {a['variant']} | {_d(d['ttft_mean'])} | {_d(d['ttft_p99'])} | {_d(d['tpot_mean'])} "
            f"| {_d(d['throughput'])} | {seed} |"
        )
    md += ["", "### Calibrated vs uncalibrated greedy placement (Gimbal dispatch and order in both)", ""]
    md += ["| RPS | Δ TTFT mean | Δ TTFT p99 | Δ TPOT mean | Δ throughput | seed |", "|---|---|---|---|---|---|"]
    for c in cmp["calibration"]:
        d = c["delta"]
        md.append(
            f"| {c['rate']:g} | {_d(d['ttft_mean'])} | {_d(d['ttft_p99'])} | {_d(d['tpot_mean'])} | "
            f"{_d(d['throughput'])} | {s['calibration_ttft']:+.1f} % TTFT, {s['calibration_tpot']:+.1f} % TPOT |"
        )
    return [*md, ""]


def build(ctx: Any) -> tuple[dict[str, Any], list[str]]:
    """The report section: compare the committed runs (`ctx.opts.gimbal_results`, default `DEFAULT_RESULTS`)."""
    folder = Path(getattr(ctx.opts, "gimbal_results", None) or DEFAULT_RESULTS)
    path = folder / "runs.csv"
    ctx.log(f"Gimbal seed: reading {path}")
    if not path.exists():
        md = markdown({"headline": []}, str(path))[:-2]
        return {"runs": 0}, [*md, f"No runs at `{path}`: run `bench/gimbal_seed.py` (or pass its `--out` folder).", ""]
    cmp = compare(read_runs(path))
    try:
        shown = path.relative_to(DEFAULT_RESULTS.parents[2])
    except ValueError:
        shown = path
    return cmp, markdown(cmp, str(shown))
