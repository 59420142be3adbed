"""Cost of the prefix indexes (`solver.routing.prefix`), as figures against issue 25's budgets (not timed tests):

(a) lookup: `BlockIndex.match` of an 8K-token prompt (512 keys of 16 tokens) over 64 engines, p50/p99, in three
    cases (a full hit on one engine; a 2K-token system prompt shared by every engine, the rest a miss; a miss),
    with every engine also holding `--background` unrelated blocks; budget ≤ 50 µs p50. The same for
    `RoutedIndex.match`, and the key hashing (`shared.prefix_keys.block_keys`) beside it.
(b) memory at `--blocks` blocks (default 10 M: `--engines` engines of equal share, distinct keys): the process's
    RSS growth while the index is built, and per block; budget ≤ 2 GiB. Built in full, not extrapolated.
(c) event apply rate: block events/s through `BlockIndex.stored` (batches of `--batch` keys, as vLLM's
    `BlockStored` carries a request's new blocks) and `BlockIndex.removed`, on an index already at its
    per-engine bound (so every store also evicts); budget ≥ 100,000 events/s per router.

Run: `.venv/bin/python bench/prefix_index.py [--json PATH]` (`--blocks 1000000` for a quick look).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import _single_core  # before numpy: one BLAS thread; and the machine line
import numpy as np

from switchyard.shared.prefix_keys import block_keys
from switchyard.solver.routing.prefix import BlockIndex, RoutedIndex

BLOCK = 16


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def timed(call, n: int) -> tuple[float, float]:
    """p50, p99 in µs of `n` calls (after a warm-up)."""
    for _ in range(min(n, 50)):
        call()
    samples = np.empty(n)
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        call()
        samples[i] = clock() - t0
    return float(np.percentile(samples, 50)) / 1e3, float(np.percentile(samples, 99)) / 1e3


def lookup(args: argparse.Namespace) -> dict[str, object]:
    rng = np.random.default_rng(1)
    engines = [f"engine-{i:03d}" for i in range(args.engines)]
    prompt = rng.integers(0, 150_000, 8192)
    keys = block_keys(prompt, BLOCK)
    system = block_keys(prompt[:2048], BLOCK)
    assert len(keys) == 512 and len(system) == 128
    background = rng.integers(1, 2**63, size=(args.engines, args.background), dtype=np.uint64)

    def index_for(case: str) -> tuple[BlockIndex, RoutedIndex]:
        index, routed = BlockIndex(), RoutedIndex(max_blocks=args.background + 1024)
        for e, extra in zip(engines, background, strict=True):
            index.stored(e, extra)
            routed.routed(e, extra, 0.0)
        if case == "full hit on one engine":
            index.stored(engines[7], keys)
            routed.routed(engines[7], keys, 0.0)
        elif case == "2K system prompt on all":
            for e in engines:
                index.stored(e, system)
                routed.routed(e, system, 0.0)
        return index, routed

    out: dict[str, object] = {}
    for case in ("full hit on one engine", "2K system prompt on all", "miss"):
        index, routed = index_for(case)
        got = index.match(keys, engines)
        expect = {"full hit on one engine": 512 * (np.arange(args.engines) == 7), "miss": 0}.get(case, 128)
        assert np.array_equal(got, np.broadcast_to(expect, got.shape)), (case, got)
        p50, p99 = timed(lambda index=index: index.match(keys, engines), args.n)
        r50, r99 = timed(lambda routed=routed: routed.match(keys, engines), args.n)
        out[case] = {"block_index_p50_us": p50, "block_index_p99_us": p99, "routed_p50_us": r50, "routed_p99_us": r99}
        del index, routed
        gc.collect()
    h50, h99 = timed(lambda: block_keys(prompt, BLOCK), args.n)
    out["block_keys 8K tokens"] = {"p50_us": h50, "p99_us": h99}
    return out


def memory(args: argparse.Namespace) -> dict[str, object]:
    gc.collect()
    per_engine = args.blocks // args.engines
    before = rss_bytes()
    index = BlockIndex(max_blocks=per_engine)
    rng = np.random.default_rng(2)
    t0 = time.perf_counter()
    for i in range(args.engines):
        keys = rng.integers(1, 2**63, size=per_engine, dtype=np.uint64)
        for start in range(0, per_engine, 4096):
            index.stored(f"engine-{i:03d}", keys[start : start + 4096])
    built_s = time.perf_counter() - t0
    gc.collect()
    grown = rss_bytes() - before
    blocks = len(index)
    assert blocks == per_engine * args.engines
    del index
    gc.collect()
    return {
        "blocks": blocks,
        "engines": args.engines,
        "rss_growth_bytes": grown,
        "rss_growth_gib": grown / 2**30,
        "bytes_per_block": grown / blocks,
        "build_s": built_s,
        "extrapolated": False,
    }


def apply_rate(args: argparse.Namespace) -> dict[str, object]:
    rng = np.random.default_rng(3)
    cap = args.apply_cap
    index = BlockIndex(max_blocks=cap)
    engines = [f"engine-{i:03d}" for i in range(args.engines)]
    for e in engines:  # every engine at its bound: each further store evicts its oldest block
        index.stored(e, rng.integers(1, 2**63, size=cap, dtype=np.uint64))
    events = args.events
    batches = rng.integers(1, 2**63, size=(events // args.batch, args.batch), dtype=np.uint64)
    owners = rng.integers(0, len(engines), len(batches))
    t0 = time.perf_counter()
    c0 = time.process_time()
    for batch, owner in zip(batches, owners, strict=True):
        index.stored(engines[owner], batch)
    stored_s, stored_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    c0 = time.process_time()
    for batch, owner in zip(batches, owners, strict=True):
        index.removed(engines[owner], batch)
    removed_s, removed_cpu = time.perf_counter() - t0, time.process_time() - c0
    n = len(batches) * args.batch
    return {
        "events": n,
        "batch": args.batch,
        "per_engine_bound": cap,
        "stored_events_per_s": n / stored_s,
        "stored_events_per_cpu_s": n / stored_cpu,
        "removed_events_per_s": n / removed_s,
        "removed_events_per_cpu_s": n / removed_cpu,
        "dropped_over_cap": index.dropped_over_cap,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--background", type=int, default=20_000, help="unrelated blocks per engine (lookup)")
    parser.add_argument("--n", type=int, default=5000, help="timed lookups per case")
    parser.add_argument("--blocks", type=int, default=10_000_000, help="index size for the memory figure")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=16, help="keys per stored/removed event message")
    parser.add_argument("--apply-cap", type=int, default=20_000, help="per-engine bound in the apply run")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()

    result: dict[str, object] = {"machine": _single_core.machine()}
    print(result["machine"])
    result["lookup"] = lookup(args)
    print(f"\n(a) lookup, 512 keys over {args.engines} engines (budget ≤ 50 µs p50)")
    print(f"{'case':28s} {'Block p50':>10s} {'p99':>8s} {'Routed p50':>11s} {'p99':>8s}")
    for case, fig in result["lookup"].items():  # type: ignore[union-attr]
        if "p50_us" in fig:
            print(f"{case:28s} {fig['p50_us']:10.1f} {fig['p99_us']:8.1f}")
        else:
            print(
                f"{case:28s} {fig['block_index_p50_us']:10.1f} {fig['block_index_p99_us']:8.1f}"
                f" {fig['routed_p50_us']:11.1f} {fig['routed_p99_us']:8.1f}"
            )
    result["apply"] = apply = apply_rate(args)
    print(f"\n(c) event apply, batches of {args.batch} keys (budget ≥ 100,000 block events/s)")
    print(
        f"stored {apply['stored_events_per_s']:,.0f}/s ({apply['stored_events_per_cpu_s']:,.0f}/CPU-s)   "
        f"removed {apply['removed_events_per_s']:,.0f}/s ({apply['removed_events_per_cpu_s']:,.0f}/CPU-s)"
    )
    if not args.skip_memory:
        result["memory"] = mem = memory(args)
        print(f"\n(b) memory at {mem['blocks']:,} blocks over {args.engines} engines (budget ≤ 2 GiB)")
        grown, per_block = mem["rss_growth_gib"], mem["bytes_per_block"]
        print(f"RSS growth {grown:.2f} GiB, {per_block:.0f} B/block, built in {mem['build_s']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
