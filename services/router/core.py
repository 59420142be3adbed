"""The router's decision logic, free of NATS: fleet state in, decisions out.

`RouterCore` keeps the telemetry view (`services.router.telemetry_view.TelemetryView`), one sorted
`FleetSnapshot` per routed role kept in step with it in place (re-read only after telemetry; no rebuild, no
per-engine Python loop), the routing artifact's `SignatureScorer` and tables, and the two profiles it routes with
(`solver.routing.profiles`, chosen and weighted by `RouterSettings`) with their state. Only the engine columns
and request inputs a profile declares it needs are computed. The service (`services.router.service`) feeds it
bus messages and sends back what it returns; tests drive it directly.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from switchyard.services.engine_book import BookEntry, BookListenerBase, EngineBook
from switchyard.services.router import metrics
from switchyard.services.router.affinity import AffinityState
from switchyard.services.router.ask import DecodeAsk, DpAsk
from switchyard.services.router.decision_bounds import DecisionBounds, PeerLimits
from switchyard.services.router.prefix import PrefixState
from switchyard.services.router.role_view import CLOCKED, COLUMNS, PER_DECISION, SNAPSHOT_COLUMNS, Column, RoleView
from switchyard.services.router.settings import RouterSettings
from switchyard.services.router.telemetry_view import ROLES, TelemetryView
from switchyard.shared.codec import ErrorBody, ErrorReply, encode_unchecked
from switchyard.shared.engine_manifest import REFUSALS, EngineManifest
from switchyard.shared.errors import SchemaMismatch
from switchyard.shared.liveness import Liveness, LivenessSettings
from switchyard.shared.schemas import (
    Hello,
    KvEvents,
    PrefillSignature,
    RouteDecisions,
    RouteDecodeReply,
    RouteDpReply,
    RouteProgress,
    RoutingArtifact,
    Telemetry,
)
from switchyard.shared.sequence import Seq
from switchyard.solver.routing import DEFAULT_TAU, FleetSnapshot, RouteQuery, RouterState, RoutingTables
from switchyard.solver.routing.dispatch import GimbalParams
from switchyard.solver.routing.framework import Profile
from switchyard.solver.scoring import ScoringError, SignatureScorer

_NO_TABLES = RoutingTables()  # DP profiles read no centroid or label tables
_NO_QUERY = RouteQuery()  # ... and most read nothing of the request: no query to build per decision
__all__ = ["CLOCKED", "COLUMNS", "PER_DECISION", "Column", "Decided", "DpChoice", "RoleView", "Routed", "RouterCore"]


def _extra_columns(profile: Profile) -> tuple[str, ...]:
    """The columns `profile` reads that the role view must gather per decision; unknown ones fail at start."""
    extra = sorted(profile.columns - SNAPSHOT_COLUMNS)
    unknown = [name for name in extra if name not in COLUMNS]
    if unknown:
        raise ValueError(f"profile {profile.name!r} reads columns the router does not have: {', '.join(unknown)}")
    return tuple(extra)


def _for_model(view: RoleView, snap: FleetSnapshot, model: str | None) -> FleetSnapshot | None:
    """The snapshot with only the engines serving `model` alive (itself when that narrows nothing); None when
    none of them is live. A model filter ahead of every profile's own filters: only those engines are
    candidates, whatever the profile."""
    alive = view.alive_for(model)
    if alive is snap.alive:
        return snap
    return replace(snap, alive=alive) if alive.any() else None


class Decided(NamedTuple):
    """One decision to share with the other replicas (an entry of `RouteDecisions`)."""

    kind: str
    request_id: str
    engine_id: str
    prompt_tokens: int
    session: str = ""  # the session id's hash (`gateway.sessions.session_key`) when the request named one


class DpChoice(NamedTuple):
    """A `RouteDpReply`'s fields. Every value is the router's own or came in validated (the request's id and
    count, a known engine's id), so `encode` packs them unchecked: building and validating the reply cost a
    cold decision ~35 µs."""

    request_id: str
    engine_id: str
    priority: int
    decision_us: float

    def encode(self) -> bytes:
        return encode_unchecked(RouteDpReply, self._asdict())


class Routed(NamedTuple):
    """A reply plus, when an engine was chosen, the decision to share with the other replicas."""

    reply: RouteDecodeReply | DpChoice | ErrorReply
    decision: Decided | None


def _unavailable(kind: str, role: str, known: int, model: str | None = None) -> Routed:
    metrics.UNROUTABLE.labels(kind).inc()
    serving = f" serving {model!r}" if model is not None else ""
    message = f"no live {role} engine{serving} (known: {known}); engines must send telemetry to be routable"
    return Routed(ErrorReply(error=ErrorBody(code="unavailable", message=message)), None)


class _CoreEvents(BookListenerBase):
    """What the core does when its book changes, beside the telemetry view's columns: counts refusals and gaps,
    and forgets an engine's indexed blocks when they stop naming its cache (a new block size, a restart)."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core

    def refusal(self, reason: str, engine_id: str) -> None:
        if reason in REFUSALS:
            metrics.HELLOS_REFUSED.labels(reason).inc()

    def hello_accepted(self, entry: BookEntry, change: str, previous: Hello | None) -> None:
        if previous is not None and previous.capacity.block_size != entry.block_size:
            self.core._forget_prefix(entry.engine_id, "block_size")  # its blocks were named at the old size

    def telemetry_accepted(self, entry: BookEntry, telemetry: Telemetry, event: Seq, revived: bool) -> None:
        if event is Seq.GAP:
            metrics.TELEMETRY_GAPS.inc()
        elif event is Seq.RESTART:  # a new process: an empty cache, whatever was indexed
            self.core._forget_prefix(entry.engine_id, "restart")


class RouterCore:
    def __init__(
        self,
        settings: RouterSettings,
        dispatch: GimbalParams | None = None,
        manifest: EngineManifest | None = None,
        liveness: Liveness | None = None,
        book: EngineBook | None = None,
    ) -> None:
        self.settings = settings
        #: The engine book the telemetry view projects (`services.engine_book`): the process's own when it has one
        #: (the in-process gateway's, shared with its registry), else one of the core's. With an engine manifest,
        #: a hello is believed only as its engine's entry lists it (role, model, ...): an engine's credentials
        #: must not make it a decoder or DP engine the operator did not list.
        if book is None:
            rule = liveness or LivenessSettings().rule()
            book = EngineBook(rule, manifest, max_engines=settings.max_engines, claims=False)
        self.book = book
        self._saturation_models: set[str] = set()  # models whose fleet saturation is exported
        self.fleet = TelemetryView(
            fresh_load_s=settings.fresh_load_s,
            inflight_grace_s=settings.inflight_grace_s,
            max_inflight_per_engine=settings.max_inflight_per_engine,
            book=book,
        )
        book.listen(_CoreEvents(self))
        #: The decode profile (`policy` in the replies and metrics is its name).
        self.policy: Profile = settings.build_decode_profile()
        self.state = RouterState.seeded(settings.seed)
        self.dispatch = dispatch or settings.gimbal_params()
        self.dp_profile: Profile = settings.build_dp_profile(self.dispatch)
        self.dp_state = RouterState.seeded(settings.seed)
        self._decode_columns = _extra_columns(self.policy)
        self._dp_columns = _extra_columns(self.dp_profile)
        self._dp_reads_tokens = "prompt_tokens" in self.dp_profile.needs
        self.fleet.tracks_recent = "recent_sends" in (*self._dp_columns, *self._decode_columns)
        #: The prefix index (`services.router.prefix`), consulted only for a DP profile reading `cached_tokens`
        #: (or a profile reading `indexed_blocks`), and fed by engine KV events only then (`ingests_kv`).
        self.prefix = PrefixState(
            settings.prefix_index,
            settings.prefix_max_blocks,
            settings.prefix_routed_max_blocks,
            settings.prefix_routed_ttl_s,
            settings.kv_rate_keys_per_s,
            settings.kv_rate_burst_keys,
            settings.tier_weights(),
        )
        self._dp_reads_cached = "cached_tokens" in self.dp_profile.needs
        #: Expert affinity (`services.router.affinity`), only for a DP profile reading it: the signature cache and
        #: the engines' recent traffic, fed by this replica's decisions and the engines' prefill signatures.
        reads_affinity = "expert_affinity" in self.dp_profile.needs
        self.affinity = AffinityState(settings.affinity_limits()) if reads_affinity else None
        self._reads_blocks = "indexed_blocks" in (*self._dp_columns, *self._decode_columns)
        self.ingests_kv = settings.prefix_index == "precise" and (self._dp_reads_cached or self._reads_blocks)
        blocks: dict[str, Column] = {"indexed_blocks": lambda f, rows, snap: self.prefix.blocks_of(snap.engine_ids)}
        self.decode = RoleView(self.fleet, "decode", blocks)
        self.dp = RoleView(self.fleet, "dp", blocks)
        self.artifact: RoutingArtifact | None = None
        self.scorer: SignatureScorer | None = None
        self.tables = RoutingTables()
        self._tables_for = -1
        # Metric children resolved once (`.labels(...)` costs a lock and a dict lookup per call); histogram
        # observations are folded in bulk by `housekeeping`.
        self._seconds = {kind: metrics.Batched(metrics.DECISION_SECONDS.labels(kind)) for kind in ("decode", "dp")}
        self._band = metrics.Batched(metrics.BAND_SIZE)
        self._counted: dict[tuple[str, str], metrics.BatchedCount] = {}
        self._refused_seen = self._dropped_seen = self._foreign_seen = 0  # the fleet's counts already exported
        #: What other replicas' shared decisions may make this replica count (`decision_bounds`, issue 37).
        self.bounds = DecisionBounds(
            PeerLimits(
                decision_bytes_per_s=settings.peer_decision_bytes_per_s,
                decisions_per_s=settings.peer_decisions_per_s,
                inflight_per_engine=settings.peer_inflight_per_engine,
                max_prompt_tokens=settings.peer_max_prompt_tokens,
                inflight_grace_s=settings.inflight_grace_s,
            )
        )

    def refresh_views(self, now: float) -> None:
        """Bring both role views up to date with the fleet, with the columns their profiles read: what a
        decision would do first, done ahead of it (the service calls this after telemetry, off the request
        path). A decision still checks, and finds nothing to do."""
        self.dp.prepare(now, self.settings.fresh_load_s, self._dp_columns)
        self.decode.prepare(now, self.settings.fresh_load_s, self._decode_columns)

    def _count(self, kind: str, policy: str, fallback: str) -> None:
        counted = self._counted.get((kind, fallback))
        if counted is None:
            counted = self._counted[kind, fallback] = metrics.BatchedCount(
                metrics.DECISIONS.labels(kind, policy, fallback)
            )
        counted.inc()

    # ----- inputs -----

    def on_hello(self, hello: Hello, now: float) -> None:
        """Feed the book a hello (the core's own book; a shared one is fed by its owner, the same way)."""
        self.book.on_hello(hello, now)

    def on_telemetry(self, telemetry: Telemetry, now: float) -> bool:
        """Feed the book telemetry. Returns False when the engine never said hello (the service then asks it to
        announce itself); True too for one refused because the book is full of live engines (asking it would only
        bring a refused hello)."""
        entry = self.book.on_telemetry(telemetry, now)
        return entry is None or entry.said_hello

    def on_kv(self, events: KvEvents, now: float) -> str | None:
        """An engine's KV-cache events (its subject's engine, checked by the bus): applied to the precise index,
        or refused with the reason returned (and counted): an engine without an accepted hello (with a
        manifest: one it binds) or not live by the liveness rule (`unknown_engine`), a block size not its
        hello's (`block_size`)."""
        entry = self.book.entries.get(events.engine_id)
        if entry is None or not entry.said_hello or not entry.is_live(now):
            reason = "unknown_engine"
        elif events.block_size != entry.block_size:
            reason = "block_size"
        else:
            applied = self.prefix.apply(events, entry.kv_blocks, now)  # counts a drop itself
            if self._reads_blocks:
                self.fleet.touch()
            return None if applied else "dropped"
        metrics.KV_REJECTED.labels(reason).inc()
        return reason

    def on_signature(self, message: PrefillSignature, sender: str, now: float) -> str | None:
        """An engine's prefill signature (`sender`: the engine its subject names): filed for expert affinity when
        it describes a request this replica sent that engine; the outcome, counted (None: affinity is off)."""
        if self.affinity is None:
            return None
        outcome = self.affinity.on_signature(message, sender, now)
        metrics.AFFINITY_SIGNATURES.labels(outcome).inc()
        return outcome

    def _forget_prefix(self, engine_id: str, reason: str) -> None:
        self.prefix.forget(engine_id, reason)
        if self._reads_blocks:
            self.fleet.touch()

    def on_decisions(self, decisions: RouteDecisions, now: float, sender: str | None = None) -> None:
        """Another replica's decisions: count them in flight here too (our own are counted when made), within what
        that replica could honestly decide (`self.bounds`; `sender`: its subject's kind and id)."""
        if decisions.replica_id == self.settings.replica_id:
            return
        admitted = self.bounds.admit(
            sender or decisions.replica_id,
            decisions.engine_ids,
            decisions.prompt_tokens,
            now,
            self.fleet,
            self.settings.inflight_grace_s,
        )
        for row, prompt_tokens in admitted:
            self.fleet.on_decision_row(row, prompt_tokens, now)
            self._record(row, prompt_tokens)

    def on_progress(self, progress: RouteProgress, reporter: str, now: float) -> None:
        """A gateway's first tokens and ends of requests it routed with ``progress`` (`reporter`: the user its
        subject names): the exact ledger settles those it asked for; reports on others' are ignored, counted."""
        self.fleet.on_progress(progress.first, progress.done, reporter, now)

    def _record(self, row: int, prompt_tokens: int) -> None:
        """Keep the role views in step with a decision the fleet just counted (row -1: unknown engine)."""
        if row >= 0:
            self.decode.record_decision(row, prompt_tokens)
            self.dp.record_decision(row, prompt_tokens)

    def set_artifact(self, artifact: RoutingArtifact | None) -> None:
        """Swap the routing artifact (hot reload); the next decision uses it."""
        self.artifact = artifact
        self.scorer = SignatureScorer.from_artifact(artifact) if artifact is not None else None
        self._tables_for = -1
        metrics.ARTIFACT_VERSION.set(artifact.version if artifact is not None else 0)

    def flush_metrics(self) -> None:
        """Fold the decisions' batched counts and histogram observations into the Prometheus metrics."""
        for batched in (*self._seconds.values(), self._band, *self._counted.values()):
            batched.flush()

    def housekeeping(self, now: float) -> None:
        """Periodic: forget long-silent engines, export liveness gauges and the batched observations."""
        self.flush_metrics()
        counters, ledger = self.fleet.counters, self.fleet.ledger
        metrics.ENGINES_REFUSED.inc(counters.engines_refused - self._refused_seen)
        metrics.INFLIGHT_DROPPED.inc(ledger.dropped - self._dropped_seen)
        self._refused_seen, self._dropped_seen = counters.engines_refused, ledger.dropped
        self._expire_exact(now)
        self.fleet.forget(now, self.settings.forget_after_s)
        index, live_until = self.fleet.index, self.fleet.live_until
        for engine_id in self.prefix.engines():  # dead by the liveness rule, or forgotten: its blocks go
            row = index.get(engine_id)
            if row is None or not now <= live_until[row]:
                self._forget_prefix(engine_id, "forgotten" if row is None else "dead")
        self.prefix.export()
        metrics.STALE_ENGINES.set(self.fleet.stale_count(now))
        for role in ("prefill", "decode", "dp"):
            metrics.LIVE_ENGINES.labels(role).set(int(self.fleet.alive(role, now).sum()))
        self.export_engines(now)

    def _expire_exact(self, now: float) -> None:
        """Drop exact-ledger requests whose gateway stopped reporting (`progress_ttl_s`, `progress_decode_ttl_s`),
        export the reports refused for naming another gateway's requests, and forget bounds of gone engines."""
        exact, settings = self.fleet.exact, self.settings
        pending, decoding = exact.expire(now - settings.progress_ttl_s, now - settings.progress_decode_ttl_s)
        if pending or decoding:
            metrics.EXACT_EXPIRED.labels("pending").inc(pending)
            metrics.EXACT_EXPIRED.labels("decoding").inc(decoding)
            self.fleet.touch()
        metrics.PROGRESS_REFUSED.labels("not_yours").inc(exact.foreign - self._foreign_seen)
        self._foreign_seen = exact.foreign
        self.bounds.forget_engines(set(self.fleet.index))
        if self.affinity is not None:
            self.affinity.forget(set(self.fleet.index))

    def export_engines(self, now: float) -> None:
        """Publish the live engines' load columns for the per-engine gauges (`metrics.EngineGauges`)."""
        fleet = self.fleet
        rows = np.flatnonzero(fleet.live(now))
        roles = [ROLES[fleet.role[r]] for r in rows.tolist()]
        columns = {column: getattr(fleet, column)[rows] for _, _, column in metrics.ENGINE_GAUGES}
        metrics.ENGINE_STATE.publish([fleet.engine_ids[r] for r in rows.tolist()], roles, columns)
        self._export_saturation(rows)

    def _export_saturation(self, rows: np.ndarray) -> None:
        """Each model's fleet saturation for an autoscaler (`metrics.FLEET_SATURATION`): the mean over its live
        engines of max(requests outstanding / the hello's `capacity.max_running`, KV cache usage)."""
        fleet, entries = self.fleet, self.book.entries
        per_model: dict[str, list[float]] = {}
        for r in rows.tolist():
            entry = entries.get(fleet.engine_ids[r])
            if entry is None or entry.hello is None:
                continue
            outstanding = float(fleet.num_running[r] + fleet.num_waiting[r] + fleet.inflight[r])
            load = max(outstanding / max(1, entry.hello.capacity.max_running), float(fleet.kv_usage[r]))
            per_model.setdefault(fleet.model[r] or "unnamed", []).append(load)
        for model, loads in per_model.items():
            metrics.FLEET_SATURATION.labels(model).set(sum(loads) / len(loads))
        for gone in self._saturation_models - per_model.keys():
            metrics.FLEET_SATURATION.remove(gone)
        self._saturation_models = set(per_model)

    # ----- decisions -----

    def _decode_tables(self) -> RoutingTables:
        """Tables for the current decode engines and artifact, rebuilt only when either changed."""
        if self.decode.rebuild() or self._tables_for != self.decode.version:
            artifact = self.artifact
            tau = artifact.tau if artifact is not None else DEFAULT_TAU
            self.tables = RoutingTables.build(
                self.decode.snap.engine_ids,
                num_centroids=artifact.centroids.shape[0] if artifact is not None else 0,
                decoder_ids=artifact.decoder_ids if artifact is not None else None,
                tau=tau,
                label_shares=self.settings.domain_shares or None,
                unnamed_serve_all=self.settings.unnamed_decoders_in_bands,
            )
            self._tables_for = self.decode.version
        return self.tables

    def route_decode(self, request: DecodeAsk, now: float) -> Routed:
        start = time.perf_counter()
        tables = self._decode_tables()
        view = self.decode
        snap = view.prepare(now, self.settings.fresh_load_s, self._decode_columns)
        if not view.any_alive:
            return _unavailable("decode", "decode", snap.size)
        sims, fallback = None, None
        policy = self.policy
        if "similarity" in policy.needs:
            if self.scorer is None:
                fallback = "no_artifact"
            elif request.signature is None:
                fallback = "no_signature"
            else:
                try:
                    sims = self.scorer.similarities(request.signature, request.layers)
                except ScoringError as exc:
                    raise SchemaMismatch("signature", str(exc)) from None
        snap = _for_model(view, snap, request.model)
        if snap is None:
            return _unavailable("decode", "decode", view.snap.size, request.model)
        decision = policy(snap, RouteQuery(sims, request.label, request.prompt_tokens), self.state, tables)
        index = decision.index
        engine_id = snap.engine_ids[index]
        row = view.row_of[index]
        self.fleet.on_decision_row(row, request.prompt_tokens, now)
        self._record(row, request.prompt_tokens)
        elapsed = time.perf_counter() - start
        fallback = fallback or decision.fallback
        self._count("decode", policy.name, fallback or "")
        self._seconds["decode"].observe(elapsed)
        if decision.band_size:
            self._band.observe(decision.band_size)
        reply = RouteDecodeReply(
            request_id=request.request_id,
            engine_id=engine_id,
            policy=policy.name,
            band_size=decision.band_size,
            decision_us=elapsed * 1e6,
            artifact_version=self.artifact.version if self.artifact is not None else None,
            fallback=fallback,
        )
        return Routed(reply, Decided("decode", request.request_id, engine_id, request.prompt_tokens))

    def route_dp(self, request: DpAsk, now: float) -> Routed:
        start = time.perf_counter()
        view = self.dp
        snap = view.prepare(now, self.settings.fresh_load_s, self._dp_columns)
        if not view.any_alive:
            return _unavailable("dp", "dp", snap.size)
        profile = self.dp_profile
        snap = _for_model(view, snap, request.model)
        if snap is None:
            return _unavailable("dp", "dp", view.snap.size, request.model)
        keyed = self._dp_reads_cached and request.block_keys is not None
        cached = None
        if keyed and not self.prefix.fresh(request, snap.engine_ids):  # else nothing is cached anywhere
            cached = self.prefix.cached(request, snap.engine_ids, self.fleet.block_size[view.rows], now)
        affinity = None
        if self.affinity is not None:  # the predicted signature against each engine's recent traffic
            affinity = self.affinity.predict(request.block_keys, snap.engine_ids, now)
        if keyed or self._dp_reads_tokens:
            query = RouteQuery(prompt_tokens=request.prompt_tokens, cached=cached, affinity=affinity)
        else:
            query = _NO_QUERY
        index = profile(snap, query, self.dp_state, _NO_TABLES).index
        engine_id = snap.engine_ids[index]
        row = view.row_of[index]
        # In flight on that engine: the prefill it will compute, i.e. the prompt less what it holds cached
        work = request.prompt_tokens - int(cached[index]) if cached is not None else request.prompt_tokens
        # Counted exactly only when a reporter will settle it (an ask from before `reporter`: by telemetry)
        reported = request.progress and request.reporter is not None
        self.fleet.on_decision_row(row, work, now, request.request_id if reported else None, request.reporter)
        self._record(row, work)
        if self.affinity is not None:
            self.affinity.routed(request.request_id, engine_id, request.block_keys, now)
        credited = float(cached[index]) if cached is not None else 0.0
        if keyed and self.prefix.record(engine_id, request, now, credited) and self._reads_blocks:
            self.fleet.touch()
        elapsed = time.perf_counter() - start
        self._count("dp", profile.name, "")
        self._seconds["dp"].observe(elapsed)
        reply = DpChoice(request.request_id, engine_id, request.prompt_tokens, elapsed * 1e6)
        return Routed(reply, Decided("dp", request.request_id, engine_id, work))
