"""Discrete-event simulation of a prefill/decode-disaggregated (xPyD) MoE fleet.

A request arrives, is prefilled on one of P prefill engines (round robin or prefix hash), and at the end
of its prefill the decode policy (`solver.routing`) picks one of D decode engines from a snapshot of the
fleet; its KV cache then crosses the link (bytes / bandwidth) and it joins that engine's waiting queue.
Decode engines run continuous batching (`simulator.core.xpyd_engines`); each decode step replays the current
decode token of every running request from a real routing trace, so its cost follows the distinct experts
the batch selects.

Events: prefill-step end, KV arrival at a decoder, decode-step end (arrivals are merged from the sorted
workload). The snapshot's load is exact: requests routed to an engine and not finished (in transfer,
waiting, running), which is what a proxy router counting its outstanding requests sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from switchyard.shared.streams import stream
from switchyard.simulator.core.defaults import DECODE_MAX_RUNNING, TOKEN_BUDGET
from switchyard.simulator.core.experts import ReplayBank, rank_masks
from switchyard.simulator.core.loop import ARRIVAL, EventLoop
from switchyard.simulator.core.physics import CostModel
from switchyard.simulator.core.prefix_cache import hits_per_request, prompt_keys
from switchyard.simulator.core.workload import Workload
from switchyard.simulator.core.xpyd_engines import DecodeEngine, PrefillEngine
from switchyard.solver.routing import DecodePolicy, FleetSnapshot, RouteQuery, RouterState, RoutingTables

__all__ = ["FleetConfig", "SimResult", "simulate"]

_PREFILL_END, _KV_ARRIVED, _DECODE_END = 0, 1, 2


@dataclass(frozen=True)
class FleetConfig:
    """An xPyD fleet: P prefill and D decode engines of one `CostModel` (model on GPUs)."""

    prefill: int
    decode: int
    cost: CostModel
    max_running: int = DECODE_MAX_RUNNING
    kv_blocks: int | None = None  # per decode engine; default: what fits beside the weights
    prefill_token_budget: int = TOKEN_BUDGET
    prefill_policy: str = "rr"  # "rr" | "hash" (prefix hash of the replayed trace request)
    #: vLLM's automatic prefix caching on the prefill engines; it acts only on traces that carry `hash_ids`.
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("need at least one prefill and one decode engine")
        if self.prefill_policy not in ("rr", "hash"):
            raise ValueError("prefill_policy is 'rr' or 'hash'")

    @property
    def decode_kv_blocks(self) -> int:
        return int(self.kv_blocks if self.kv_blocks is not None else self.cost.kv_capacity_blocks)

    @property
    def label(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass
class SimResult:
    """Per-request times and placements, per-step records, per-engine counters."""

    policy: str
    fleet: FleetConfig
    workload: Workload
    arrival: np.ndarray
    prefill_engine: np.ndarray
    prefill_done: np.ndarray
    decode_engine: np.ndarray
    decode_ready: np.ndarray  # KV arrived at the decoder
    first_token: np.ndarray
    finish: np.ndarray
    tokens: np.ndarray  # output tokens each request generated, as its engine counted them
    band_size: np.ndarray
    fallbacks: dict[str, int]
    # one row per decode step: engine, start time, duration, batch, mean distinct experts over layers
    step_engine: np.ndarray
    step_start: np.ndarray
    step_duration: np.ndarray
    step_batch: np.ndarray
    step_distinct: np.ndarray
    engine_tokens: np.ndarray  # [D] tokens generated per decode engine
    engine_busy: np.ndarray  # [D] seconds busy
    engine_preemptions: np.ndarray  # [D]
    prefill_busy: np.ndarray  # [P]
    max_kv_blocks_used: np.ndarray  # [D] high-water mark
    makespan: float
    extra: dict[str, object] = field(default_factory=dict)
    #: [P] prompt tokens each prefill engine looked up in its prefix cache, and found there (0 without caching)
    prefill_prefix_query_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    prefill_prefix_hit_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: [N] prompt tokens each request found cached at its first admission
    prefix_hit: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefill engines' prefix caches over those looked up (0 if none)."""
        q = int(self.prefill_prefix_query_tokens.sum())
        return int(self.prefill_prefix_hit_tokens.sum()) / q if q else 0.0


