"""Prefix-cache routing on the DP fleet simulator: every DP profile side by side, the controls, the prefix
weight sweep and the two prefix indexes' accuracy (issue 25; read docs/prefix-routing.md).

Workloads (all shipped, `data/requests/`): Mooncake's FAST'25 synthetic trace (hash_ids, 512-token blocks), a
window of `MOONCAKE_N` requests from request `MOONCAKE_START` (the caches start empty; later requests reuse
more of the trace's earlier prefixes), arrival times divided by a time scale; the Azure 2023 code and
conversation traces (no prefixes), their first `AZURE_N` requests, compressed likewise. Model physics:
DeepSeek-V2-Lite (the ESFT routing trace) on H100, DP2 TP2 EP4 lock-step (`sim-dp`'s default fleet), FCFS.
Seeds change the routing draws and the telemetry phases (the arrivals are the trace's).

Sections (`--sections`, comma-separated; rows already in `--out`/runs.json are kept, not rerun):

- `main`: every trace × load × seed × profile (`--profiles`; default: every DP profile but rr, jsq, vllm-main).
- `index`: Mooncake, `switchyard` with each prefix index (precise, approximate): the accuracy of both
  indexes' predictions against the hit found at admission, and what each index does to TTFT.
- `sweep`: Mooncake (and Azure code at its middle load), `switchyard` with `uncached_prompt` at each weight.
- `controls`: Mooncake with hash_ids shuffled across the window's (request, block) slots (no shared
  prefixes: gimbal against switchyard), and switchyard at weight 0 against gimbal (decisions compared; the
  first seed only).

Run: `.venv/bin/python bench/prefix_routing.py [--sections main,index,sweep,controls] [--jobs 1]`; the report
goes to stdout and `--out`/report.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import _single_core  # before numpy: one BLAS thread
import numpy as np

from switchyard.data import SHIPPED_DIR
from switchyard.shared.streams import stream
from switchyard.simulator.core.workload import Workload
from switchyard.simulator.offline import dp_run
from switchyard.simulator.offline.dp import simulate_dp
from switchyard.simulator.offline.dp_run import DPSimOptions, summarize_dp
from switchyard.simulator.offline.scenario import Scenario, prepare
from switchyard.solver.routing.profiles import DP_PROFILES, PREFIX_WEIGHT

ROOT = Path(__file__).resolve().parent.parent
ESFT = SHIPPED_DIR / "routing" / "esft_deepseek_v2_lite"
MOONCAKE = SHIPPED_DIR / "requests" / "mooncake_fast25" / "synthetic_trace.jsonl"
AZURE = SHIPPED_DIR / "requests" / "azure_llm_2023"
TRACES = {
    "mooncake": MOONCAKE,
    "code": AZURE / "AzureLLMInferenceTrace_code.csv",
    "conv": AZURE / "AzureLLMInferenceTrace_conv.csv",
}
MOONCAKE_START, MOONCAKE_N, AZURE_N = 2500, 500, 2000
#: Time scales (low, middle, saturating), set from vLLM+FCFS's TTFT before any profile was compared.
LOADS = {"mooncake": (1.0, 2.0, 4.0), "code": (20.0, 60.0, 100.0), "conv": (20.0, 40.0, 55.0)}
WEIGHTS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
# the exact-ledger profiles (docs/gimbal-exact-ledger.md) are not in this sweep yet: its figures stay as published
DEFAULT_PROFILES = tuple(
    p for p in DP_PROFILES if p not in ("rr", "jsq", "vllm-main", "gimbal-exact", "switchyard-exact")
)
KEYS = ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "throughput", "prefix_hit_rate", "prefix_hit_request_mean")
INDEX_KEYS = tuple(f"prefix_{i}_{m}" for i in ("precise", "approximate") for m in ("mae", "exact", "bias"))

_SCENARIOS: dict[int, Scenario] = {}


def _scenario(seed: int) -> Scenario:
    if seed not in _SCENARIOS:
        _SCENARIOS[seed] = prepare(ESFT, gpu="H100", gpus=2, seed=seed)
    return _SCENARIOS[seed]


def _opts(trace: str, ts: float, seed: int) -> DPSimOptions:
    start, n = (MOONCAKE_START, MOONCAKE_N) if trace == "mooncake" else (0, AZURE_N)
    return DPSimOptions(trace=ESFT, requests=TRACES[trace], start=start, num_requests=n, time_scale=ts, seed=seed)


def shuffled(wl: Workload, seed: int) -> Workload:
    """The workload with every hash id shuffled across all (request, block) slots: frequencies kept, chains gone."""
    assert wl.hash_ids is not None
    lengths = [len(h) for h in wl.hash_ids]
    ids = np.concatenate(wl.hash_ids)
    ids = ids[stream(seed, "control.shuffle").permutation(len(ids))]
    return dataclasses.replace(wl, hash_ids=tuple(np.split(ids, np.cumsum(lengths)[:-1])))


def run_task(task: dict) -> list[dict]:
    """One workload (trace, load, seed, variant) under each of the task's runs (profile, fleet changes)."""
    sc = _scenario(task["seed"])
    opts = _opts(task["trace"], task["time_scale"], task["seed"])
    fleet = dp_run.fleet_for(sc, opts)
    wl = dp_run.workload_for(sc, opts, fleet)
    if task["variant"] == "shuffled":
        wl = shuffled(wl, task["seed"])
    counts = sc.counts.prefill[sc.replay]
    rows = []
    for run in task["runs"]:
        f = dataclasses.replace(fleet, **run["fleet"])
        t0, c0 = time.perf_counter(), time.process_time()
        res = simulate_dp(wl, sc.bank, f, run["profile"], "fcfs", seed=task["seed"], prefill_counts=counts)
        s = summarize_dp(res)
        row = {k: task[k] for k in ("section", "variant", "trace", "time_scale", "seed")}
        row.update(profile=run["profile"], tag=run["tag"], requests=s["requests"], offered_rate=s["offered_rate"])
        row.update({k: s[k] for k in (*KEYS, *INDEX_KEYS) if k in s})
        row["engines_hash"] = int(np.dot(res.engine, np.arange(1, len(res.engine) + 1)) % 1_000_000_007)
        row["cpu_s"] = time.process_time() - c0
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
    print(
        f"  {task['section']:8s} {task['trace']:8s} x{task['time_scale']:g} seed {task['seed']} {task['variant']}: "
        f"{sum(r['cpu_s'] for r in rows):.1f} CPU s",
        file=sys.stderr,
        flush=True,
    )
    return rows


