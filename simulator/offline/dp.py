"""Discrete-event simulation of a data-parallel (DP) MoE fleet: a dispatcher in front of N aggregated engines.

Every request arrives at the dispatcher, which picks a DP engine with one of the router's DP profiles
(`solver.routing.profiles.dp_profile`, the very objects `sy.route.dp` decides with) from what that rule can
know at that instant; the engine queues it and serves it with chunked prefill and continuous batching
(`dp_engine.MixedEngine`), in FCFS or SJF-with-aging order. A new DP profile runs here as it is named
(`switchyard sim-dp --dispatch <profile>`), provided it reads only columns the dispatcher feeds
(`SIM_COLUMNS`; `Dispatcher` says which view each comes from).

Two deployments:

- `coupled=True` (default; vLLM's DP+EP, the Gimbal seed's DP=2 TP=2 EP=4): experts are spread over all the
  engines' GPUs, so every MoE layer is a collective across DP engines and the engines step in lock-step (an
  engine with nothing to do runs a dummy batch). A step lasts the slowest engine's dense/attention part plus
  the MoE part of all engines' tokens together: their expert union on the busiest EP rank, their compute
  spread over every rank.
- `coupled=False`: independent engines, experts parallel over each engine's own GPUs only.

What each dispatch rule sees, and from which view, is `dp_dispatch`'s (the `Dispatcher`).
"""

from __future__ import annotations

import numpy as np

from switchyard.shared.streams import stream
from switchyard.simulator.core.dp_engine import (
    ORDERS,
    ExpertLoadTables,
    MixedEngine,
    MixedStep,
    QueueOrder,
)
from switchyard.simulator.core.ep import step_cost
from switchyard.simulator.core.experts import ReplayBank
from switchyard.simulator.core.loop import ARRIVAL, EventLoop
from switchyard.simulator.core.placement_control import PlacementControl
from switchyard.simulator.core.placements import make_placement
from switchyard.simulator.core.prefix_cache import hits_per_request, prompt_keys
from switchyard.simulator.core.workload import Workload
from switchyard.simulator.offline.dp_affinity import affinity_feed
from switchyard.simulator.offline.dp_dispatch import SIM_COLUMNS, Dispatcher
from switchyard.simulator.offline.dp_ep import EpRun, migration_price
from switchyard.simulator.offline.dp_fleet import PREFIX_INDEXES, DPFleetConfig, DPSimResult
from switchyard.solver.routing.exact_ledger import ExactLedger
from switchyard.solver.routing.profiles import dp_profile

__all__ = ["PREFIX_INDEXES", "SIM_COLUMNS", "DPFleetConfig", "DPSimResult", "Dispatcher", "simulate_dp"]


_STEP_END, _TELEMETRY, _COORDINATOR = 0, 1, 2
_GLOBAL = -1