def simulate(
    workload: Workload,
    bank: ReplayBank,
    fleet: FleetConfig,
    policy: DecodePolicy,
    tables: RoutingTables | None = None,
    sims: np.ndarray | None = None,
    seed: int = 0,
    progress: bool = False,
    check: bool = False,
) -> SimResult:
    """Run the workload through the fleet under one decode policy.

    `sims[R, K]`: each bank request's similarity to the ELDR centroids (ELDR policies); `tables`: the
    routing tables for the decode engines (centroid members, domain partition). `check` asserts the
    engines' invariants after every event (slow; for tests).
    """
    n = workload.size
    cost = fleet.cost
    tables = tables or RoutingTables()
    prefix_block = workload.hash_block if fleet.prefix_caching and workload.hash_ids is not None else None
    decoders, prefills = _engines(fleet, bank, prefix_block)
    keys = prompt_keys(workload.hash_ids, workload.prompt, prefix_block)
    snap = FleetSnapshot.build([f"d{i:03d}" for i in range(fleet.decode)])
    state = RouterState(rng=stream(seed, "router"))  # never the workload's stream (shared.streams)
    layers = bank.num_layers

    arrival = workload.arrival
    prompt = workload.prompt
    output = workload.output
    replay = workload.replay
    xfer = np.asarray(cost.kv_transfer_time(prompt), dtype=np.float64)
    pre_eng = np.full(n, -1, dtype=np.int64)
    pre_done = np.full(n, np.nan)
    dec_eng = np.full(n, -1, dtype=np.int64)
    dec_ready = np.full(n, np.nan)
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    tokens = np.zeros(n, dtype=np.int64)
    band = np.zeros(n, dtype=np.int64)
    fallbacks: dict[str, int] = {}
    steps: list[tuple[int, float, float, int, float]] = []
    max_used = np.zeros(fleet.decode, dtype=np.int64)

    loop = EventLoop()
    arrivals = 0  # so far: round robin over the prefill engines

    def start_prefill(p: int, t: float) -> None:
        plan = prefills[p].begin_step()
        if plan is not None:
            loop.push(t + plan.duration, _PREFILL_END, p)

    def start_decode(d: int, t: float) -> None:
        eng = decoders[d]
        plan = eng.begin_step()
        if plan is not None:
            steps.append((d, t, plan.duration, plan.batch, plan.distinct_sum / layers))
            max_used[d] = max(max_used[d], eng.used_blocks)
            loop.push(t + plan.duration, _DECODE_END, d)

    bar = _progress_bar(n, f"{policy.name} {fleet.label}") if progress else None
    finished = 0
    now = 0.0
    for now, kind, idx in loop.events(arrival):
        if kind == ARRIVAL:
            rid = idx
            p = _prefill_engine(fleet, arrivals, int(bank.request_ids[replay[rid]]))
            arrivals += 1
            pre_eng[rid] = p
            prefills[p].add(rid, int(replay[rid]), int(prompt[rid]), keys[rid] if keys else None)
            if not prefills[p].busy:
                start_prefill(p, now)
        elif kind == _DECODE_END:
            eng = decoders[idx]
            out = eng.end_step()
            if out.first:
                first[out.first] = now
            if out.finished:
                finish[out.finished] = now
                tokens[out.finished] = out.finished_tokens
                snap.load[idx] -= len(out.finished)
                finished += len(out.finished)
                if bar is not None:
                    bar.update(len(out.finished))
            start_decode(idx, now)
            snap.kv_usage[idx] = eng.kv_usage
        elif kind == _PREFILL_END:
            for rid in prefills[idx].end_step():
                pre_done[rid] = now
                decision = policy(snap, _route_query(bank, sims, int(replay[rid]), int(prompt[rid])), state, tables)
                d = decision.index
                dec_eng[rid] = d
                band[rid] = decision.band_size
                if decision.fallback:
                    fallbacks[decision.fallback] = fallbacks.get(decision.fallback, 0) + 1
                snap.load[d] += 1
                loop.push(now + xfer[rid], _KV_ARRIVED, int(rid))
            start_prefill(idx, now)
        else:  # KV arrived at the decoder
            rid = idx
            d = int(dec_eng[rid])
            dec_ready[rid] = now
            decoders[d].add(rid, int(replay[rid]), int(prompt[rid]), int(output[rid]))
            if not decoders[d].busy:
                start_decode(d, now)
        if check:
            _check_invariants(decoders, snap, dec_eng, finish)
            _check_prefills(prefills)
        if finished >= n:
            break
    if bar is not None:
        bar.close()

    return SimResult(
        policy=policy.name,
        fleet=fleet,
        workload=workload,
        arrival=arrival.copy(),
        prefill_engine=pre_eng,
        prefill_done=pre_done,
        decode_engine=dec_eng,
        decode_ready=dec_ready,
        first_token=first,
        finish=finish,
        tokens=tokens,
        band_size=band,
        fallbacks=fallbacks,
        **_step_columns(steps),
        **_engine_totals(decoders, prefills),
        max_kv_blocks_used=max_used,
        makespan=now - float(arrival[0]),
        prefill_prefix_query_tokens=np.array([p.prefix_query_tokens for p in prefills], dtype=np.int64),
        prefill_prefix_hit_tokens=np.array([p.prefix_hit_tokens for p in prefills], dtype=np.int64),
        prefix_hit=hits_per_request((e.prefix_hits for e in prefills), n),
    )


