"""Gimbal's DP dispatch and SJF-with-aging ordering against vLLM's defaults, on the DP fleet simulator.

Workloads: the real Azure LLM inference traces of 2023 (code: 8,819 requests, mean prompt 2,048 / output 28;
conv: 19,366 requests, 1,155 / 211), every request of the trace, arrival times divided by a compression
factor (`time_scale`) to set the load. Expert selections: the real ESFT routing trace (DeepSeek-V2-Lite).
Fleet: the seed's deployment shape, DP=2 engines x TP=2 on H100, experts parallel over all 4 GPUs (vLLM
DP+EP, lock-step). Each (trace, load) runs under three seeds (routing draws and telemetry phases).

Sections:
- `main`: load sweep per trace; vLLM+FCFS (baseline), Gimbal dispatch, Gimbal ordering, both, plus RR, JSQ
  and vLLM main's rule with FCFS for reference.
- `sensitivity`: one load per trace at the baseline's knee, changing one thing at a time: independent
  engines, DP=4, telemetry every 10 ms, and a KV cache the size the seed's Qwen3-30B-A3B would leave.

Writes `runs.csv` (one row per run), `results.json` (how it was run), `report.md` and PNGs into `--out`
(default docs/results/gimbal). Run: `.venv/bin/python bench/gimbal_dp.py [--jobs 2] [--quick]`;
`--sections sensitivity` reruns one section and keeps the other's rows; `--report-only` rebuilds the report
and figures from the files.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import _single_core  # before numpy: one BLAS thread; and the machine line

from switchyard.data import SHIPPED_DIR
from switchyard.simulator.core.dp_engine import DPCost
from switchyard.simulator.core.physics import cost_model
from switchyard.simulator.offline.dp_run import DPSimOptions, run_sim_dp
from switchyard.simulator.offline.scenario import Scenario, prepare

ROOT = Path(__file__).resolve().parent.parent
ESFT = SHIPPED_DIR / "routing" / "esft_deepseek_v2_lite"
AZURE = SHIPPED_DIR / "requests" / "azure_llm_2023"
TRACE_SIZE = {"code": 8819, "conv": 19366}
#: Compression factors: chosen from vLLM+FCFS's TTFT alone (light load → past its knee), before comparing.
LOADS = {"code": (20.0, 40.0, 60.0, 80.0, 100.0), "conv": (20.0, 30.0, 40.0, 50.0, 55.0)}
KNEE = {"code": 80.0, "conv": 50.0}
MAIN = (("vllm", "fcfs"), ("gimbal", "fcfs"), ("vllm", "sjf-aging"), ("gimbal", "sjf-aging"))
REFERENCE = (("rr", "fcfs"), ("jsq", "fcfs"), ("vllm-main", "fcfs"))
BASE = "vllm+fcfs"
HEADLINE = ("gimbal+fcfs", "vllm+sjf-aging", "gimbal+sjf-aging")
METRICS = ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99")
EXTRA = ("throughput", "prompt_tput_gap", "prompt_tput_cov", "mean_running", "busy_fraction", "max_kv_usage")
EXTRA += ("preemptions", "kv_first_decisions", "aged_admissions", "offered_rate")


def seed_kv_blocks() -> int:
    """KV blocks per DP engine that Qwen3-30B-A3B (the seed's model) leaves on 2 x H100 with EP over 4 GPUs."""
    return DPCost(cost_model("qwen3-30b-a3b", "H100", gpus=2), ep_ranks=4).kv_capacity_blocks


def variants() -> dict[str, dict[str, object]]:
    return {
        "independent engines (EP2 each)": {"coupled": False},
        "DP=4 (TP2, EP8, lock-step)": {"engines": 4},
        "telemetry every 10 ms": {"telemetry_interval_s": 0.01, "inflight_grace_s": 0.005},
        "telemetry in phase across engines": {"telemetry_aligned": True},
        f"KV cache of Qwen3-30B-A3B ({seed_kv_blocks():,} blocks)": {"kv_blocks": seed_kv_blocks()},
    }


_SCENARIOS: dict[tuple[int, int], Scenario] = {}


def _scenario(seed: int, tp: int) -> Scenario:
    if (seed, tp) not in _SCENARIOS:
        _SCENARIOS[(seed, tp)] = prepare(ESFT, gpu="H100", gpus=tp, seed=seed)
    return _SCENARIOS[(seed, tp)]


def run_task(task: dict) -> list[dict]:
    """One workload (trace, load, seed, variant) under the task's (dispatch, order) pairs."""
    rows = []
    t0 = time.perf_counter()
    for dispatch, order in task["pairs"]:
        opts = DPSimOptions(
            trace=ESFT,
            requests=AZURE / f"AzureLLMInferenceTrace_{task['trace']}.csv",
            time_scale=task["time_scale"],
            num_requests=task["num_requests"],
            dispatch=(dispatch,),
            orders=(order,),
            seed=task["seed"],
            **task["options"],
        )
        payload = run_sim_dp(opts, scenario=_scenario(task["seed"], opts.tp))
        for label, s in payload["runs"].items():
            row = {k: task[k] for k in ("section", "variant", "trace", "time_scale", "seed")}
            row.update(combo=label, fleet=s["fleet"], requests=s["requests"])
            row.update({k: s[k] for k in METRICS + EXTRA})
            rows.append(row)
    print(
        f"  {task['section']:11s} {task['trace']} x{task['time_scale']:g} seed {task['seed']} {task['variant']}: "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    return rows


def tasks(seeds: list[int], quick: bool, sections: set[str]) -> list[dict]:
    out = []
    for trace in ("code", "conv"):
        n = 1500 if quick else TRACE_SIZE[trace]
        loads = LOADS[trace][1::2] if quick else LOADS[trace]
        for seed in seeds:
            if "main" in sections:
                for ts in loads:
                    pairs = MAIN + REFERENCE
                    out.append(_task("main", "baseline", trace, ts, seed, n, pairs, {}))
            if "sensitivity" in sections:
                for name, options in variants().items():
                    out.append(_task("sensitivity", name, trace, KNEE[trace], seed, n, MAIN, options))
    return out


def _task(section: str, variant: str, trace: str, ts: float, seed: int, n: int, pairs: tuple, options: dict) -> dict:
    return {
        "section": section,
        "variant": variant,
        "trace": trace,
        "time_scale": ts,
        "seed": seed,
        "num_requests": n,
        "pairs": pairs,
        "options": options,
    }


# -- report ------------------------------------------------------------------------------------------------


def _group(rows: list[dict]) -> dict[tuple, dict[str, list[dict]]]:
    """(section, variant, trace, time_scale) → combo → rows (one per seed)."""
    g: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        g[(r["section"], r["variant"], r["trace"], r["time_scale"])][r["combo"]].append(r)
    return g


def _mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def _delta(rows: list[dict], base: list[dict], key: str) -> tuple[float, float, float]:
    """Δ% of the seed-mean, and the smallest and largest per-seed Δ% (seeds paired)."""
    by_seed = {r["seed"]: r[key] for r in base}
    per = [100.0 * (r[key] / by_seed[r["seed"]] - 1.0) for r in rows if by_seed.get(r["seed"])]
    mean = 100.0 * (_mean(rows, key) / _mean(base, key) - 1.0)
    return mean, min(per), max(per)


def _fmt_delta(d: tuple[float, float, float]) -> str:
    return f"{d[0]:+.1f} % [{d[1]:+.1f}, {d[2]:+.1f}]"


def write_report(payload: dict, out: Path) -> Path:
    rows = payload["rows"]
    groups = _group(rows)
    lines = [
        "# Gimbal DP dispatch and SJF-with-aging on the DP fleet simulator",
        "",
        "Generated by `bench/gimbal_dp.py`; read `docs/gimbal-dispatch.md` for the model, its limits and the",
        "reading of these numbers. Every figure is the mean over seeds "
        f"{', '.join(map(str, payload['seeds']))} (routing draws and telemetry phases; the arrivals are the real",
        "trace's); Δ columns give the change of that mean against vLLM+FCFS and, in brackets, the smallest and",
        "largest per-seed change. Times in ms.",
        "",
        f"Fleet: {payload['fleet']}. Model physics: DeepSeek-V2-Lite (the routing trace's model) on H100.",
        f"Machine: {payload['machine']}; "
        + ", ".join(f"{k} {v:.0f} s" for k, v in sorted(payload["wall_s"].items()))
        + " (wall, 2 processes).",
        "",
    ]
    for trace in ("code", "conv"):
        keys = sorted(k for k in groups if k[0] == "main" and k[2] == trace)
        if not keys:
            continue
        lines += [f"## Azure {trace} trace: load sweep", ""]
        lines += ["Command per load (one seed, every pair):", "", "```sh"]
        for k in keys:
            lines.append(_command(trace, k[3], groups[k][BASE][0]["requests"]))
        lines += ["```", ""]
        combos = [
            c for c in (*(f"{d}+{o}" for d, o in MAIN), *(f"{d}+{o}" for d, o in REFERENCE)) if c in groups[keys[0]]
        ]
        for family, title in (("ttft", "TTFT"), ("tpot", "TPOT")):
            lines += [f"### {title} mean / p50 / p99 (ms)", ""]
            lines.append("| compression | req/s | " + " | ".join(combos) + " |")
            lines.append("|---|---|" + "---|" * len(combos))
            for k in keys:
                g = groups[k]
                cells = [
                    " / ".join(
                        f"{_mean(g[c], f'{family}_{q}') * 1e3:.{1 if family == 'tpot' else 0}f}"
                        for q in ("mean", "p50", "p99")
                    )
                    for c in combos
                ]
                lines.append(f"| ÷{k[3]:g} | {_mean(g[BASE], 'offered_rate'):.0f} | " + " | ".join(cells) + " |")
            lines.append("")
        lines += ["### Change against vLLM+FCFS (mean, [per-seed min, max])", ""]
        head = ["TTFT mean", "TTFT p99", "TPOT mean", "TPOT p99"]
        lines.append("| compression | pair | " + " | ".join(head) + " |")
        lines.append("|---|---|" + "---|" * len(head))
        for k in keys:
            g = groups[k]
            for c in HEADLINE:
                cells = [
                    _fmt_delta(_delta(g[c], g[BASE], m)) for m in ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99")
                ]
                lines.append(f"| ÷{k[3]:g} | {c} | " + " | ".join(cells) + " |")
        lines.append("")
        lines += ["### Imbalance and engine state (means over seeds)", ""]
        cols = ("prompt_tput_gap", "prompt_tput_cov", "mean_running", "max_kv_usage", "aged_admissions", "throughput")
        lines.append(
            "| compression | pair | prompt-tput gap (tok/s) | gap CoV | running/engine | max KV | aged | out tok/s |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for k in keys:
            g = groups[k]
            for c in combos:
                vals = [_mean(g[c], m) for m in cols]
                lines.append(
                    f"| ÷{k[3]:g} | {c} | {vals[0]:.0f} | {vals[1]:.3f} | {vals[2]:.1f} | {vals[3]:.2f} | "
                    f"{vals[4]:.0f} | {vals[5]:.0f} |"
                )
        lines.append("")
    sens = sorted(k for k in groups if k[0] == "sensitivity")
    if sens:
        lines += ["## Sensitivity (one change at a time, at the baseline's knee)", ""]
        lines.append(
            "| trace | variant | pair | TTFT mean (ms) | Δ TTFT mean | Δ TTFT p99 | TPOT mean (ms) | Δ TPOT mean "
            "| gap (tok/s) | KV-first |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for k in sens:
            g = groups[k]
            for c in (BASE, *HEADLINE):
                if c not in g:
                    continue
                d_ttft, d_p99, d_tpot = (
                    _fmt_delta(_delta(g[c], g[BASE], m)) for m in ("ttft_mean", "ttft_p99", "tpot_mean")
                )
                lines.append(
                    f"| {k[2]} ÷{k[3]:g} | {k[1]} | {c} | {_mean(g[c], 'ttft_mean') * 1e3:.0f} | {d_ttft} | {d_p99} | "
                    f"{_mean(g[c], 'tpot_mean') * 1e3:.1f} | {d_tpot} | "
                    f"{_mean(g[c], 'prompt_tput_gap'):.0f} | {_mean(g[c], 'kv_first_decisions'):.0f} |"
                )
        lines.append("")
    lines += ["Figures: `ttft_vs_load.png`, `tpot_vs_load.png`, `gap_vs_load.png`.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _command(trace: str, ts: float, n: int) -> str:
    return (
        f"switchyard sim-dp --requests data/requests/azure_llm_2023/AzureLLMInferenceTrace_{trace}.csv "
        f"--time-scale {ts:g} --num-requests {n} --engines 2 --tp 2 "
        f"--dispatch vllm,gimbal,rr,jsq,vllm-main --order both --seed 0 --gpu H100"
    )


def plot(payload: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _group(payload["rows"])
    styles = {
        "vllm+fcfs": ("k", "-"),
        "gimbal+fcfs": ("tab:blue", "-"),
        "vllm+sjf-aging": ("tab:orange", "--"),
        "gimbal+sjf-aging": ("tab:green", "--"),
        "rr+fcfs": ("0.6", ":"),
    }
    paths = []
    for family, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("gap", "prompt-throughput gap")):
        fig, axes = plt.subplots(1, 2 if family == "gap" else 4, figsize=(12 if family != "gap" else 8, 3.2))
        panels = []
        for trace in ("code", "conv"):
            if family == "gap":
                panels.append((trace, "prompt_tput_gap", "tok/s"))
            else:
                panels += [(trace, f"{family}_mean", "ms"), (trace, f"{family}_p99", "ms")]
        for ax, (trace, key, unit) in zip(axes, panels, strict=True):
            keys = sorted(k for k in groups if k[0] == "main" and k[2] == trace)
            if not keys:
                continue
            for combo, (color, ls) in styles.items():
                if combo not in groups[keys[0]]:
                    continue
                x = [_mean(groups[k][BASE], "offered_rate") for k in keys]
                scale = 1e3 if unit == "ms" else 1.0
                y = [_mean(groups[k][combo], key) * scale for k in keys]
                ax.plot(x, y, color=color, ls=ls, marker="o", ms=3, label=combo)
            ax.set_title(f"{trace}: {key}", fontsize=9)
            ax.set_xlabel("offered load (req/s)", fontsize=8)
            ax.set_ylabel(unit, fontsize=8)
            if family == "ttft":
                ax.set_yscale("log")
            ax.tick_params(labelsize=7)
        axes[0].legend(fontsize=7)
        fig.suptitle(
            f"{title} vs load, {payload['fleet']}, DeepSeek-V2-Lite physics on H100 (mean of seeds)", fontsize=9
        )
        fig.tight_layout()
        name = {"ttft": "ttft_vs_load.png", "tpot": "tpot_vs_load.png", "gap": "gap_vs_load.png"}[family]
        fig.savefig(out / name, dpi=80)
        plt.close(fig)
        paths.append(out / name)
    return paths


def write_csv(rows: list[dict], path: Path) -> None:
    keys = ["section", "variant", "trace", "time_scale", "seed", "combo", "fleet", "requests", *METRICS, *EXTRA]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in keys})


def read_csv(path: Path) -> list[dict]:
    text = {"section", "variant", "trace", "combo", "fleet"}
    rows = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            row: dict = {k: (v if k in text else float(v)) for k, v in r.items()}
            row["seed"] = int(row["seed"])
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "gimbal")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--sections", default="main,sensitivity")
    ap.add_argument("--quick", action="store_true", help="1,500 requests, two loads per trace (minutes)")
    ap.add_argument("--report-only", action="store_true", help="rebuild report and figures from the files")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    meta_path, csv_path = args.out / "results.json", args.out / "runs.csv"
    if args.report_only:
        meta = json.loads(meta_path.read_text())
        rows = read_csv(csv_path)
    else:
        seeds = [int(s) for s in args.seeds.split(",")]
        sections = set(args.sections.split(","))
        todo = tasks(seeds, args.quick, sections)
        print(f"{len(todo)} workloads on {args.jobs} processes", flush=True)
        t0 = time.perf_counter()
        rows = []
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            for part in pool.map(run_task, todo):
                rows += part
        wall = {",".join(sorted(sections)): time.perf_counter() - t0}
        meta = {"machine": _single_core.machine(), "wall_s": wall, "seeds": seeds, "quick": args.quick}
        if csv_path.exists() and meta_path.exists() and not args.quick:  # keep the sections not rerun
            old = json.loads(meta_path.read_text())
            if not old.get("quick"):
                rows = [r for r in read_csv(csv_path) if r["section"] not in sections] + rows
                meta["wall_s"] = {**old.get("wall_s", {}), **wall}
        meta.update(fleet="DP2 TP2 EP4 lock-step (vLLM DP+EP), H100", loads=LOADS, knee=KNEE)
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        write_csv(rows, csv_path)
    payload = {**meta, "rows": rows}
    path = write_report(payload, args.out)
    plot(payload, args.out)
    print(f"report: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