def simulate_dp(
    workload: Workload,
    bank: ReplayBank,
    fleet: DPFleetConfig,
    dispatch: str,
    order: QueueOrder = "fcfs",
    seed: int = 0,
    prefill_counts: np.ndarray | None = None,
    check: bool = False,
    control: PlacementControl | None = None,
) -> DPSimResult:
    """Run the workload through the DP fleet under one dispatch rule and one queue order.

    `prefill_counts[R, L, E]`: the bank requests' prefill expert counts (expert pressure; optional).
    `seed` sets the engines' telemetry phases. `check` asserts the fleet's invariants after every event.
    `control`: the placement control to run instead of a fresh `fleet.placement` (which must not be "off").
    """
    n_req = workload.size
    n = fleet.engines
    dc = fleet.dp_cost
    prefix_block = workload.hash_block if fleet.prefix_caching and workload.hash_ids is not None else None
    engines = _engines(fleet, bank, dispatch, order, prefill_counts, prefix_block)
    ep = _ep_run(fleet, bank, prefill_counts, control)
    keys = prompt_keys(workload.hash_ids, workload.prompt, prefix_block)
    disp = _dispatcher(fleet, dispatch, seed, engines, prefix_block)
    disp.affinity = affinity_feed(disp.profile.needs, fleet, prefill_counts, workload.replay, keys, seed)
    predicted = np.full((n_req, 2), -1, dtype=np.int64)  # (precise, approximate) on the chosen engine
    track = disp.prefix_live

    arrival, prompt, output, replay = workload.arrival, workload.prompt, workload.output, workload.replay
    eng_of = np.full(n_req, -1, dtype=np.int64)
    first, finish = np.full(n_req, np.nan), np.full(n_req, np.nan)
    tokens = np.zeros(n_req, dtype=np.int64)
    steps: list[tuple[int, float, float, int, int, int, int, int]] = []

    loop = EventLoop()
    push = loop.push

    t0 = float(arrival[0]) if n_req else 0.0
    _first_reports(loop, disp, fleet, seed, t0)

    global_busy, global_start = False, 0.0
    plans: list[MixedStep | None] = [None] * n

    def record(i: int, t: float, duration: float, plan: MixedStep) -> None:
        e = engines[i]
        steps.append((i, t, duration, plan.tokens, plan.prefill_tokens, plan.decode, e.num_running, e.num_waiting))

    def start_engine(i: int, t: float) -> None:
        plan = engines[i].begin_step(t)
        if plan is not None:
            record(i, t, plan.duration, plan)
            push(t + plan.duration, _STEP_END, i)

    def start_global(t: float) -> None:
        nonlocal global_busy, global_start
        nonmoe, union, total = _begin_lockstep(engines, plans, t)
        if union is None:
            global_busy = False
            return
        # with a placement: experts under the layout in force, the all-to-all, a migration's slowdown (`dp_ep`)
        duration = nonmoe + dc.moe_time(union, total) if ep is None else ep.step_seconds(t, nonmoe, plans, engines)
        for i, p in enumerate(plans):
            if p is not None:
                record(i, t, duration, p)
        global_busy, global_start = True, t
        push(t + duration, _STEP_END, _GLOBAL)

    def finish_engine(i: int, t: float, duration: float | None) -> int:
        out = engines[i].end_step(duration)
        if out.first:
            first[out.first] = t
        if out.finished:
            finish[out.finished] = t
            tokens[out.finished] = out.finished_tokens
            disp.on_finished(i, len(out.finished))
        disp.on_progress(out.first, out.finished)
        if disp.affinity is not None and out.first:
            disp.affinity.first_tokens(t, out.first)  # their engines publish their prefill signatures
        return len(out.finished)

    finished = 0
    now = t0
    for now, kind, idx in loop.events(arrival) if n_req else ():  # periodic events never run out
        if kind == ARRIVAL:
            rid = idx
            rkeys = keys[rid] if keys else None
            if check and disp.tracks_exact:
                _check_exact_ledger(disp.exact, engines, first, None if prefix_block else prompt)
            i = disp.choose(now, int(prompt[rid]), rkeys, rid)
            if track:
                predicted[rid] = disp.predicted
            eng_of[rid] = i
            engines[i].add(rid, int(replay[rid]), int(prompt[rid]), int(output[rid]), now, rkeys)
            if fleet.coupled:
                if not global_busy:
                    start_global(now)
            elif not engines[i].busy:
                start_engine(i, now)
        elif kind == _STEP_END and idx == _GLOBAL:
            duration = now - global_start
            for i, p in enumerate(plans):
                if p is not None:
                    finished += finish_engine(i, now, duration)
                    plans[i] = None
            start_global(now)
        elif kind == _STEP_END:
            finished += finish_engine(idx, now, None)
            start_engine(idx, now)
        elif kind == _TELEMETRY:
            _report_telemetry(disp, engines[idx], idx, now)
            push(now + fleet.telemetry_interval_s, _TELEMETRY, idx)
        else:
            disp.on_coordinator(*_coordinator_view(engines))
            push(now + fleet.coordinator_interval_s, _COORDINATOR, _GLOBAL)
        if check:
            _check_invariants(engines, eng_of, finish)
        if finished >= n_req:
            break

    return DPSimResult(
        dispatch=dispatch,
        order=order,
        fleet=fleet,
        workload=workload,
        arrival=arrival.copy(),
        engine=eng_of,
        first_token=first,
        finish=finish,
        tokens=tokens,
        **_step_columns(steps),
        engine_requests=np.bincount(eng_of[eng_of >= 0], minlength=n),
        **_engine_totals(engines),
        kv_first_decisions=disp.kv_first,
        makespan=now - t0,
        prefix_hit=hits_per_request((e.prefix_hits for e in engines), n_req),
        prefix_predicted=predicted,
        ep=ep.summary() if ep is not None else {},
    )


def _ep_run(
    fleet: DPFleetConfig, bank: ReplayBank, prefill_counts: np.ndarray | None, control: PlacementControl | None
) -> EpRun | None:
    """The run's EP bookkeeping (None when the fleet's placement is off)."""
    if fleet.placement == "off":
        if control is not None:
            raise ValueError("a placement control needs a fleet with a placement (DPFleetConfig.placement)")
        return None
    topo = fleet.ep_topology
    m = fleet.cost.model
    if control is None:
        links = {
            "ranks_per_node": topo.ranks_per_node,
            "nvlink_cost": topo.network_bytes_per_s / topo.nvlink_bytes_per_s,
            "step_cost": step_cost(fleet.cost, topo),  # the step-time publish rule prices with the fleet's physics
            "migration": migration_price(fleet.cost, topo),
        }
        control = make_placement(fleet.placement, m.moe_layers, m.num_experts, topo.ranks, topo.tp, **links)
    return EpRun(fleet.cost, topo, bank, control, prefill_counts, fleet.telemetry_interval_s)


