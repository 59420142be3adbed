"""Prometheus metrics of the router (one set per process, labelled by route kind and policy)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

DECISIONS = Counter(
    "switchyard_router_decisions_total",
    "Routing decisions, by kind (decode|dp), policy and fallback reason ('' when the policy ran as designed).",
    ["kind", "policy", "fallback"],
)
DECISION_SECONDS = Histogram(
    "switchyard_router_decision_seconds",
    "In-process decision time (scoring + policy), by kind.",
    ["kind"],
    buckets=(2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3),
)
BAND_SIZE = Histogram(
    "switchyard_router_band_size",
    "Engines admitted by the locality filter (ELDR tau-band, Domain partition).",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
)
UNROUTABLE = Counter(
    "switchyard_router_unroutable_total", "Requests answered with an error because no engine was live.", ["kind"]
)
HELLOS_REFUSED = Counter(
    "switchyard_router_hellos_refused_total",
    "Hellos refused because the engine manifest lists the engine otherwise (role, model, base_url, ep_group, "
    "dp_rank) or not at all (unlisted).",
    ["reason"],
)
STALE_ENGINES = Gauge(
    "switchyard_router_stale_engines",
    "Known engines that are not candidates: dead, without fresh load data (fresh_load_s) or held.",
)
LIVE_ENGINES = Gauge("switchyard_router_live_engines", "Engines in the candidate set, by role.", ["role"])
ARTIFACT_VERSION = Gauge("switchyard_router_artifact_version", "Version of the routing artifact in use (0: none).")
ARTIFACTS_REFUSED = Counter(
    "switchyard_router_artifacts_refused_total",
    "Revisions of the routing-artifact key that could not be used (undecodable, wrong hash), by reason code.",
    ["code"],
)
ENGINES_REFUSED = Counter(
    "switchyard_router_engines_refused_total",
    "Hellos and telemetry from a new engine id refused because the router held max_engines engines, all live.",
)
INFLIGHT_DROPPED = Counter(
    "switchyard_router_inflight_dropped_total",
    "Decisions dropped from an engine's in-flight count unsettled, because it held max_inflight_per_engine "
    "(an engine routed to that often without reporting).",
)
PEER_DECISIONS_DROPPED = Counter(
    "switchyard_router_peer_decisions_dropped_total",
    "Other replicas' shared decisions not counted here, by reason: rate (over peer_decisions_per_s for one "
    "engine), inflight (peer_inflight_per_engine of that replica's decisions already counted on the engine), "
    "unknown_engine; prompt_tokens: counted, but at the bound (peer_max_prompt_tokens, the engine's KV capacity).",
    ["reason"],
)
PEER_MESSAGES_DROPPED = Counter(
    "switchyard_router_peer_messages_dropped_total",
    "Other replicas' decision messages dropped unread, by reason: bytes (the sender over "
    "peer_decision_bytes_per_s), peers (more senders than the router tracks).",
    ["reason"],
)
PROGRESS_REFUSED = Counter(
    "switchyard_router_progress_refused_total",
    "First-token and end reports not applied to the exact ledger, by reason: not_yours (the request was not "
    "asked for by the reporting gateway, or is not open).",
    ["reason"],
)
EXACT_EXPIRED = Counter(
    "switchyard_router_exact_expired_total",
    "Requests dropped from the exact ledger because their sender reported no progress within "
    "progress_ttl_s (no first token) or progress_decode_ttl_s (no end), by stage.",
    ["stage"],
)
TELEMETRY_GAPS = Counter("switchyard_router_telemetry_gaps_total", "Telemetry sequence gaps detected.")
KV_EVENTS = Counter(
    "switchyard_router_kv_events_total",
    "Engine KV-cache events applied to the precise prefix index, by op (stored/removed: blocks; cleared: ops).",
    ["op"],
)
AFFINITY_SIGNATURES = Counter(
    "switchyard_router_affinity_signatures_total",
    "Engines' prefill signatures read for expert-affinity dispatch (the gimbal-affinity DP profile), by outcome: "
    "used (filed under the routed request's prefix keys and added to its engine's traffic), not_routed (no "
    "request this replica sent is waiting for it), other_engine (the request was sent to another engine), shape "
    "(empty, or more layers x experts than SWITCHYARD_ROUTER_AFFINITY_MAX_FEATURES).",
    ["outcome"],
)
KV_REJECTED = Counter(
    "switchyard_router_kv_rejected_total",
    "KV-event messages refused after decoding, by reason: unknown_engine (no accepted hello, or not live), "
    "block_size (not the hello's capacity.block_size). Undecodable ones and those naming another engine than "
    "their subject are in switchyard_bus_rejected_total.",
    ["reason"],
)
KV_RESETS = Counter(
    "switchyard_router_kv_resets_total",
    "Times an engine's indexed blocks were dropped as unknown, by reason: seq_gap, seq_back (events lost or the "
    "engine restarted), restart (its telemetry restarted), block_size (a hello changed it), dead (the liveness "
    "rule), forgotten.",
    ["reason"],
)
PREFIX_BLOCKS = Gauge(
    "switchyard_router_prefix_blocks",
    "Blocks the prefix index holds, all engines, by index (precise, routed).",
    ["index"],
)
KV_TRUST = Counter(
    "switchyard_router_kv_trust_total",
    "What bounded an engine's KV claims (services.router.kv_trust), by outcome: rate (a message over the "
    "engine's keys/s bucket, dropped; its blocks cleared), over_capacity (blocks past its hello's kv_blocks, its "
    "oldest out), confirmed / unconfirmed (a routed claim's answer reported its cached tokens / far fewer: the "
    "claim dropped) / unreported (no usage in the answer), probe_full (a claim not credited: its engine's probe "
    "slots were taken), quarantined (repeated unconfirmed claims: blocks cleared, events ignored a while), "
    "ignored (a message from a quarantined engine).",
    ["outcome"],
)
FLEET_SATURATION = Gauge(
    "switchyard_router_fleet_saturation",
    "Each model's fleet saturation as this router's core counts it, for an autoscaler: the mean over its live "
    "engines of max(requests outstanding (running + waiting + decided since the last report) / the hello's "
    "capacity.max_running, KV cache usage). 1: every engine at its limit.",
    ["model_name"],
)
PREFIX_DROPPED = Counter(
    "switchyard_router_prefix_dropped_total",
    "Blocks dropped from the precise index because their engine held prefix_max_blocks (oldest out first).",
)


#: The per-engine gauges `EngineGauges` exports: family name, help, and the telemetry view's column it reads.
ENGINE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("switchyard_router_engine_running", "Requests running on the engine, as its last telemetry said.", "num_running"),
    ("switchyard_router_engine_waiting", "Requests queued on the engine, as its last telemetry said.", "num_waiting"),
    (
        "switchyard_router_engine_inflight",
        "Requests routed to the engine since its last telemetry (the router's in-flight compensation).",
        "inflight",
    ),
    ("switchyard_router_engine_kv_usage", "Fraction of the engine's KV cache in use (0..1).", "kv_usage"),
    (
        "switchyard_router_engine_expert_pressure",
        "The engine's MoE expert pressure (busiest EP rank's load over the mean rank's, 1 = balanced), per telemetry.",
        "expert_pressure",
    ),
)


class EngineGauges(Collector):
    """Per-engine load gauges (labels engine, role), built at scrape time from the last snapshot `publish` took.

    Setting one labelled `Gauge` child per engine and signal every housekeeping second costs a lock and a
    label lookup each (thousands per second in a large fleet, on the router's event loop), and children of
    forgotten engines would have to be removed by hand; a snapshot of the columns (a few numpy copies) costs
    neither, and a scrape from the metrics thread reads only the snapshot, never the live columns. One process
    runs one router core (the router service's, or a gateway's in-process one), so one snapshot is exported."""

    def __init__(self) -> None:
        self._snapshot: tuple[list[str], list[str], dict[str, np.ndarray]] = ([], [], {})

    def publish(self, engine_ids: Sequence[str], roles: Sequence[str], columns: dict[str, np.ndarray]) -> None:
        """Replace the snapshot: the live engines' ids, roles and one array per `ENGINE_GAUGES` column."""
        self._snapshot = (list(engine_ids), list(roles), {k: np.array(v, dtype=np.float64) for k, v in columns.items()})

    def collect(self) -> Iterator[GaugeMetricFamily]:
        engine_ids, roles, columns = self._snapshot  # one reference read: publish swaps the whole tuple
        for name, documentation, column in ENGINE_GAUGES:
            family = GaugeMetricFamily(name, documentation, labels=["engine", "role"])
            values = columns.get(column)
            if values is not None:
                for engine_id, role, value in zip(engine_ids, roles, values.tolist(), strict=True):
                    family.add_metric([engine_id, role], value)
            yield family


ENGINE_STATE = EngineGauges()
REGISTRY.register(ENGINE_STATE)


class Batched:
    """Observations for one histogram (or histogram child), appended to a list on the request path and folded
    in bulk by `flush` (the router's housekeeping, every second). `Histogram.observe` takes a lock and scans
    the buckets in Python per value, which costs more than the rest of a decision's bookkeeping; scrapes
    see the values up to a flush interval late."""

    def __init__(self, histogram: Any) -> None:
        self.histogram = histogram
        self.values: list[float] = []
        self.observe = self.values.append
        internals = ("_upper_bounds", "_buckets", "_sum")
        self._bulk = all(hasattr(histogram, name) for name in internals)  # prometheus_client's layout

    def flush(self) -> None:
        if not self.values:
            return
        values = np.asarray(self.values, dtype=np.float64)
        self.values.clear()
        h = self.histogram
        if not self._bulk:
            for value in values.tolist():
                h.observe(value)
            return
        bounds = np.asarray(h._upper_bounds, dtype=np.float64)
        # `observe` counts a value in the first bucket whose upper bound is >= it (the last bound is +Inf).
        counts = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds))
        for i in np.flatnonzero(counts[: len(bounds)]):
            h._buckets[i].inc(int(counts[i]))
        h._sum.inc(float(values.sum()))


class BatchedCount:
    """Increments of one counter (or counter child), added up on the request path and folded in by `flush`,
    like `Batched`: `Counter.inc` takes a lock, which a router woken by each request pays in full."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter
        self.pending = 0

    def inc(self) -> None:
        self.pending += 1

    def flush(self) -> None:
        if self.pending:
            self.counter.inc(self.pending)
            self.pending = 0
