"""The router's decision logic, free of NATS: fleet state in, decisions out.

`RouterCore` keeps the fleet view (`services.router.fleet.Fleet`), one sorted `FleetSnapshot` per routed
role, refreshed in place before each decision (no rebuild, no per-engine Python loop), the routing
artifact's `Scorer` and tables, and the policy state. The service (`services.router.service`) feeds it bus
messages and sends back what it returns; tests drive it directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from services.router import metrics
from services.router.fleet import Fleet
from services.router.settings import RouterSettings
from shared.codec import ErrorBody, ErrorReply
from shared.errors import SchemaMismatch
from shared.schemas import (
    Hello,
    RouteDecision,
    RouteDecodeReply,
    RouteDecodeRequest,
    RouteDpReply,
    RouteDpRequest,
    RoutingArtifact,
    Telemetry,
)
from solver.routing import FleetSnapshot, RouteQuery, RouterState, RoutingTables, get_policy
from solver.routing.dispatch import GimbalParams, pick_dp_engine
from solver.scoring import Scorer, ScoringError


class RoleView:
    """The engines of one role as a `FleetSnapshot` (sorted ids), refreshed in place from the fleet columns."""

    def __init__(self, fleet: Fleet, role: str) -> None:
        self.fleet = fleet
        self.role = role
        self.version = -1
        self.rebuild()

    def rebuild(self) -> bool:
        """Re-derive rows and snapshot if the fleet's membership changed; True when it did."""
        if self.version == self.fleet.version:
            return False
        self.rows = self.fleet.rows_of(self.role)
        ids = tuple(self.fleet.engine_ids[i] for i in self.rows)
        d = len(ids)
        self.snap = FleetSnapshot(ids, np.zeros(d), np.zeros(d), np.zeros(d, dtype=bool), version=self.fleet.version)
        self.version = self.fleet.version
        return True

    def refresh(self, now: float, stale_after_s: float) -> FleetSnapshot:
        f, rows, snap = self.fleet, self.rows, self.snap
        np.take(f.num_running, rows, out=snap.load)
        snap.load += f.num_waiting[rows]
        snap.load += f.inflight[rows]
        np.take(f.kv_usage, rows, out=snap.kv_usage)
        np.less_equal(now - f.last_seen[rows], stale_after_s, out=snap.alive)
        return snap


@dataclass(frozen=True)
class Routed:
    """A reply plus, when an engine was chosen, the decision to share with the other replicas."""

    reply: RouteDecodeReply | RouteDpReply | ErrorReply
    decision: RouteDecision | None


def _unavailable(kind: str, role: str, known: int) -> Routed:
    metrics.UNROUTABLE.labels(kind).inc()
    message = f"no live {role} engine (known: {known}); engines must send telemetry to be routable"
    return Routed(ErrorReply(error=ErrorBody(code="unavailable", message=message)), None)


