"""Expert-affinity dispatch against pressure-only dispatch, same placement, with the shuffled-signature control.

Issue 40 item 3 (docs/expert-affinity.md). The seed's fleet (DP2 TP2 EP4 lock-step on H100, Qwen3-30B-A3B
physics on the ESFT routing trace's selections, `--borrow-routing`), Gimbal's order (SJF with aging) and
Gimbal's source-aware placement loop; dispatch is either `gimbal` (Algorithm 1: pressure alone) or
`gimbal-affinity` (the same plus ``expert_affinity`` at each weight of `--weights`), and each affinity weight
again with the signatures shuffled over requests (`DPFleetConfig.affinity_control`).

Workloads, both with prefix-linked signatures (`simulator.core.linked_replay`, an assumption each):

- `esft`: the gimbal-seed bench's Poisson arrivals with BurstGPT lengths; every request starts with its ESFT
  task's system prompt (4 blocks of 16 tokens), the rest its own;
- `mooncake`: the shipped Mooncake FAST'25 trace (its arrivals / `--time-scale`, its lengths and block hashes);
  every request replays an ESFT request of its root block's task.

Prints one table per workload and writes `--json`. CPU-heavy: run it with `nice`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _single_core  # before numpy: one BLAS thread; and the machine line
import numpy as np

from switchyard import data as shipped
from switchyard.simulator.core.linked_replay import prefix_linked, task_prefixed
from switchyard.simulator.core.workload import load_requests
from switchyard.simulator.offline.dp import DPFleetConfig, simulate_dp
from switchyard.simulator.offline.dp_run import summarize_dp
from switchyard.simulator.offline.scenario import prepare

ROOT = Path(__file__).resolve().parent.parent
BURSTGPT = "data/requests/burstgpt/BurstGPT_1_first400.csv"
MOONCAKE = "data/requests/mooncake_fast25/synthetic_trace.jsonl"
KEYS = (
    "ttft_mean",
    "ttft_p99",
    "tpot_mean",
    "throughput",
    "ep_a2a_nvlink_bytes_per_token",
    "ep_a2a_network_bytes_per_token",
    "ep_load_max_mean",
    "ep_migrations",
    "ep_migration_s",
    "prefix_hit_rate",
)


def task_purity(engine: np.ndarray, task: np.ndarray, engines: int) -> float:
    """Share of requests on their task's majority engine (1/engines: tasks spread evenly; 1: segregated)."""
    ok = task >= 0
    counts = np.zeros((int(task.max()) + 1, engines))
    np.add.at(counts, (task[ok], engine[ok]), 1)
    return float(counts.max(axis=1).sum() / max(ok.sum(), 1))


def run_one(sc, wl, prefill_counts, placement: str, dispatch: str, weight: float | None, control: str, seed: int):
    fleet = DPFleetConfig(
        engines=2,
        cost=sc.cost,
        placement=placement,
        dispatch_weights=(("expert_affinity", weight),) if weight is not None else (),
        affinity_control=control,
    )
    t0 = time.process_time()
    res = simulate_dp(wl, sc.bank, fleet, dispatch, "sjf-aging", seed=seed, prefill_counts=prefill_counts)
    s = summarize_dp(res)
    out = {k: s.get(k) for k in KEYS}
    out["task_purity"] = task_purity(res.engine, sc.bank.labels[wl.replay], fleet.engines)
    out["cpu_s"] = time.process_time() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("esft", "mooncake"), default="esft")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--rate", type=float, default=100.0, help="esft: Poisson rate (req/s)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="mooncake: divide its arrival times by this")
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--weights", default="1,4,16", help="expert_affinity weights to sweep")
    ap.add_argument("--placement", default="gimbal")
    ap.add_argument("--no-control", action="store_true", help="skip the shuffled-signature runs")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    weights = [float(w) for w in args.weights.split(",") if w]
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        sc = prepare(ROOT / "data" / shipped.ESFT, model="qwen3-30b-a3b", gpus=2, seed=seed, borrow_routing=True)
        max_tokens = DPFleetConfig(engines=2, cost=sc.cost).engine_kv_blocks * sc.cost.block_size
        if args.workload == "esft":
            reqs = load_requests(ROOT / BURSTGPT)
            wl = sc.workload(args.num_requests, seed, rate=args.rate, requests=reqs, max_tokens=max_tokens)
            wl = task_prefixed(wl, sc.bank.labels)
        else:
            reqs = load_requests(ROOT / MOONCAKE)
            wl = sc.workload(args.num_requests, seed, requests=reqs, time_scale=args.time_scale, max_tokens=max_tokens)
            wl = prefix_linked(wl, sc.bank.labels, seed)
        counts = sc.counts.prefill[sc.replay]
        variants = [("pressure", "gimbal", None, "none")]
        for w in weights:
            variants.append((f"affinity w={w:g}", "gimbal-affinity", w, "none"))
            if not args.no_control:
                variants.append((f"shuffled w={w:g}", "gimbal-affinity", w, "shuffled"))
        for label, dispatch, w, control in variants:
            r = run_one(sc, wl, counts, args.placement, dispatch, w, control, seed)
            r.update(variant=label, seed=seed, dispatch=dispatch, weight=w, control=control)
            rows.append(r)
            print(
                f"seed {seed} {label:18s} TTFT {r['ttft_mean'] * 1e3:8.2f} ms  TPOT {r['tpot_mean'] * 1e3:6.2f} ms  "
                f"a2a {r['ep_a2a_nvlink_bytes_per_token'] / 1e6:.4f} MB/tok  load {r['ep_load_max_mean']:.3f}  "
                f"purity {r['task_purity']:.3f}  migr {r['ep_migrations']}  hit {r['prefix_hit_rate']:.3f}  "
                f"({r['cpu_s']:.0f} CPU s)",
                flush=True,
            )
    meta = {"machine": _single_core.machine(), "argv": sys.argv[1:], "workload": wl.description}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "runs": rows}, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