def _run(profile: str, tag: str | None = None, **fleet: object) -> dict:
    return {"profile": profile, "tag": tag or profile, "fleet": fleet}


def _weights(w: float) -> dict[str, object]:
    return {"dispatch_weights": (("uncached_prompt", w),)}


def tasks(sections: set[str], seeds: list[int], profiles: tuple[str, ...]) -> list[dict]:
    out = []
    for seed in seeds:
        for trace, loads in LOADS.items():
            for ts in loads:
                if "main" in sections:
                    out.append(_task("main", "", trace, ts, seed, [_run(p) for p in profiles]))
                if "index" in sections and trace == "mooncake":
                    runs = [_run("switchyard", f"switchyard/{i}", prefix_index=i) for i in ("precise", "approximate")]
                    out.append(_task("index", "", trace, ts, seed, runs))
                if "sweep" in sections and (trace == "mooncake" or (trace == "code" and ts == loads[1])):
                    runs = [_run("switchyard", f"w={w:g}", **_weights(w)) for w in WEIGHTS]
                    out.append(_task("sweep", "", trace, ts, seed, [_run("gimbal", "w=0 (gimbal)"), *runs]))
                if "controls" in sections and trace == "mooncake":
                    runs = [_run("gimbal"), _run("switchyard")]
                    out.append(_task("controls", "shuffled", trace, ts, seed, runs))
                if "controls" in sections and trace == "mooncake" and seed == seeds[0]:
                    runs = [_run("gimbal"), _run("switchyard", "switchyard w=0", **_weights(0.0))]
                    out.append(_task("controls", "weight0", trace, ts, seed, runs))
    return out


