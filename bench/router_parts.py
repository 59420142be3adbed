"""The router's request path piece by piece, in process: what each step costs per request.

Each piece is timed with timeit, best of 7 repeats, twice: back to back ("warm", the textbook figure) and with
2 MB of unrelated memory written between calls ("cold": the caches evicted, as in a router that sleeps in
epoll between requests while the client and the server run on the same cores). ESFT request (26 × 64 uint16
signature), artifact fitted on ESFT with K = 16 decoders, plus the budget's shape (48 × 128, K = 32, synthetic
counts from bench/eldr_data.py) for scoring and the policy.

It also runs against the tree before the router optimisations of docs/router.md (commit cd19426), timing the
older equivalents where an API changed (metric `.labels()` per call; one `RouteDecision` built and encoded
per decision; the snapshot re-read on every request), so the two columns of docs/router.md come from the
same script:

    .venv/bin/python bench/router_parts.py
    git archive cd19426 | tar -x -C /tmp/before && cp bench/router_parts.py /tmp/before/bench/ && \\
        (cd /tmp/before && PYTHONPATH=/tmp/before ../path/to/.venv/bin/python bench/router_parts.py)
"""

from __future__ import annotations

import time
import timeit
from collections.abc import Callable

import _single_core
import numpy as np
from eldr_data import esft_counts, synthetic_counts

from switchyard.services.router import metrics
from switchyard.services.router.core import RouterCore
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.codec import decode, encode
from switchyard.shared.schemas import Capacity, Hello, RouteDecodeReply, RouteDecodeRequest
from switchyard.solver.eldr_fit import fit_routing_artifact
from switchyard.solver.routing import FleetSnapshot, RouteQuery, RouterState, RoutingTables, get_policy
from switchyard.solver.scoring import SignatureScorer

_JUNK = np.zeros(2_000_000 // 8)


def _evict() -> None:
    _JUNK.__iadd__(1.0)


def timed(name: str, fn: Callable[[], object], n: int = 3000) -> None:
    warm = min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6
    cold = []
    for _ in range(n // 3):
        _evict()
        start = time.perf_counter_ns()
        fn()
        cold.append(time.perf_counter_ns() - start)
    print(f"  {name:58s} {warm:7.2f} µs warm {np.median(cold) / 1e3:7.2f} µs cold")


def main() -> None:
    print(_single_core.machine())
    esft = esft_counts()
    synthetic = synthetic_counts(1000, 48, seed=0)
    signature = esft.prefill[7].astype(np.uint16)
    data = encode(RouteDecodeRequest(request_id="esft-0007", prompt_tokens=1000, signature=signature))
    fields = dict(request_id="esft-0007", engine_id="decode-07", policy="eldr", band_size=6, decision_us=12.3)
    reply = RouteDecodeReply(**fields, artifact_version=1)
    print("bus layer (shared.codec, as Bus.serve runs it)")
    timed("decode a RouteDecodeRequest (ESFT 26 x 64 uint16)", lambda: decode(data, RouteDecodeRequest))
    timed("build a RouteDecodeReply", lambda: RouteDecodeReply(**fields, artifact_version=1))
    timed("encode a RouteDecodeReply", lambda: encode(reply))
    print("decision (solver)")
    for label, counts, k in (("ESFT, K = 16", esft, 16), ("48 x 128, K = 32", synthetic, 32)):
        artifact, _ = fit_routing_artifact(counts, k)
        scorer = SignatureScorer.from_artifact(artifact)
        sig = counts.prefill[3].astype(np.uint16)
        timed(f"SignatureScorer.similarities, {label}", lambda scorer=scorer, sig=sig: scorer.similarities(sig))
        ids = [f"decode-{i:03d}" for i in range(k)]
        rng = np.random.default_rng(0)
        snap = FleetSnapshot.build(ids, load={e: float(rng.integers(0, 8)) for e in ids})
        tables = RoutingTables.build(snap.engine_ids, num_centroids=k, tau=0.1)
        queries = [RouteQuery(sims=scorer.similarities(counts.prefill[i].astype(np.uint16))) for i in range(64)]
        policy, state, calls = get_policy("eldr"), RouterState.seeded(0), iter(range(10**9))
        timed(
            f"eldr policy (band, least-loaded pick), {label}",
            lambda p=policy, s=snap, t=tables, q=queries, st=state, c=calls: p(s, q[next(c) & 63], st, t),
        )
    print("router bookkeeping (services.router)")
    core = RouterCore(RouterSettings(policy="eldr", replica_id="bench"))
    capacity = Capacity(max_running=64, kv_blocks=4096, block_size=16)
    for i in range(16):
        engine = f"decode-{i:02d}"
        hello = Hello(
            engine_id=engine, role="decode", model=artifact.model, ep_group=engine, gpus=["0"], capacity=capacity,
            ts=0.0, agent="sim",
        )  # fmt: skip
        core.on_hello(hello, 10.0)
    core.decode.rebuild()
    timed("decode view refresh, no telemetry since the last", lambda: core.decode.refresh(10.5, 1.0))
    if hasattr(core, "flush_metrics"):  # cached children, batched histograms

        def observe() -> None:
            core._count("decode", "eldr", "")
            core._seconds["decode"].observe(1.2e-5)
            core._band.observe(6)

    else:  # before: label lookups and histogram scans per decision

        def observe() -> None:
            metrics.DECISIONS.labels("decode", "eldr", "").inc()
            metrics.DECISION_SECONDS.labels("decode").observe(1.2e-5)
            metrics.BAND_SIZE.observe(6)

    timed("metrics of one decision", observe)
    try:
        from switchyard.shared.codec import encode_unchecked
        from switchyard.shared.schemas import RouteDecisions

        batch = [("decode", f"esft-{i:04d}", "decode-07", 1000) for i in range(10)]

        def share() -> bytes:
            kinds, request_ids, engine_ids, tokens = zip(*batch, strict=True)
            columns = {"kinds": kinds, "request_ids": request_ids, "engine_ids": engine_ids, "prompt_tokens": tokens}
            return encode_unchecked(RouteDecisions, {"replica_id": "router-0", **columns})

        timed("share: pack a RouteDecisions of 10 (per batch)", share)
    except ImportError:  # before: one RouteDecision per decision
        from switchyard.shared.schemas import RouteDecision  # type: ignore[attr-defined]

        def share() -> bytes:
            decision = RouteDecision(
                replica_id="router-0", kind="decode", request_id="esft-0007", engine_id="decode-07", prompt_tokens=1000
            )
            return encode(decision)

        timed("share: build and encode one RouteDecision (per decision)", share)


if __name__ == "__main__":
    main()
