"""Routing decision time, in process: every decode policy of `solver.routing` at K = D = 32 decoders, ELDR's
composition without its fused kernel, and every DP profile beside the hand-written formula it composes
(`solver.routing.dispatch.pick_*`), on the same columns.

Budget (DESIGN.md): ≤ 20 µs median per decision. Similarities are given (the router computes them with
`solver.scoring` once per request; that cost is the ELDR fit's benchmark). The last table is a whole
`sy.route.dp` decision in the router's core (`RouterCore.route_dp`: fleet view, profile, bookkeeping, reply;
no bus) over `--router-dp` engines reporting every 25 decisions.

`--gap-ms` sleeps before each timed call, so every decision finds the caches cold, as a router woken by each
request of a gateway does (the figure the gateway's added latency sees; back to back is the best case). Run:
`.venv/bin/python bench/bench_routing.py [--decoders 32] [--n 20000]`, and cold:
`.venv/bin/python bench/bench_routing.py --gap-ms 4 --n 1000`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from switchyard.services.router.core import RouterCore
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.schemas import Capacity, Hello, ModelShape, RouteDpRequest, Telemetry
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


def percentiles(call: Callable[[int], object], n: int, gap_s: float = 0.0) -> tuple[float, float]:
    """p50 and p99 of `call(i)` in µs over `n` calls, each after `gap_s` idle."""
    times = np.empty(n)
    for i in range(n):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter_ns()
        call(i)
        times[i] = time.perf_counter_ns() - t0
    p50, p99 = np.percentile(times, [50, 99]) / 1e3
    return float(p50), float(p99)


def timed_route_dp(engines: int, n: int, gap_s: float) -> tuple[float, float]:
    """p50 and p99 of `RouterCore.route_dp` in µs (default settings: profile gimbal) over `engines` DP engines
    serving model "m"; before every 25th decision one engine reports (untimed, before the gap), as telemetry
    every 100 ms among requests every 4 ms would. Each request is built right before its decision (untimed),
    as the service decodes it: a request object long out of the caches would add ~40 µs cold."""
    core = RouterCore(RouterSettings())
    shape = ModelShape(name="m", num_layers=2, num_experts=8, top_k=2)
    capacity = Capacity(max_running=32, kv_blocks=100, block_size=16)
    ids = [f"dp-{i:03d}" for i in range(engines)]
    seq = dict.fromkeys(ids, 0)

    def report(engine_id: str) -> None:
        k = seq[engine_id] = seq[engine_id] + 1
        core.on_telemetry(
            Telemetry(
                engine_id=engine_id, seq=k, ts=0.0, kv_usage=0.1 * (k % 5), num_running=k % 3, num_waiting=0,
                waiting_prefill_tokens=0, remaining_prefill_tokens=100 * (k % 4), step_time_ema=0.01,
            ),
            time.monotonic(),
        )  # fmt: skip

    for engine_id in ids:
        hello = Hello(
            engine_id=engine_id, role="dp", model=shape, ep_group=engine_id, gpus=["0"], capacity=capacity, ts=0.0,
            agent="sim",
        )  # fmt: skip
        core.on_hello(hello, time.monotonic())
        report(engine_id)
    times = np.empty(n)
    for i in range(n):
        if i % 25 == 0:
            report(ids[(i // 25) % engines])
        if gap_s:
            time.sleep(gap_s)
        request = RouteDpRequest(request_id=f"r{i}", prompt_tokens=90 + i % 7, model="m")  # just decoded
        t0 = time.perf_counter_ns()
        routed = core.route_dp(request, time.monotonic())
        times[i] = time.perf_counter_ns() - t0
        assert routed.decision is not None, routed.reply
    p50, p99 = np.percentile(times, [50, 99]) / 1e3
    return float(p50), float(p99)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--decoders", type=int, default=32)
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each timed call (cold caches)")
    ap.add_argument("--router-dp", default="1,32", help="DP engine counts behind RouterCore.route_dp")
    args = ap.parse_args()
    gap_s = args.gap_ms / 1e3
    print(f"{args.gap_ms:g} ms idle before each timed call" if gap_s else "back to back (warm)")
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
        p50, p99 = percentiles(lambda i, p=policy: p(snap, queries[i & 255], state, tables), args.n, gap_s)
        print(f"{name:14s} {p50:8.1f} {p99:8.1f}  {'OK' if p50 <= 20 else 'OVER'}")
    compose = decode_profile("eldr").compose
    p50, p99 = percentiles(lambda i: compose(snap, queries[i & 255], state, tables), args.n, gap_s)
    print(f"{'eldr, composed':14s} {p50:8.1f} {p99:8.1f}  (filters + scorer + picker, no fused kernel)")

    cols = {
        name: rng.integers(0, 4000, d).astype(np.float64)
        for name in (
            "remaining_prefill", "waiting_prefill", "inflight_tokens", "waiting", "running", "pending_prefill",
            "pending", "decoding", "recent_sends",
        )
    }  # fmt: skip
    cols["expert_pressure"] = 1.0 + rng.random(d)
    cols["kv_blocks"] = np.full(d, 20_000.0)  # dynamo's decode blocks
    cols["indexed_blocks"] = rng.integers(0, 100_000, d).astype(np.float64)  # sglang-cache's tree size
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
        p50, p99 = percentiles(lambda i, p=profile, s=dp_state: p(dp, query, s, no_tables), args.n, gap_s)
        formula = hand_written.get(name)  # the prefix-aware profiles have no hand-written formula
        f50 = percentiles(lambda i, f=formula: f(), args.n, gap_s)[0] if formula else float("nan")
        print(f"{name:14s} {p50:8.1f} {p99:8.1f}  {f50:11.1f}")

    print(f"\n{'router core':14s} {'p50 µs':>8s} {'p99 µs':>8s}  (RouterCore.route_dp, profile gimbal)")
    for engines in map(int, args.router_dp.split(",")):
        p50, p99 = timed_route_dp(engines, args.n, gap_s)
        print(f"{f'route_dp D={engines}':14s} {p50:8.1f} {p99:8.1f}")


if __name__ == "__main__":
    main()
