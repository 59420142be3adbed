"""Routing decision time, in process: every decode policy of `solver.routing` at K = D = 32 decoders, ELDR's
composition without its fused kernel, and every DP profile beside the hand-written formula it composes
(`solver.routing.dispatch.pick_*`), on the same columns.

Budget (DESIGN.md): ≤ 20 µs median per decision. Similarities are given (the router computes them with
`solver.scoring` once per request; that cost is the ELDR fit's benchmark). Run:
`.venv/bin/python bench/bench_routing.py [--decoders 32] [--n 20000]`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from switchyard.solver.routing import (
    DECODE_POLICIES,
    DP_PROFILES,
    FleetSnapshot,
    RouteQuery,
    RouterState,
    RoutingTables,
    decode_profile,
    dp_profile,
)
from switchyard.solver.routing import dispatch as formulas


def percentiles(call: Callable[[int], object], n: int) -> tuple[float, float]:
    """p50 and p99 of `call(i)` in µs over `n` calls."""
    times = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter_ns()
        call(i)
        times[i] = time.perf_counter_ns() - t0
    p50, p99 = np.percentile(times, [50, 99]) / 1e3
    return float(p50), float(p99)


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
        p50, p99 = percentiles(lambda i, p=policy: p(snap, queries[i & 255], state, tables), args.n)
        print(f"{name:14s} {p50:8.1f} {p99:8.1f}  {'OK' if p50 <= 20 else 'OVER'}")
    compose = decode_profile("eldr").compose
    p50, p99 = percentiles(lambda i: compose(snap, queries[i & 255], state, tables), args.n)
    print(f"{'eldr, composed':14s} {p50:8.1f} {p99:8.1f}  (filters + scorer + picker, no fused kernel)")

    cols = {
        name: rng.integers(0, 4000, d).astype(np.float64)
        for name in ("remaining_prefill", "waiting_prefill", "inflight_tokens", "waiting", "running")
    }
    cols["expert_pressure"] = 1.0 + rng.random(d)
    dp = FleetSnapshot(snap.engine_ids, snap.load.copy(), rng.random(d) * 0.8, snap.alive.copy())
    dp.columns.update(cols, outstanding=dp.load)
    alive, kv, params, query, no_tables = dp.alive, dp.kv_usage, formulas.GimbalParams(), RouteQuery(), RoutingTables()
    hand_written: dict[str, Callable[[], int]] = {
        "gimbal": lambda: formulas.pick_dp_engine(
            alive, kv, cols["remaining_prefill"], cols["waiting_prefill"], cols["inflight_tokens"],
            cols["expert_pressure"], params,
        ),
        "vllm": lambda: formulas.pick_vllm(alive, cols["waiting"], cols["running"]),
        "vllm-main": lambda: formulas.pick_vllm_main(alive, cols["waiting"], cols["running"], kv, dp.load),
        "jsq": lambda: formulas.pick_jsq(alive, dp.load),
        "rr": lambda: formulas.pick_round_robin(alive, 0),
    }  # fmt: skip
    print(f"\n{'DP profile':14s} {'p50 µs':>8s} {'p99 µs':>8s}  {'formula p50':>11s}  (D = {d})")
    for name in DP_PROFILES:
        profile, dp_state = dp_profile(name, params), RouterState.seeded(0)
        p50, p99 = percentiles(lambda i, p=profile, s=dp_state: p(dp, query, s, no_tables), args.n)
        f50, _ = percentiles(lambda i, f=hand_written[name]: f(), args.n)
        print(f"{name:14s} {p50:8.1f} {p99:8.1f}  {f50:11.1f}")


if __name__ == "__main__":
    main()
