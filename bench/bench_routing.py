"""Decode-routing decision time, in process: every policy of `solver.routing` at K = D = 32 decoders.

Budget (DESIGN.md): ≤ 20 µs median per decision. Similarities are given (the router computes them with
`solver.scoring` once per request; that cost is the ELDR fit's benchmark). Run:
`.venv/bin/python bench/bench_routing.py [--decoders 32] [--n 20000]`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from switchyard.solver.routing import DECODE_POLICIES, FleetSnapshot, RouteQuery, RouterState, RoutingTables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--decoders", type=int, default=32)
    ap.add_argument("--n", type=int, default=20_000)
    args = ap.parse_args()
    d = args.decoders
    rng = np.random.default_rng(0)
    ids = [f"decode-{i:03d}" for i in range(d)]
    snap = FleetSnapshot.build(ids, load={e: float(rng.integers(0, 40)) for e in ids})
    shares = {"intent": 0.4, "law": 0.2, "summary": 0.2, "translation": 0.2}
    tables = RoutingTables.build(snap.engine_ids, num_centroids=d, label_shares=shares)
    queries = [RouteQuery(sims=rng.random(d).astype(np.float32), label="law") for _ in range(256)]
    state = RouterState.seeded(0)
    print(f"{'policy':14s} {'p50 µs':>8s} {'p99 µs':>8s}  (K = D = {d})")
    for name, policy in DECODE_POLICIES.items():
        times = np.empty(args.n)
        for i in range(args.n):
            q = queries[i & 255]
            t0 = time.perf_counter_ns()
            policy(snap, q, state, tables)
            times[i] = time.perf_counter_ns() - t0
        p50, p99 = np.percentile(times, [50, 99]) / 1e3
        print(f"{name:14s} {p50:8.1f} {p99:8.1f}  {'OK' if p50 <= 20 else 'OVER'}")


if __name__ == "__main__":
    main()