def _task(section: str, variant: str, trace: str, ts: float, seed: int, runs: list[dict]) -> dict:
    return {"section": section, "variant": variant, "trace": trace, "time_scale": ts, "seed": seed, "runs": runs}


def _key(row: dict) -> tuple:
    return (row["section"], row["variant"], row["trace"], row["time_scale"], row["seed"], row["tag"])


# -- report ------------------------------------------------------------------------------------------------


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.fmean(vals) if vals else float("nan")


def _spread(rows: list[dict], key: str) -> str:
    vals = [r[key] for r in rows]
    return f"{min(vals):.0f}–{max(vals):.0f}" if len(vals) > 1 else ""


def _groups(rows: list[dict], section: str, variant: str = "") -> dict[tuple, dict[str, list[dict]]]:
    g: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["section"] == section and r["variant"] == variant:
            g[(r["trace"], r["time_scale"])][r["tag"]].append(r)
    return g


def _load(trace: str, ts: float, runs: dict[str, list[dict]]) -> str:
    rate = _mean(next(iter(runs.values())), "offered_rate")
    return f"{trace} ÷{ts:g} ({rate:.1f} req/s)"


def report(rows: list[dict]) -> str:
    lines = [
        "Times in ms, throughput in output tokens/s; each figure the mean over seeds "
        f"{sorted({r['seed'] for r in rows})} (TTFT mean: the seeds' range after it).",
        "",
    ]
    main = _groups(rows, "main")
    if main:
        lines += ["## Every profile side by side (FCFS)", ""]
        lines += ["| load | profile | TTFT mean (range) | TTFT p99 | TPOT mean | tok/s | prefix hit |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for (trace, ts), runs in main.items():
            best = min(_mean(v, "ttft_mean") for v in runs.values())
            for tag, rs in runs.items():
                m = _mean(rs, "ttft_mean") * 1e3
                mark = "**" if _mean(rs, "ttft_mean") == best else ""
                spread = _spread([{"x": r["ttft_mean"] * 1e3} for r in rs], "x")
                lines.append(
                    f"| {_load(trace, ts, runs)} | {tag} | {mark}{m:.1f}{mark} ({spread}) "
                    f"| {_mean(rs, 'ttft_p99') * 1e3:.0f} | {_mean(rs, 'tpot_mean') * 1e3:.2f} "
                    f"| {_mean(rs, 'throughput'):.0f} | {_mean(rs, 'prefix_hit_rate'):.3f} |"
                )
        lines.append("")
    index = _groups(rows, "index")
    if index:
        lines += ["## Prefix indexes: prediction at the decision against the hit found at admission (Mooncake)", ""]
        lines += [
            "| load | switchyard fed by | TTFT mean | TTFT p99 | prefix hit | precise: MAE tok / exact / bias "
            "| approximate: MAE tok / exact / bias |",
            "|---|---|---|---|---|---|---|",
        ]
        for (trace, ts), runs in index.items():
            for tag, rs in runs.items():
                cells = [
                    f"{_mean(rs, f'prefix_{i}_mae'):.0f} / {_mean(rs, f'prefix_{i}_exact'):.3f} / "
                    f"{_mean(rs, f'prefix_{i}_bias'):+.0f}"
                    for i in ("precise", "approximate")
                ]
                lines.append(
                    f"| {_load(trace, ts, runs)} | {tag.split('/')[1]} | {_mean(rs, 'ttft_mean') * 1e3:.1f} "
                    f"| {_mean(rs, 'ttft_p99') * 1e3:.0f} | {_mean(rs, 'prefix_hit_rate'):.3f} "
                    f"| {cells[0]} | {cells[1]} |"
                )
        lines.append("")
    sweep = _groups(rows, "sweep")
    if sweep:
        lines += ["## Weight sweep of uncached_prompt (switchyard)", ""]
        lines += ["| load | weight | TTFT mean | TTFT p99 | TPOT mean | tok/s | prefix hit |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for (trace, ts), runs in sweep.items():
            for tag, rs in runs.items():
                lines.append(
                    f"| {_load(trace, ts, runs)} | {tag} | {_mean(rs, 'ttft_mean') * 1e3:.1f} "
                    f"| {_mean(rs, 'ttft_p99') * 1e3:.0f} | {_mean(rs, 'tpot_mean') * 1e3:.2f} "
                    f"| {_mean(rs, 'throughput'):.0f} | {_mean(rs, 'prefix_hit_rate'):.3f} |"
                )
        lines.append("")
    shuffled_runs = _groups(rows, "controls", "shuffled")
    if shuffled_runs:
        lines += ["## Control: hash_ids shuffled across requests (Mooncake window)", ""]
        lines += ["| load | profile | TTFT mean | TTFT p99 | prefix hit |", "|---|---|---|---|---|"]
        for (trace, ts), runs in shuffled_runs.items():
            for tag, rs in runs.items():
                lines.append(
                    f"| {_load(trace, ts, runs)} | {tag} | {_mean(rs, 'ttft_mean') * 1e3:.1f} "
                    f"| {_mean(rs, 'ttft_p99') * 1e3:.0f} | {_mean(rs, 'prefix_hit_rate'):.4f} |"
                )
        lines.append("")
    zero = _groups(rows, "controls", "weight0")
    if zero:
        lines += ["## Control: switchyard at prefix weight 0 against gimbal (Mooncake window)", ""]
        lines += ["| load | runs with identical engine assignment | TTFT mean gimbal / w=0 |", "|---|---|---|"]
        for (trace, ts), runs in zero.items():
            g, z = runs["gimbal"], runs["switchyard w=0"]
            same = sum(a["engines_hash"] == b["engines_hash"] for a, b in zip(g, z, strict=True))
            lines.append(
                f"| {_load(trace, ts, runs)} | {same} / {len(g)} "
                f"| {_mean(g, 'ttft_mean') * 1e3:.2f} / {_mean(z, 'ttft_mean') * 1e3:.2f} |"
            )
        lines.append("")
    cpu = defaultdict(float)
    for r in rows:
        cpu[r["section"]] += r["cpu_s"]
    lines.append("CPU: " + ", ".join(f"{k} {v:.0f} s" for k, v in sorted(cpu.items())) + f"; {_single_core.machine()}.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="main,index,sweep,controls")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--profiles", default=",".join(DEFAULT_PROFILES))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "prefix")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "runs.json"
    rows: list[dict] = json.loads(path.read_text()) if path.exists() else []
    if not args.report_only:
        done = {_key(r) for r in rows}
        todo = []
        seeds = [int(s) for s in args.seeds.split(",")]
        for t in tasks(set(args.sections.split(",")), seeds, tuple(args.profiles.split(","))):
            t["runs"] = [r for r in t["runs"] if _key({**t, "tag": r["tag"]}) not in done]
            if t["runs"]:
                todo.append(t)
        runs = sum(len(t["runs"]) for t in todo)
        print(f"{len(todo)} workloads, {runs} runs (PREFIX_WEIGHT {PREFIX_WEIGHT})", file=sys.stderr)
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs) as pool:
                for got in pool.map(run_task, todo):
                    rows += got
        else:
            for t in todo:
                rows += run_task(t)
                path.write_text(json.dumps(rows, indent=1))
        path.write_text(json.dumps(rows, indent=1))
    text = report(rows)
    (args.out / "report.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
