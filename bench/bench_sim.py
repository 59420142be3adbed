"""Simulator speed: 10,000 requests through an 8P16D fleet under one decode policy (budget: ≤ 60 s, one core).

Workload: the ESFT DeepSeek-V2-Lite routing trace replayed with the Azure conversation trace's arrivals and
lengths (time compressed to ~100 req/s; ~2.1 M output tokens). Prints wall and CPU seconds, decode steps
and simulated token-steps per second. Run: `.venv/bin/python bench/bench_sim.py [--policy jsq] [-n 10000]`.
"""

from __future__ import annotations

import argparse
import os
import time

from switchyard.data import SHIPPED_DIR
from switchyard.simulator.core.workload import load_request_csv
from switchyard.simulator.offline.metrics import summarize
from switchyard.simulator.offline.scenario import prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", default="jsq")
    ap.add_argument("-n", "--num-requests", type=int, default=10_000)
    ap.add_argument("--time-scale", type=float, default=18.0)
    ap.add_argument("--gpu", default="H100")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    t0 = time.perf_counter()
    sc = prepare(SHIPPED_DIR / "routing" / "esft_deepseek_v2_lite", gpu=args.gpu, seed=0)
    requests = load_request_csv(SHIPPED_DIR / "requests" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv")
    fleet = sc.fleet(8, 16)
    wl = sc.workload(args.num_requests, seed=0, requests=requests, time_scale=args.time_scale)
    if args.policy.startswith("eldr"):  # fit outside the timed loop
        from switchyard.solver.routing import get_policy

        sc.policy_inputs(get_policy(args.policy), fleet, wl)
    setup = time.perf_counter() - t0

    w0, c0 = time.perf_counter(), time.process_time()
    res = sc.run(wl, fleet, args.policy, seed=0)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    s = summarize(res)
    steps = len(res.step_batch)
    tokens = int(res.tokens.sum())
    print(f"workload   {wl.description}")
    print(f"setup      {setup:.2f} s (trace, split, bank{', ELDR fit' if args.policy.startswith('eldr') else ''})")
    print(f"simulate   {wall:.2f} s wall, {cpu:.2f} s CPU  [{args.policy}, {fleet.label}, {wl.size} requests]")
    print(
        f"events     {steps} decode steps, {tokens} output tokens, {tokens / wall:,.0f} token-steps/s, "
        f"{wall / steps * 1e6:.1f} µs/step"
    )
    print(
        f"result     TPOT p50 {s['tpot_p50'] * 1e3:.2f} ms, p99 {s['tpot_p99'] * 1e3:.2f} ms, "
        f"TTFT p50 {s['ttft_p50'] * 1e3:.1f} ms, simulated {s['makespan_s']:.0f} s"
    )
    print(f"budget     {'OK' if wall <= 60 else 'OVER'} (≤ 60 s)")


if __name__ == "__main__":
    main()
