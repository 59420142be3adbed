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

What each dispatch rule sees (the delays are the real systems'):

- `rr`: nothing. `jsq`: its own exact count of outstanding (dispatched, unfinished) requests per engine.
- `vllm`: the DP coordinator's (waiting, running) snapshot, published every 100 ms, plus one waiting request
  per choice since the snapshot (vLLM's local increment). `vllm-main`: the snapshot with KV usage, and the
  client's exact in-flight count.
- `gimbal`: each engine's telemetry (KV usage, remaining and waiting prefill tokens, expert pressure), sent
  every 100 ms at an engine-specific phase (the bus contract's `sy.engine.<id>.telemetry`; `telemetry_aligned`
  puts every engine on one phase, as vLLM's coordinator publishes all engines at once), plus the router's
  in-flight compensation: prompt tokens of requests dispatched to the engine count until a report received at
  least `inflight_grace_s` after them (`solver.routing.ledger`, the router's rule and default).
- `gimbal-exact`: the exact ledger (`solver.routing.exact_ledger`) fed from its own sends and the first tokens
  and ends the fleet emits, its sends of the last few tens of ms (``recent_sends``, `RecentSends`), and the
  telemetry's KV usage and expert pressure.
- `llm-d` reads the coordinator's view (waiting, KV usage), `dynamo` the telemetry view with ``kv_blocks``,
  `sglang-cache` the exact outstanding counts, each with ``cached_tokens`` as below.
- `switchyard` (and any profile reading the request input ``cached_tokens``): Gimbal's view plus, per arrival,
  the prompt tokens each engine holds cached, from one of two prefix indexes (`DPFleetConfig.prefix_index`):
  *precise*: what the engines' caches hold at the decision instant (what vLLM's KV events would have told the
  router: blocks stored as their prefill computed them, removed as evicted; `PrefixCache.lookup`), or
  *approximate*: a `solver.routing.prefix.RoutedIndex` fed by the dispatcher's own decisions (each request's
  keys recorded on the engine chosen, expiring after `prefix_ttl_s`, at most an engine's KV capacity of keys).
  ``indexed_blocks`` is the chosen index's blocks per engine (engine KV blocks; on a trace without hash ids,
  the 16-token blocks of every prompt routed there, as SGLang's tree grows); ``kv_blocks`` (each engine's
  KV capacity, from its hello) is exact. When a profile needs ``cached_tokens`` both indexes are kept and
  their predictions for the chosen engine recorded per request (`DPSimResult.prefix_predicted`), to be
  checked against the hit the request found at admission.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from switchyard.shared.signals import need
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
from switchyard.simulator.core.prefix_cache import PrefixCache, hits_per_request, prefix_keys
from switchyard.simulator.core.workload import Workload
from switchyard.simulator.offline.dp_affinity import AffinityFeed, affinity_feed
from switchyard.simulator.offline.dp_ep import EpRun, migration_price
from switchyard.simulator.offline.dp_fleet import PREFIX_INDEXES, DPFleetConfig, DPSimResult
from switchyard.solver.routing.dispatch import GimbalParams, kv_first_applies
from switchyard.solver.routing.exact_ledger import ExactLedger, RecentSends
from switchyard.solver.routing.filters import KvFirst
from switchyard.solver.routing.ledger import InflightLedger
from switchyard.solver.routing.prefix import RoutedIndex
from switchyard.solver.routing.profiles import dp_profile
from switchyard.solver.routing.query import RouteQuery, RouterState
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables

__all__ = ["PREFIX_INDEXES", "DPFleetConfig", "DPSimResult", "Dispatcher", "simulate_dp"]


_STEP_END, _TELEMETRY, _COORDINATOR = 0, 1, 2
_GLOBAL = -1
_NO_TABLES = RoutingTables()  # DP profiles read no centroid or label tables
#: Tokens per block of ``indexed_blocks`` on a trace without hash ids (vLLM's KV block): an approximate index
#: (SGLang's tree) still records every routed prompt, unique text included.
_INDEX_BLOCK_TOKENS = 16


#: The engine columns the simulated dispatcher can feed a DP profile, by where a real dispatcher gets them
#: (the module docstring): its own exact counts, the DP coordinator's snapshot, the engines' telemetry. Each is
#: a registry name (`shared.signals.need`: a misspelt one fails at import).
EXACT_COLUMNS = need("alive", "load", "outstanding")
#: The exact ledger's columns (`solver.routing.exact_ledger`): fed from the dispatcher's own sends and the first
#: tokens and ends it sees, as the gateway's progress reports feed the router's; ``recent_sends`` from its sends.
LEDGER_COLUMNS = need("pending_prefill", "pending", "decoding", "recent_sends")
#: Controls of the exact ledger (`DPFleetConfig.ledger_control`): "shuffled" hands the profile the ledger's
#: rows in a fresh random order at every decision (the facts, on the wrong engines).
LEDGER_CONTROLS: tuple[str, ...] = ("none", "shuffled")
COORDINATOR_COLUMNS = need("waiting", "running")
TELEMETRY_COLUMNS = need("remaining_prefill", "waiting_prefill", "expert_pressure", "inflight_tokens", "inflight")
PREFIX_COLUMNS = need("indexed_blocks")
HELLO_COLUMNS = need("kv_blocks")  # the engine's KV capacity, from its hello: known from the start
SIM_COLUMNS = EXACT_COLUMNS | LEDGER_COLUMNS | COORDINATOR_COLUMNS | TELEMETRY_COLUMNS | PREFIX_COLUMNS | HELLO_COLUMNS
SIM_COLUMNS |= need("kv_usage")


class Dispatcher:
    """A DP profile of the router (`solver.routing.profiles.dp_profile`) fed the view of the fleet it would
    have (see the module docstring).

    The profile's columns decide the view: ``waiting``/``running`` come from the coordinator snapshot (plus
    vLLM's local increment of the chosen engine's waiting count), the prefill columns, ``expert_pressure`` and
    the in-flight ledger (``inflight_tokens``, ``inflight``) from each engine's telemetry; ``outstanding``
    (= ``load``) and ``alive`` are exact. ``kv_usage`` comes from telemetry unless the profile reads the
    coordinator's counts and no telemetry column (vLLM main's rule reads the snapshot's KV usage).
    ``cached_tokens`` (the request input) and ``indexed_blocks`` come from the prefix index `prefix_index`
    (`attach_prefix` gives the engines' caches; without them, or for a request without keys, nothing is cached).
    """

    def __init__(
        self,
        policy: str,
        engines: int,
        params: GimbalParams,
        grace_s: float,
        drain_tokens_per_s: float = 0.0,
        weights: Mapping[str, float] | None = None,
        seed: int = 0,
        prefix_index: str = "precise",
        prefix_ttl_s: float = 600.0,
        kv_blocks: int = 0,
        ledger_control: str = "none",
    ) -> None:
        self.profile = dp_profile(policy, params, weights)
        self.policy = policy
        cols = self.profile.columns
        unknown = sorted(cols - SIM_COLUMNS)
        if unknown:
            raise ValueError(
                f"DP profile {policy!r} reads columns the simulator does not feed: {', '.join(unknown)} "
                f"(it feeds {', '.join(sorted(SIM_COLUMNS))})"
            )
        self.n = engines
        self.params = params
        self.grace_s = grace_s
        self.drain = drain_tokens_per_s
        self.alive = np.ones(engines, dtype=bool)
        self.outstanding = np.zeros(engines)  # exact: dispatched and not finished
        # vLLM coordinator view
        self.snap_waiting = np.zeros(engines)
        self.snap_running = np.zeros(engines)
        self.snap_kv = np.zeros(engines)
        # Gimbal telemetry view
        self.kv = np.zeros(engines)
        self.remaining = np.zeros(engines)
        self.waiting_tokens = np.zeros(engines)
        self.pressure = np.ones(engines)
        self.ledger = InflightLedger(engines)  # the router's in-flight compensation, the same ledger
        self.exact = ExactLedger(engines)  # what was sent and has not reached its first token / its end
        self.recent = RecentSends(engines)  # what was sent in the last few tens of ms (decaying)
        self.kv_first = 0
        self.affinity: AffinityFeed | None = None  # ``expert_affinity`` (`dp_affinity`), set by `simulate_dp`

        self.needs_coordinator = bool(cols & COORDINATOR_COLUMNS)
        kv_from_coordinator = self.needs_coordinator and not cols & TELEMETRY_COLUMNS
        self.needs_telemetry = bool(cols & TELEMETRY_COLUMNS) or ("kv_usage" in cols and not kv_from_coordinator)
        self._ledgered = bool(cols & {"inflight_tokens", "inflight"})
        self._drains = self.drain > 0 and "inflight_tokens" in cols
        self._kv_first = next((f for f in self.profile.filters if isinstance(f, KvFirst)), None)
        self.snap = FleetSnapshot(
            engine_ids=tuple(f"dp{i:06d}" for i in range(engines)),
            load=self.outstanding,
            kv_usage=self.snap_kv if kv_from_coordinator else self.kv,
            alive=self.alive,
            columns={
                "outstanding": self.outstanding,
                "waiting": self.snap_waiting,
                "running": self.snap_running,
                "remaining_prefill": self.remaining,
                "waiting_prefill": self.waiting_tokens,
                "expert_pressure": self.pressure,
                "inflight_tokens": self.ledger.tokens,
                "inflight": self.ledger.count,
            },
        )
        self.state = RouterState(rng=stream(seed, "dp.dispatch"))
        if ledger_control not in LEDGER_CONTROLS:
            raise ValueError(f"ledger_control must be one of {', '.join(LEDGER_CONTROLS)}, got {ledger_control!r}")
        self.tracks_exact = bool(cols & LEDGER_COLUMNS)
        self.tracks_recent = "recent_sends" in cols
        self._shuffle = stream(seed, "dp.ledger-control") if ledger_control == "shuffled" else None
        self._feed_exact()
        # prefix view (see the module docstring); live only once `attach_prefix` gives the engines' caches
        if prefix_index not in PREFIX_INDEXES:
            raise ValueError(f"prefix_index must be one of {', '.join(PREFIX_INDEXES)}, got {prefix_index!r}")
        self.prefix_index = prefix_index
        self.prefix_ttl_s = prefix_ttl_s
        self.needs_cached = "cached_tokens" in self.profile.needs
        self.needs_indexed = "indexed_blocks" in cols
        self.indexed = np.zeros(engines)  # refreshed per decision only when the profile reads it
        self.snap.columns["indexed_blocks"] = self.indexed
        self.snap.columns["kv_blocks"] = np.full(engines, float(kv_blocks))
        self._caches: list[PrefixCache] = []
        self._trace_block = 0
        self._span = 0
        self.routed: RoutedIndex | None = None
        #: The last decision's predicted cached tokens on the engine chosen: (precise, approximate); -1: none.
        self.predicted = (-1, -1)

    @property
    def prefix_live(self) -> bool:
        """The profile reads the prefix index and the engines cache prefixes."""
        return bool(self._caches) and (self.needs_cached or self.needs_indexed)

    def attach_prefix(self, caches: list[PrefixCache], trace_block: int, capacity_blocks: int) -> None:
        """The engines' prefix caches (precise view) and the trace block; sizes the approximate index."""
        self._caches = caches
        self._trace_block = trace_block
        self._span = caches[0].span if caches else 0
        keys_per_engine = max(capacity_blocks // max(self._span, 1), 1)
        self.routed = RoutedIndex(max_blocks=keys_per_engine, ttl_s=self.prefix_ttl_s)

    def _feed_exact(self) -> None:
        """The exact ledger's columns into the snapshot: the ledger's own arrays, or (control) a permutation."""
        columns = {"pending_prefill": self.exact.pending_prefill, "pending": self.exact.pending}
        columns["decoding"] = self.exact.decoding
        columns["recent_sends"] = self.recent.column
        if self._shuffle is not None:
            perm = self._shuffle.permutation(self.n)
            columns = {name: col[perm] for name, col in columns.items()}
        self.snap.columns.update(columns)

    def choose(self, now: float, prompt_tokens: int, keys: tuple[int, ...] | None = None, rid: int = -1) -> int:
        snap = self.snap
        if self.tracks_recent:
            self.recent.at(now)  # decayed in place (the snapshot holds the array)
        if self._shuffle is not None and self.tracks_exact:
            self._feed_exact()
        if self._kv_first is not None and kv_first_applies(snap.alive, snap.kv_usage, self._kv_first.params):
            self.kv_first += 1
        if self._drains:
            snap.columns["inflight_tokens"] = self._drained(now)
        cached = 0
        if not self.prefix_live:
            aff = self.affinity
            query = aff.query(now, prompt_tokens, rid) if aff else RouteQuery(prompt_tokens=prompt_tokens)
            i = self.profile(snap, query, self.state, _NO_TABLES).index
            if self.needs_indexed:  # no keys: an index of what was routed still grows by the prompt's blocks
                self.indexed[i] += -(-prompt_tokens // _INDEX_BLOCK_TOKENS)
        else:
            i, cached = self._choose_prefix(now, prompt_tokens, keys)
        if self.needs_coordinator:
            self.snap_waiting[i] += 1  # vLLM's local increment, until the next snapshot
        if self._ledgered:  # in flight: the prefill the engine will compute (the router's rule)
            self.ledger.add(i, now, prompt_tokens - cached)
        if self.tracks_exact:
            self.exact.sent(rid, i, prompt_tokens - cached)
        if self.tracks_recent:
            self.recent.sent(i, now)
        self.outstanding[i] += 1
        if self.affinity is not None:
            self.affinity.routed(rid, i)
        return i

    def _choose_prefix(self, now: float, prompt_tokens: int, keys: tuple[int, ...] | None) -> tuple[int, int]:
        """A decision with the prefix view: both indexes asked (one feeds the profile), the routed one fed.
        Returns the engine and the prompt tokens the profile was told it holds cached (0 if not told)."""
        routed = self.routed
        assert routed is not None
        ids = self.snap.engine_ids
        precise = approx = None
        if keys:
            tb = self._trace_block
            limit = (prompt_tokens - 1) // tb  # the scheduler's lookup bound: vLLM recomputes the last token
            precise = np.array([c.lookup(keys, limit)[0] for c in self._caches], dtype=np.float64) * tb
            approx = routed.match(keys[:limit], ids, now).astype(np.float64) * tb
        else:
            for engine_id in ids:
                routed.expire(engine_id, now)
        if self.needs_indexed:
            if self.prefix_index == "precise":
                self.indexed[:] = [c.cached_keys * self._span for c in self._caches]
            else:
                self.indexed[:] = [routed.blocks(e) * self._span for e in ids]
        cached = precise if self.prefix_index == "precise" else approx
        query = RouteQuery(prompt_tokens=prompt_tokens, cached=cached if self.needs_cached else None)
        i = self.profile(self.snap, query, self.state, _NO_TABLES).index
        if keys:
            assert precise is not None and approx is not None
            self.predicted = (int(precise[i]), int(approx[i]))
            routed.routed(ids[i], keys, now)
        else:
            self.predicted = (-1, -1)
        told = query.cached
        return i, int(told[i]) if told is not None else 0

    def _drained(self, now: float) -> np.ndarray:
        """In-flight tokens if each decision's prompt drains at `drain` tokens/s from the moment it was sent."""
        comp = np.zeros(self.n)
        for i in range(self.n):
            for sent, tokens in self.ledger.entries(i):
                comp[i] += max(tokens - self.drain * (now - sent), 0.0)
        return comp

    @property
    def comp(self) -> np.ndarray:
        """Prompt tokens in flight per engine (Gimbal's comp term): the ledger's token column."""
        return self.ledger.tokens

    def on_finished(self, engine: int, count: int) -> None:
        self.outstanding[engine] -= count

    def on_progress(self, first: list[int], finished: list[int]) -> None:
        """Requests that sampled their first token, and requests that ended, in one step (the gateway sees both)."""
        if self.tracks_exact:
            for rid in first:
                self.exact.first_token(rid)
            for rid in finished:
                self.exact.finished(rid)

    def on_coordinator(self, waiting: np.ndarray, running: np.ndarray, kv: np.ndarray) -> None:
        """A coordinator snapshot replaces the client's counts, local increments included."""
        self.snap_waiting[:] = waiting
        self.snap_running[:] = running
        self.snap_kv[:] = kv

    def on_telemetry(self, i: int, now: float, kv: float, remaining: int, waiting: int, pressure: float) -> None:
        self.kv[i] = kv
        self.remaining[i] = remaining
        self.waiting_tokens[i] = waiting
        self.pressure[i] = max(pressure, 1.0)
        self.ledger.settle(i, now - self.grace_s)


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
    keys = _prompt_keys(workload, prefix_block)
    disp = _dispatcher(fleet, dispatch, seed, engines, prefix_block)
    disp.affinity = affinity_feed(disp.profile.needs, fleet, prefill_counts, workload.replay, keys, seed)
    predicted = np.full((n_req, 2), -1, dtype=np.int64)  # (precise, approximate) on the chosen engine
    track = disp.prefix_live
    phases = _telemetry_phases(fleet, seed)

    arrival, prompt, output, replay = workload.arrival, workload.prompt, workload.output, workload.replay
    eng_of = np.full(n_req, -1, dtype=np.int64)
    first, finish = np.full(n_req, np.nan), np.full(n_req, np.nan)
    tokens = np.zeros(n_req, dtype=np.int64)
    steps: list[tuple[int, float, float, int, int, int, int, int]] = []

    loop = EventLoop()
    push = loop.push

    t0 = float(arrival[0]) if n_req else 0.0
    if disp.needs_telemetry:
        for i in range(n):
            push(t0 + phases[i], _TELEMETRY, i)
    if disp.needs_coordinator:
        push(t0 + fleet.coordinator_interval_s, _COORDINATOR, _GLOBAL)

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
        nonmoe, union, total = 0.0, None, 0
        for i, e in enumerate(engines):
            plans[i] = p = e.begin_step(t)
            if p is not None:
                nonmoe = max(nonmoe, p.nonmoe_s)
                union = p.union.copy() if union is None else union | p.union
                total += p.tokens
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
            e = engines[idx]
            pressure = e.take_expert_pressure()
            disp.on_telemetry(idx, now, e.kv_usage, e.remaining_prefill_tokens, e.waiting_prefill_tokens, pressure)
            push(now + fleet.telemetry_interval_s, _TELEMETRY, idx)
        else:
            disp.on_coordinator(
                np.array([e.num_waiting for e in engines], dtype=np.float64),
                np.array([e.num_running for e in engines], dtype=np.float64),
                np.array([e.kv_usage for e in engines]),
            )
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


def _prompt_keys(workload: Workload, prefix_block: int | None) -> list[tuple[int, ...]] | None:
    """Each request's chained prefix keys (None without caching or without the trace's hash ids)."""
    if not prefix_block or workload.hash_ids is None:
        return None
    return [prefix_keys(h, int(p), prefix_block) for h, p in zip(workload.hash_ids, workload.prompt, strict=True)]


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
        disp.attach_prefix([e.prefix for e in engines if e.prefix is not None], prefix_block, fleet.engine_kv_blocks)
    return disp


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
