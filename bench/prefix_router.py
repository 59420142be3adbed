"""The router's prefix index, in process (issue 25, item 6's budgets; bench figures, not timed tests).

1. KV events applied per second: encoded `KvEvents` (stored and removed ops, `--keys-per-message` keys each)
   decoded and applied by `RouterCore.on_kv`, as the router's subscription does (budget ≥ 100,000 block events/s).
2. A keyed `sy.route.dp` decision (`RouterCore.route_dp`, profile `switchyard`, precise index) for a prompt of
   `--tokens` over `--engines` DP engines, engine i holding the prompt's first i/engines of its blocks; the
   lookup alone (`PrefixState.cached`: longest match × block size); and the same decision without keys
   (budget: lookup ≤ 50 µs p50 at 8K tokens over 64 engines).
3. Memory of the precise index per block (tracemalloc over `--memory-blocks` distinct blocks on 64 engines),
   and so at 10 M blocks (budget ≤ 2 GiB).

Run: `.venv/bin/python bench/prefix_router.py [--tokens 1024,8192] [--engines 64]`.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from switchyard.services.router.core import RouterCore
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.codec import decode, encode
from switchyard.shared.prefix_keys import block_keys
from switchyard.shared.schemas import Capacity, Hello, KvEvents, KvOp, ModelShape, RouteDpRequest, Telemetry
from switchyard.solver.routing.prefix import BlockIndex

BLOCK = 16


def _core(engines: int, **settings: object) -> tuple[RouterCore, list[str]]:
    core = RouterCore(RouterSettings(dp_profile="switchyard", **settings))  # type: ignore[arg-type]
    shape = ModelShape(name="m", num_layers=2, num_experts=8, top_k=2)
    ids = [f"dp-{i:03d}" for i in range(engines)]
    now = time.monotonic()
    for i, engine_id in enumerate(ids):
        capacity = Capacity(max_running=256, kv_blocks=100_000, block_size=BLOCK)
        hello = Hello(
            engine_id=engine_id, role="dp", model=shape, ep_group=engine_id, gpus=["0"], capacity=capacity, ts=0.0,
            agent="sim", hello_interval_s=60.0, telemetry_interval_s=60.0,
        )  # fmt: skip
        core.on_hello(hello, now)
        core.on_telemetry(
            Telemetry(
                engine_id=engine_id, seq=0, ts=0.0, kv_usage=0.2, num_running=i % 3, num_waiting=0,
                waiting_prefill_tokens=0, remaining_prefill_tokens=100 * (i % 4), step_time_ema=0.01,
            ),
            now,
        )  # fmt: skip
    return core, ids


def ingest(messages: int, keys_per_message: int) -> float:
    """Block events applied per second, decode included."""
    core, ids = _core(1)
    rng = np.random.default_rng(1)
    payloads, total, previous = [], 0, None
    for seq in range(messages):
        keys = rng.integers(1, 2**63, size=keys_per_message, dtype=np.uint64)
        ops = [KvOp(kind="stored", keys=keys)]
        if previous is not None:  # evict half of the previous message's blocks
            ops.append(KvOp(kind="removed", keys=previous[: keys_per_message // 2]))
        previous = keys
        total += sum(len(op.keys) for op in ops)
        payloads.append(encode(KvEvents(engine_id=ids[0], seq=seq, ts=0.0, block_size=BLOCK, ops=ops)))
    now = time.monotonic()
    t0 = time.perf_counter()
    for data in payloads:
        assert core.on_kv(decode(data, KvEvents, 1 << 24), now) is None
    return total / (time.perf_counter() - t0)


def lookup(tokens: int, engines: int, n: int) -> dict[str, tuple[float, float]]:
    """p50 and p99 in µs: the keyed decision, the lookup alone, the decision without keys."""
    core, ids = _core(engines)
    keys = block_keys(np.arange(tokens) % 50_000, BLOCK)
    now = time.monotonic()
    for i, engine_id in enumerate(ids):
        held = keys[: len(keys) * i // engines]
        core.on_kv(
            KvEvents(engine_id=engine_id, seq=0, ts=0.0, block_size=BLOCK, ops=[KvOp(kind="stored", keys=held)]), now
        )
    out: dict[str, tuple[float, float]] = {}
    for name, with_keys in (("decision, keyed", True), ("decision, no keys", False)):
        times = np.empty(n)
        for i in range(n):
            request = RouteDpRequest(request_id=f"r{i}", prompt_tokens=tokens, block_keys=keys if with_keys else None)
            t0 = time.perf_counter_ns()
            core.route_dp(request, now)
            times[i] = time.perf_counter_ns() - t0
        out[name] = tuple(float(v) for v in np.percentile(times, [50, 99]) / 1e3)  # type: ignore[assignment]
    snap = core.dp.snap
    block_size = core.fleet.block_size[core.dp.rows]
    request = RouteDpRequest(request_id="r", prompt_tokens=tokens, block_keys=keys)
    times = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter_ns()
        core.prefix.cached(request, snap.engine_ids, block_size, now)
        times[i] = time.perf_counter_ns() - t0
    out["lookup alone"] = tuple(float(v) for v in np.percentile(times, [50, 99]) / 1e3)  # type: ignore[assignment]
    return out


def memory(blocks: int, engines: int = 64) -> float:
    """Bytes of index per block held (distinct keys, spread over `engines`)."""
    rng = np.random.default_rng(2)
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    index = BlockIndex()
    per = blocks // engines
    for e in range(engines):
        index.stored(f"e{e}", rng.integers(1, 2**63, size=per, dtype=np.uint64).tolist())
    used = tracemalloc.get_traced_memory()[0] - start
    tracemalloc.stop()
    return used / (per * engines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--messages", type=int, default=400)
    ap.add_argument("--keys-per-message", type=int, default=512)
    ap.add_argument("--memory-blocks", type=int, default=1_000_000)
    args = ap.parse_args()
    rate = ingest(args.messages, args.keys_per_message)
    print(f"KV events applied: {rate:,.0f} block events/s ({args.keys_per_message} keys a message, decode included)")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, (p50, p99) in lookup(tokens, args.engines, args.n).items():
            print(f"{tokens:6d} tokens, {args.engines} engines, {name:18s} p50 {p50:8.1f} µs  p99 {p99:8.1f} µs")
    per_block = memory(args.memory_blocks)
    print(f"precise index: {per_block:.0f} bytes a block, {per_block * 10e6 / 2**30:.2f} GiB at 10 M blocks")


if __name__ == "__main__":
    main()