def _dispatcher(
    fleet: DPFleetConfig, dispatch: str, seed: int, engines: list[MixedEngine], prefix_block: int | None
) -> Dispatcher:
    """The fleet's dispatcher for one rule, given the engines' prefix caches when they keep them."""
    disp = Dispatcher(
        dispatch,
        fleet.engines,
        fleet.params,
        fleet.inflight_grace_s,
        fleet.inflight_drain_tokens_per_s,
        weights=fleet.weights_for(dispatch),
        seed=seed,
        prefix_index=fleet.prefix_index,
        prefix_ttl_s=fleet.prefix_ttl_s,
        kv_blocks=fleet.engine_kv_blocks,
        ledger_control=fleet.ledger_control,
    )
    if prefix_block:
        caches = [e.prefix for e in engines if e.prefix is not None]
        disp.attach_prefix(caches, prefix_block, fleet.engine_kv_blocks, fleet.prefix_cpu_weight)
    return disp


def _first_reports(loop: EventLoop, disp: Dispatcher, fleet: DPFleetConfig, seed: int, t0: float) -> None:
    """Schedule the first of the periodic reports the dispatcher reads: each engine's telemetry (at its phase)
    and the coordinator's snapshot; the handlers schedule the next ones."""
    if disp.needs_telemetry:
        phases = _telemetry_phases(fleet, seed)
        for i in range(fleet.engines):
            loop.push(t0 + phases[i], _TELEMETRY, i)
    if disp.needs_coordinator:
        loop.push(t0 + fleet.coordinator_interval_s, _COORDINATOR, _GLOBAL)


def _begin_lockstep(
    engines: list[MixedEngine], plans: list[MixedStep | None], t: float
) -> tuple[float, np.ndarray | None, int]:
    """Every engine begins its share of one lock-step (coupled) step, into `plans`. Returns the slowest dense
    part (s), the union of the experts all engines' tokens select (None: no engine had work), and the tokens."""
    nonmoe, union, total = 0.0, None, 0
    for i, e in enumerate(engines):
        plans[i] = p = e.begin_step(t)
        if p is not None:
            nonmoe = max(nonmoe, p.nonmoe_s)
            union = p.union.copy() if union is None else union | p.union
            total += p.tokens
    return nonmoe, union, total


def _report_telemetry(disp: Dispatcher, e: MixedEngine, i: int, now: float) -> None:
    """Engine `i`'s telemetry message, as the dispatcher receives it (expert pressure since the last one)."""
    pressure = e.take_expert_pressure()
    disp.on_telemetry(i, now, e.kv_usage, e.remaining_prefill_tokens, e.waiting_prefill_tokens, pressure)


