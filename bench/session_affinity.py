"""Session affinity ("sticky until saturated") against prefix-only routing on the shipped Mooncake trace, on the DP
fleet simulator (issue 42 item 3; docs/gateway.md, "Session affinity").

Workload and fleet: `bench/prefix_routing.py`'s Mooncake setting (FAST'25 synthetic trace, requests
`MOONCAKE_START`.. +`MOONCAKE_N`, arrivals divided by each time scale; DeepSeek-V2-Lite on H100, DP2 TP2 EP4,
FCFS, the precise prefix index), and the same with four engines. The trace names no sessions:
`dp_sessions.conversation_sessions` links a request to the earlier one whose prompt (but its last, partial block)
it begins with, a conversation's next turn.

Runs per (load, seed):

- `prefix-only`: the `switchyard` DP profile (load + prefix credit), no sessions: what the gateway does today
  for a request naming none;
- `sessions`: the same profile behind the gateway's sticky-until-saturated rule (`dp_sessions.sticky`, limit
  the engine's `max_num_seqs` and KV usage 0.95, the gateway's defaults);
- control `sessions removed`: the rule with every session id removed (must equal `prefix-only`, decision for
  decision: checked);
- control `sessions shuffled`: the session ids permuted across the window's requests (as many sessions of the
  same sizes, none a conversation): what holding arbitrary groups together costs;
- `load-only` (`gimbal`) and `load-only + sessions`: what stickiness gives without prefix credit.

Seeds change the routing draws and telemetry phases, and the shuffle (stream ``sessions.shuffle``).
Run: `.venv/bin/python bench/session_affinity.py [--seeds 0,1,2] [--engines 2,4] [--jobs 1]
[--out docs/results/sessions]`; the report goes to stdout and `--out`/report.md, every run to `--out`/runs.json.
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

import _single_core  # noqa: F401  # before numpy: one BLAS thread
import numpy as np
import prefix_routing as pr

from switchyard.shared.streams import stream
from switchyard.simulator.offline import dp, dp_run
from switchyard.simulator.offline.dp_run import summarize_dp
from switchyard.simulator.offline.dp_sessions import conversation_sessions, sticky

ROOT = Path(__file__).resolve().parent.parent
LOADS = pr.LOADS["mooncake"]
KEYS = ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "throughput", "prefix_hit_rate")
#: (tag, profile, sessions variant: None = no sticky rule)
RUNS = (
    ("prefix-only", "switchyard", None),
    ("sessions", "switchyard", "conversations"),
    ("sessions removed", "switchyard", "removed"),
    ("sessions shuffled", "switchyard", "shuffled"),
    ("load-only", "gimbal", None),
    ("load-only + sessions", "gimbal", "conversations"),
)


def _sessions(variant: str, hash_ids: tuple, seed: int) -> np.ndarray:
    sessions = conversation_sessions(hash_ids)
    if variant == "removed":
        return np.full(len(sessions), -1, dtype=np.int64)
    if variant == "shuffled":
        return sessions[stream(seed, "sessions.shuffle").permutation(len(sessions))]
    return sessions


def run_task(task: dict) -> list[dict]:
    """One (fleet size, load, seed) under every run of `RUNS`."""
    seed, ts, engines = task["seed"], task["time_scale"], task["engines"]
    sc = pr._scenario(seed)
    opts = dataclasses.replace(pr._opts("mooncake", ts, seed), engines=engines)
    fleet = dp_run.fleet_for(sc, opts)
    wl = dp_run.workload_for(sc, opts, fleet)
    counts = sc.counts.prefill[sc.replay]
    factory = dp._dispatcher
    rows = []
    for tag, profile, variant in RUNS:
        kept: dict[str, object] = {}
        if variant is not None:
            sessions = _sessions(variant, wl.hash_ids, seed)

            def with_sessions(*args: object, _s: np.ndarray = sessions, _k: dict = kept, **kwargs: object) -> object:
                disp = factory(*args, **kwargs)  # the fleet's dispatcher, then the gateway's rule in front of it
                _k["counts"] = sticky(disp, _s, fleet.max_running)[1]
                return disp

            dp._dispatcher = with_sessions  # the simulator builds its dispatcher inside `simulate_dp`
        c0 = time.process_time()
        try:
            res = dp.simulate_dp(wl, sc.bank, fleet, profile, "fcfs", seed=seed, prefill_counts=counts)
        finally:
            dp._dispatcher = factory
        s = summarize_dp(res)
        row = {"engines": engines, "time_scale": ts, "seed": seed, "tag": tag, "offered_rate": s["offered_rate"]}
        row.update({k: s[k] for k in KEYS})
        c = kept.get("counts")
        row["sticky"] = getattr(c, "sticky", 0)
        row["saturated"] = getattr(c, "saturated", 0)
        row["requests"] = int(wl.size)
        row["engines_hash"] = int(np.dot(res.engine, np.arange(1, len(res.engine) + 1)) % 1_000_000_007)
        row["cpu_s"] = time.process_time() - c0
        rows.append(row)
    by = {r["tag"]: r for r in rows}
    assert by["sessions removed"]["engines_hash"] == by["prefix-only"]["engines_hash"], "removed must equal prefix-only"
    print(f"  DP{engines} x{ts:g} seed {seed}: {sum(r['cpu_s'] for r in rows):.0f} CPU s", file=sys.stderr, flush=True)
    return rows


def report(rows: list[dict]) -> str:
    seeds = sorted({r["seed"] for r in rows})
    lines = [
        f"Mooncake FAST'25 trace, requests {pr.MOONCAKE_START}..{pr.MOONCAKE_START + pr.MOONCAKE_N - 1}, DP2 and "
        f"DP4 (DeepSeek-V2-Lite, H100, TP2 engines), FCFS; each figure the mean over seeds {seeds}, TTFT mean "
        "with the seeds' range. "
        "Times in ms, throughput in output tokens/s; sticky: requests held on their session's engine.",
        "",
        "| fleet, load | run | TTFT mean (range) | TTFT p50 | TTFT p99 | TPOT mean | tok/s | prefix hit | sticky |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[int, float], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        groups[(r["engines"], r["time_scale"])][r["tag"]].append(r)
    for engines, ts in sorted(groups):
        for tag, _profile, _variant in RUNS:
            rs = groups[(engines, ts)].get(tag)
            if not rs:
                continue
            m = {k: statistics.fmean(r[k] for r in rs) for k in (*KEYS, "offered_rate", "sticky")}
            lo, hi = min(r["ttft_mean"] for r in rs) * 1e3, max(r["ttft_mean"] for r in rs) * 1e3
            lines.append(
                f"| DP{engines} ÷{ts:g} ({m['offered_rate']:.1f} req/s) | {tag} "
                f"| {m['ttft_mean'] * 1e3:.0f} ({lo:.0f}–{hi:.0f}) "
                f"| {m['ttft_p50'] * 1e3:.0f} | {m['ttft_p99'] * 1e3:.0f} | {m['tpot_mean'] * 1e3:.2f} "
                f"| {m['throughput']:.0f} | {m['prefix_hit_rate']:.3f} | {m['sticky']:.0f} / {rs[0]['requests']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--engines", default="2,4")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "sessions")
    args = ap.parse_args()
    tasks = [
        {"engines": int(e), "time_scale": ts, "seed": int(s)}
        for e in args.engines.split(",")
        for s in args.seeds.split(",")
        for ts in LOADS
    ]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = [r for rs in pool.map(run_task, tasks) for r in rs]
    else:
        rows = [r for t in tasks for r in run_task(t)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runs.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = report(rows)
    (args.out / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
