"""Cache tiers on the DP fleet simulator: TTFT when the router credits blocks in the engines' CPU tier, against
GPU-only credit (issue 42 item 4; read docs/prefix-routing.md, "Cache tiers").

Every run has the same fleet, trace window and loads as bench/prefix_routing.py (Mooncake FAST'25, requests
2,500-2,999, DP2 TP2 on H100, DeepSeek-V2-Lite physics, FCFS, the `switchyard` profile on the precise index),
and differs only in the engines' CPU tier and the router's credit for it:

- `no tier`: vLLM without an offload tier (the figures of the rest of docs/prefix-routing.md);
- `gpu-only credit`: every engine has a CPU tier of `--cpu-tokens` (blocks the GPU evicts, loaded back over
  PCIe instead of recomputed: `simulator.core.prefix_cache`), the router credits GPU blocks only (weights
  1 / 0 / 0: the control, which must erase any gain of the next rows);
- `tier credit w`: the same tier, CPU blocks credited at w (0.75: Dynamo's default; 1.0: as GPU blocks).

`--shuffled`: the second control, the window's hash ids shuffled across its (request, block) slots (no shared
prefixes: nothing for either credit to find), GPU-only against tier credit 0.75.

Run: `.venv/bin/python bench/prefix_tiers.py [--seeds 0,1,2] [--cpu-tokens 4000000] [--json OUT]`; prints a
Markdown table (mean over seeds; per seed in the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import _single_core  # noqa: F401  before numpy: one BLAS thread
import numpy as np
from prefix_routing import LOADS, _opts, _scenario, shuffled

from switchyard.simulator.offline import dp_run
from switchyard.simulator.offline.dp import simulate_dp
from switchyard.simulator.offline.dp_run import summarize_dp

KEYS = ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "throughput", "prefix_hit_rate")


def runs(cpu_tokens: int, control: bool = False) -> list[tuple[str, dict]]:
    if control:  # no shared prefixes: the two credits must tie
        return [
            ("shuffled: gpu-only credit", {"prefix_cpu_tokens": cpu_tokens, "prefix_cpu_weight": 0.0}),
            ("shuffled: tier credit 0.75", {"prefix_cpu_tokens": cpu_tokens, "prefix_cpu_weight": 0.75}),
        ]
    return [
        ("no tier", {}),
        ("gpu-only credit (1/0/0, control)", {"prefix_cpu_tokens": cpu_tokens, "prefix_cpu_weight": 0.0}),
        ("tier credit 0.75", {"prefix_cpu_tokens": cpu_tokens, "prefix_cpu_weight": 0.75}),
        ("tier credit 1.0", {"prefix_cpu_tokens": cpu_tokens, "prefix_cpu_weight": 1.0}),
    ]


def cell(time_scale: float, seed: int, cpu_tokens: int, kv_blocks: int | None, control: bool = False) -> list[dict]:
    sc = _scenario(seed)
    opts = _opts("mooncake", time_scale, seed)
    fleet = dp_run.fleet_for(sc, opts)
    if kv_blocks:
        fleet = dataclasses.replace(fleet, kv_blocks=kv_blocks)
    wl = dp_run.workload_for(sc, opts, fleet)
    if control:
        wl = shuffled(wl, seed)
    counts = sc.counts.prefill[sc.replay]
    rows = []
    for tag, change in runs(cpu_tokens, control):
        c0 = time.process_time()
        res = simulate_dp(wl, sc.bank, dataclasses.replace(fleet, **change), "switchyard", "fcfs", seed, counts)
        s = summarize_dp(res)
        row = {"time_scale": time_scale, "seed": seed, "tag": tag, **{k: s[k] for k in KEYS}}
        row["engines_hash"] = int(np.dot(res.engine, np.arange(1, len(res.engine) + 1)) % 1_000_000_007)
        row["cpu_s"] = time.process_time() - c0
        rows.append(row)
        print(f"  x{time_scale:g} seed {seed} {tag}: {row['ttft_mean'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    out = [
        "| load | run | TTFT mean (ms) | TTFT p99 (ms) | TPOT mean (ms) | prefix hit (GPU+CPU) |",
        "|---|---|---|---|---|---|",
    ]
    for ts in sorted({r["time_scale"] for r in rows}):
        for tag in dict.fromkeys(r["tag"] for r in rows):
            sel = [r for r in rows if r["time_scale"] == ts and r["tag"] == tag]
            mean = {k: statistics.fmean(r[k] for r in sel) for k in KEYS}
            out.append(
                f"| ÷{ts:g} | {tag} | {mean['ttft_mean'] * 1e3:,.1f} | {mean['ttft_p99'] * 1e3:,.0f} | "
                f"{mean['tpot_mean'] * 1e3:.2f} | {mean['prefix_hit_rate']:.2f} |"
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS["mooncake"]))
    ap.add_argument("--cpu-tokens", type=int, default=2_000_000, help="each engine's CPU tier (tokens)")
    ap.add_argument(
        "--kv-blocks", type=int, default=24_000, help="each engine's GPU KV blocks (16 tokens; 0: the fleet's)"
    )
    ap.add_argument("--shuffled", action="store_true", help="the control: hash ids shuffled (no shared prefixes)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = [
        r
        for seed in (int(s) for s in args.seeds.split(","))
        for ts in (float(x) for x in args.loads.split(","))
        for r in cell(ts, seed, args.cpu_tokens, args.kv_blocks or None, args.shuffled)
    ]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"cpu_tokens": args.cpu_tokens, "kv_blocks": args.kv_blocks}
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