def _coordinator_view(engines: list[MixedEngine]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The DP coordinator's snapshot: (waiting, running, KV usage) per engine."""
    return (
        np.array([e.num_waiting for e in engines], dtype=np.float64),
        np.array([e.num_running for e in engines], dtype=np.float64),
        np.array([e.kv_usage for e in engines]),
    )


def _telemetry_phases(fleet: DPFleetConfig, seed: int) -> np.ndarray:
    """Each engine's first telemetry offset within an interval (all the first one's when aligned)."""
    rng = stream(seed, "dp.telemetry")
    phases = rng.uniform(0.0, fleet.telemetry_interval_s, fleet.engines)
    if fleet.telemetry_aligned:
        phases[:] = phases[0]
    return phases


def _engines(
    fleet: DPFleetConfig,
    bank: ReplayBank,
    dispatch: str,
    order: QueueOrder,
    prefill_counts: np.ndarray | None,
    prefix_block: int | None = None,
) -> list[MixedEngine]:
    """The fleet's DP engines, fresh (with expert-load tables when Gimbal's pressure needs them)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    dc = fleet.dp_cost
    reads_pressure = "expert_pressure" in dp_profile(dispatch, fleet.params, fleet.weights_for(dispatch)).columns
    placed_here = fleet.placement == "off"  # else `dp_ep` feeds the pressure under the layout in force
    tables = ExpertLoadTables.build(bank, dc.rank_masks, prefill_counts) if reads_pressure and placed_here else None
    return [
        MixedEngine(
            dc,
            bank,
            max_running=fleet.max_running,
            token_budget=fleet.token_budget,
            kv_blocks=fleet.engine_kv_blocks,
            order=order,
            params=fleet.params,
            load_tables=tables,
            prefix_block=prefix_block,
            prefix_cpu_tokens=fleet.prefix_cpu_tokens,
        )
        for _ in range(fleet.engines)
    ]


def _step_columns(steps: list[tuple[int, float, float, int, int, int, int, int]]) -> dict[str, np.ndarray]:
    """The steps' log as `DPSimResult`'s step columns."""
    st = np.array(steps, dtype=np.float64).reshape(-1, 8)
    return {
        "step_engine": st[:, 0].astype(np.int64),
        "step_start": st[:, 1],
        "step_duration": st[:, 2],
        "step_tokens": st[:, 3].astype(np.int64),
        "step_prefill": st[:, 4].astype(np.int64),
        "step_decode": st[:, 5].astype(np.int64),
        "step_running": st[:, 6].astype(np.int64),
        "step_waiting": st[:, 7].astype(np.int64),
    }


def _engine_totals(engines: list[MixedEngine]) -> dict[str, np.ndarray]:
    """Per-engine totals at the end of a run, as `DPSimResult`'s engine columns."""
    return {
        "engine_tokens": np.array([e.tokens_out for e in engines], dtype=np.int64),
        "engine_prompt_tokens": np.array([e.prompt_tokens for e in engines], dtype=np.int64),
        "engine_busy": np.array([e.busy_time for e in engines]),
        "engine_preemptions": np.array([e.preemptions for e in engines], dtype=np.int64),
        "engine_max_kv_blocks": np.array([e.max_used_blocks for e in engines], dtype=np.int64),
        "engine_aged_admissions": np.array([e.aged_admissions for e in engines], dtype=np.int64),
        "engine_prefix_query_tokens": np.array([e.prefix_query_tokens for e in engines], dtype=np.int64),
        "engine_prefix_hit_tokens": np.array([e.prefix_hit_tokens for e in engines], dtype=np.int64),
        "engine_prefix_evictions": np.array([e.prefix.evicted if e.prefix else 0 for e in engines], dtype=np.int64),
    }


def _check_invariants(engines: list[MixedEngine], eng_of: np.ndarray, finish: np.ndarray) -> None:
    """Each request is on at most one engine, the one it was dispatched to; KV within capacity and recounted."""
    seen: set[int] = set()
    for i, e in enumerate(engines):
        ids = [*e.running_ids(), *e.waiting_ids()]
        assert len(set(ids)) == len(ids), f"engine {i} holds a request twice"
        assert not seen.intersection(ids), f"a request is on two engines ({i})"
        seen.update(ids)
        assert all(eng_of[r] == i for r in ids), f"engine {i} holds a request dispatched elsewhere"
        assert not (np.isfinite(finish[ids]).any() if ids else False), "a finished request is still on an engine"
        assert 0 <= e.used_blocks <= e.kv_blocks, f"engine {i} KV {e.used_blocks}/{e.kv_blocks}"
        if e.prefix is None:
            assert e.used_blocks == e.blocks_held(), f"engine {i} KV accounting drifted"
        else:  # shared prefix blocks count once; the free queue holds the rest
            assert e.prefix.free_blocks == e.kv_blocks - e.used_blocks, f"engine {i} free queue drifted"
        assert e.waiting_prefill_tokens == int(e.queue.work().sum()), f"engine {i} queue token count drifted"


def _check_exact_ledger(
    ledger: ExactLedger, engines: list[MixedEngine], first: np.ndarray, prompt: np.ndarray | None
) -> None:
    """At a decision, the exact ledger equals the engines' ground truth: per engine, the requests it holds without
    a first token (and their prompt tokens, when no prefix cache shortens them) and those past it."""
    for i, e in enumerate(engines):
        ids = np.array([*e.running_ids(), *e.waiting_ids()], dtype=np.int64)
        waiting_first = ids[np.isnan(first[ids])] if ids.size else ids
        assert ledger.pending[i] == waiting_first.size, f"engine {i}: ledger pending {ledger.pending[i]}"
        assert ledger.decoding[i] == ids.size - waiting_first.size, f"engine {i}: ledger decoding {ledger.decoding[i]}"
        if prompt is not None:
            assert ledger.pending_prefill[i] == int(prompt[waiting_first].sum()), f"engine {i}: pending tokens"
    assert ledger.open == sum(e.num_running + e.num_waiting for e in engines), "the ledger holds a finished request"