class RouterCore:
    def __init__(self, settings: RouterSettings, dispatch: GimbalParams | None = None) -> None:
        self.settings = settings
        self.fleet = Fleet(stale_after_s=settings.stale_after_s, inflight_grace_s=settings.inflight_grace_s)
        self.policy = get_policy(settings.policy)
        self.state = RouterState.seeded(settings.seed)
        self.dispatch = dispatch or GimbalParams()
        self.decode = RoleView(self.fleet, "decode")
        self.dp = RoleView(self.fleet, "dp")
        self.artifact: RoutingArtifact | None = None
        self.scorer: Scorer | None = None
        self.tables = RoutingTables()
        self._tables_for = -1

    # ----- inputs -----

    def on_hello(self, hello: Hello, now: float) -> None:
        self.fleet.on_hello(hello, now)

    def on_telemetry(self, telemetry: Telemetry, now: float) -> bool:
        """Returns False when the engine never said hello (the service then asks it to announce itself)."""
        gaps = self.fleet.counters.telemetry_gaps
        self.fleet.on_telemetry(telemetry, now)
        if self.fleet.counters.telemetry_gaps != gaps:
            metrics.TELEMETRY_GAPS.inc()
        return self.fleet.role[self.fleet.index[telemetry.engine_id]] >= 0

    def on_decision(self, decision: RouteDecision, now: float) -> None:
        if decision.replica_id != self.settings.replica_id:
            self.fleet.on_decision(decision.engine_id, decision.prompt_tokens, now)

    def set_artifact(self, artifact: RoutingArtifact | None) -> None:
        """Swap the routing artifact (hot reload); the next decision uses it."""
        self.artifact = artifact
        self.scorer = Scorer.from_artifact(artifact) if artifact is not None else None
        self._tables_for = -1
        metrics.ARTIFACT_VERSION.set(artifact.version if artifact is not None else 0)

    def housekeeping(self, now: float) -> None:
        """Periodic: forget long-silent engines, export liveness gauges."""
        self.fleet.forget(now, self.settings.forget_after_s)
        metrics.STALE_ENGINES.set(self.fleet.stale_count(now))
        for role in ("prefill", "decode", "dp"):
            metrics.LIVE_ENGINES.labels(role).set(int(self.fleet.alive(role, now).sum()))

    # ----- decisions -----

    def _decode_tables(self) -> RoutingTables:
        """Tables for the current decode engines and artifact, rebuilt only when either changed."""
        if self.decode.rebuild() or self._tables_for != self.decode.version:
            artifact = self.artifact
            tau = self.policy.tau if self.policy.tau is not None else (artifact.tau if artifact else 0.1)
            self.tables = RoutingTables.build(
                self.decode.snap.engine_ids,
                num_centroids=artifact.centroids.shape[0] if artifact is not None else 0,
                decoder_ids=artifact.decoder_ids if artifact is not None else None,
                tau=tau,
                label_shares=self.settings.domain_shares or None,
            )
            self._tables_for = self.decode.version
        return self.tables

    def route_decode(self, request: RouteDecodeRequest, now: float) -> Routed:
        start = time.perf_counter()
        tables = self._decode_tables()
        snap = self.decode.refresh(now, self.settings.stale_after_s)
        if not snap.alive.any():
            return _unavailable("decode", "decode", snap.size)
        sims, fallback = None, None
        if "similarity" in self.policy.needs:
            if self.scorer is None:
                fallback = "no_artifact"
            elif request.signature is None:
                fallback = "no_signature"
            else:
                try:
                    sims = self.scorer.similarities(request.signature, request.layers)
                except ScoringError as exc:
                    raise SchemaMismatch("signature", str(exc)) from None
        query = RouteQuery(sims=sims, label=request.label, prompt_tokens=request.prompt_tokens)
        decision = self.policy(snap, query, self.state, tables)
        engine_id = snap.engine_ids[decision.index]
        self.fleet.on_decision(engine_id, request.prompt_tokens, now)
        elapsed = time.perf_counter() - start
        fallback = fallback or decision.fallback
        metrics.DECISIONS.labels("decode", self.policy.name, fallback or "").inc()
        metrics.DECISION_SECONDS.labels("decode").observe(elapsed)
        if decision.band_size:
            metrics.BAND_SIZE.observe(decision.band_size)
        reply = RouteDecodeReply(
            request_id=request.request_id,
            engine_id=engine_id,
            policy=self.policy.name,
            band_size=decision.band_size,
            decision_us=elapsed * 1e6,
            artifact_version=self.artifact.version if self.artifact is not None else None,
            fallback=fallback,
        )
        shared = RouteDecision(
            replica_id=self.settings.replica_id,
            kind="decode",
            request_id=request.request_id,
            engine_id=engine_id,
            prompt_tokens=request.prompt_tokens,
        )
        return Routed(reply, shared)

    def route_dp(self, request: RouteDpRequest, now: float) -> Routed:
        start = time.perf_counter()
        view = self.dp
        view.rebuild()
        snap = view.refresh(now, self.settings.stale_after_s)
        f, rows = self.fleet, view.rows
        index = pick_dp_engine(
            snap.alive,
            snap.kv_usage,
            f.remaining_prefill[rows],
            f.waiting_prefill[rows],
            f.inflight_tokens[rows],
            f.expert_pressure[rows],
            self.dispatch,
        )
        if index < 0:
            return _unavailable("dp", "dp", snap.size)
        engine_id = snap.engine_ids[index]
        self.fleet.on_decision(engine_id, request.prompt_tokens, now)
        elapsed = time.perf_counter() - start
        metrics.DECISIONS.labels("dp", "gimbal", "").inc()
        metrics.DECISION_SECONDS.labels("dp").observe(elapsed)
        reply = RouteDpReply(
            request_id=request.request_id,
            engine_id=engine_id,
            priority=request.prompt_tokens,
            decision_us=elapsed * 1e6,
        )
        shared = RouteDecision(
            replica_id=self.settings.replica_id,
            kind="dp",
            request_id=request.request_id,
            engine_id=engine_id,
            prompt_tokens=request.prompt_tokens,
        )
        return Routed(reply, shared)