def _prefill_engine(fleet: FleetConfig, arrivals: int, trace_request_id: int) -> int:
    """The prefill engine for an arrival: round robin (`arrivals` before it), or a hash of the replayed trace
    request (the same request, the same engine)."""
    if fleet.prefill_policy == "rr":
        return arrivals % fleet.prefill
    return (trace_request_id * 2654435761 % 2**32) % fleet.prefill


def _route_query(bank: ReplayBank, sims: np.ndarray | None, r: int, prompt_tokens: int) -> RouteQuery:
    """What the decode policy is told of bank request `r` at the end of its prefill (its ELDR similarities,
    its domain label, its prompt length)."""
    lab = int(bank.labels[r])
    return RouteQuery(
        sims=None if sims is None else sims[r],
        label=bank.label_names[lab] if lab >= 0 else None,
        prompt_tokens=prompt_tokens,
    )


def _progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar over requests (imported only when asked for: tqdm is slow to import)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, mininterval=0.5)


def _engines(
    fleet: FleetConfig, bank: ReplayBank, prefix_block: int | None = None
) -> tuple[list[DecodeEngine], list[PrefillEngine]]:
    """The fleet's decode and prefill engines, fresh."""
    cost = fleet.cost
    # Expert parallelism inside an engine: each MoE layer waits for the rank that loads the most experts.
    masks = rank_masks(bank.num_layers, bank.num_experts, cost.gpus) if cost.gpus > 1 else None
    decoders = [
        DecodeEngine(cost, bank, max_running=fleet.max_running, kv_blocks=fleet.decode_kv_blocks, rank_masks=masks)
        for _ in range(fleet.decode)
    ]
    prefills = [
        PrefillEngine(cost, bank, token_budget=fleet.prefill_token_budget, rank_masks=masks, prefix_block=prefix_block)
        for _ in range(fleet.prefill)
    ]
    return decoders, prefills


def _step_columns(steps: list[tuple[int, float, float, int, float]]) -> dict[str, np.ndarray]:
    """The decode steps' log as `SimResult`'s step columns."""
    st = np.array(steps, dtype=np.float64).reshape(-1, 5)
    return {
        "step_engine": st[:, 0].astype(np.int64),
        "step_start": st[:, 1],
        "step_duration": st[:, 2],
        "step_batch": st[:, 3].astype(np.int64),
        "step_distinct": st[:, 4],
    }


def _engine_totals(decoders: list[DecodeEngine], prefills: list[PrefillEngine]) -> dict[str, np.ndarray]:
    """Per-engine totals at the end of a run, as `SimResult`'s engine columns."""
    return {
        "engine_tokens": np.array([e.tokens_out for e in decoders], dtype=np.int64),
        "engine_busy": np.array([e.busy_time for e in decoders]),
        "engine_preemptions": np.array([e.preemptions for e in decoders], dtype=np.int64),
        "prefill_busy": np.array([p.busy_time for p in prefills]),
    }


def _check_prefills(prefills: list[PrefillEngine]) -> None:
    """A prefill engine's prefix cache keeps every block it does not hold in its free queue."""
    for i, pe in enumerate(prefills):
        assert pe.prefix is None or pe.prefix.free_blocks == pe.kv_blocks - pe.used_blocks, f"prefill {i}"


def _check_invariants(
    decoders: list[DecodeEngine], snap: FleetSnapshot, dec_eng: np.ndarray, finish: np.ndarray
) -> None:
    """Every request is on at most one engine, on the one it was routed to; KV never over capacity."""
    seen: set[int] = set()
    for d, eng in enumerate(decoders):
        ids = [*eng.running_ids().tolist(), *eng.waiting_ids()]
        assert len(set(ids)) == len(ids), f"engine {d} holds a request twice"
        assert not seen.intersection(ids), f"a request is on two engines ({d})"
        seen.update(ids)
        assert all(dec_eng[r] == d for r in ids), f"engine {d} holds a request routed elsewhere"
        assert not np.isfinite(finish[ids]).any() if ids else True, "a finished request is still on an engine"
        assert 0 <= eng.used_blocks <= eng.kv_blocks, f"engine {d} KV {eng.used_blocks}/{eng.kv_blocks}"
        assert eng.used_blocks == eng.blocks_held(), f"engine {d} KV accounting drifted"
        assert snap.load[d] >= len(ids), "snapshot load misses requests"
