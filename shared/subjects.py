"""Every NATS subject, stream and bucket name Switchyard uses, in one place.

The prefix (default `sy`) is configurable so that several Switchyard deployments, or a test run, can share
one NATS account without seeing each other's traffic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_token(value: str, what: str = "subject token") -> str:
    """Refuse ids that would break a subject (dots, wildcards, spaces)."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must match {_TOKEN.pattern}")
    return value


#: Who publishes routing decisions: router replicas, and gateways deciding in-process.
DECIDER_KINDS = ("router", "gateway")


@dataclass(frozen=True)
class Durable:
    """A durable JetStream consumer and the one role that owns it.

    Only the owner may create, update, inspect, pull from, acknowledge on or delete it (`shared.nats_auth`):
    a durable's filter and delivery pointer decide which messages its service ever sees, so a role that could
    rewrite them could make that service skip work for good. NATS permissions match whole subject tokens
    only, so each name is listed here once and used both by the code and by the permissions.
    """

    role: str
    stream: str
    name: str
    filter_subject: str


@dataclass(frozen=True)
class Subjects:
    prefix: str = "sy"

    def __post_init__(self) -> None:
        check_token(self.prefix, "subject prefix")

    # --- engine -> control plane (core NATS, latest value wins) ---
    def hello(self, engine_id: str) -> str:
        return f"{self.prefix}.engine.{check_token(engine_id, 'engine id')}.hello"

    def telemetry(self, engine_id: str) -> str:
        return f"{self.prefix}.engine.{check_token(engine_id, 'engine id')}.telemetry"

    @property
    def all_hello(self) -> str:
        return f"{self.prefix}.engine.*.hello"

    @property
    def all_telemetry(self) -> str:
        return f"{self.prefix}.engine.*.telemetry"

    @property
    def announce(self) -> str:
        """Control plane -> engines: publish your hello now (a service just started)."""
        return f"{self.prefix}.engine.announce"

    def signature(self, engine_id: str) -> str:
        """A prefill engine's `PrefillSignature` for one request (the gateway's handoff waits for it)."""
        return f"{self.prefix}.engine.{check_token(engine_id, 'engine id')}.signature"

    def kv_events(self, engine_id: str) -> str:
        """An engine's `KvEvents`: blocks its prefix cache stored, evicted or cleared (the precise prefix index)."""
        return f"{self.prefix}.engine.{check_token(engine_id, 'engine id')}.kv"

    @property
    def all_kv_events(self) -> str:
        return f"{self.prefix}.engine.*.kv"

    @property
    def all_signatures(self) -> str:
        return f"{self.prefix}.engine.*.signature"

    def engine_of(self, subject: str) -> str | None:
        """The engine id of a `<prefix>.engine.<id>.<kind>` subject (None for any other subject)."""
        parts = subject.split(".")
        if len(parts) == 4 and parts[0] == self.prefix and parts[1] == "engine":
            return parts[2]
        return None

    # --- engine -> control plane (JetStream, must not be lost) ---
    def expert_load(self, engine_id: str) -> str:
        return f"{self.prefix}.engine.{check_token(engine_id, 'engine id')}.expert_load"

    @property
    def all_expert_load(self) -> str:
        return f"{self.prefix}.engine.*.expert_load"

    @property
    def routing_samples(self) -> str:
        """Engines -> the ELDR refit: `RoutingSample`s, the routing fit's per-request training data."""
        return f"{self.prefix}.routing.samples"

    @property
    def legacy_routing_samples(self) -> str:
        """The same samples' subject before the rename (`sy.calibration.samples`): read, never written."""
        return f"{self.prefix}.calibration.samples"

    # --- control plane -> engines ---
    def migrate(self, engine_id: str) -> str:
        return f"{self.prefix}.engine.{check_token(engine_id, 'engine id')}.migrate"

    def layout(self, engine_id: str) -> str:
        return f"{self.prefix}.engine.{check_token(engine_id, 'engine id')}.layout"

    @property
    def placement_plan(self) -> str:
        return f"{self.prefix}.placement.plan"

    @property
    def calibration_request(self) -> str:
        """Calibration triggers (the API's `POST /v1/calibrations`), served by the placement service."""
        return f"{self.prefix}.placement.calibrate"

    # --- request/reply served by router replicas (queue group `router`) ---
    @property
    def route_decode(self) -> str:
        return f"{self.prefix}.route.decode"

    @property
    def route_dp(self) -> str:
        return f"{self.prefix}.route.dp"

    @property
    def route_decided(self) -> str:
        """Every replica's decisions (`RouteDecisions`), routers' and in-process gateways': subscribe here to
        count them all (in-flight compensation across replicas)."""
        return f"{self.prefix}.route.decided.>"

    def decided(self, kind: str, replica_id: str) -> str:
        """Where one replica publishes its own decisions: `<prefix>.route.decided.<kind>.<replica id>`, `kind`
        `router` or `gateway`. The subject names the replica, so a gateway's credentials can be limited to its own
        (`switchyard nats-config --gateways`) and a message naming another replica is refused (`decider_of`)."""
        if kind not in DECIDER_KINDS:
            raise ValueError(f"decider kind {kind!r} must be one of {', '.join(DECIDER_KINDS)}")
        return f"{self.prefix}.route.decided.{kind}.{check_token(replica_id, 'replica id')}"

    def all_decided_by(self, kind: str) -> str:
        """Every replica of one kind's decisions (a permission: the router role publishes under any router id)."""
        if kind not in DECIDER_KINDS:
            raise ValueError(f"decider kind {kind!r} must be one of {', '.join(DECIDER_KINDS)}")
        return f"{self.prefix}.route.decided.{kind}.*"

    def decider_of(self, subject: str) -> str | None:
        """The replica id of a `<prefix>.route.decided.<kind>.<id>` subject (None for any other subject)."""
        parts = subject.split(".")
        if len(parts) == 5 and parts[0] == self.prefix and parts[1:3] == ["route", "decided"]:
            return parts[4]
        return None

    @property
    def route_progress(self) -> str:
        """Every gateway's progress of requests it routed with ``progress`` (`RouteProgress`): routers settle
        their exact ledgers from it (a subscription; each gateway publishes on its own `progress`)."""
        return f"{self.prefix}.route.progress.*"

    def progress(self, reporter: str) -> str:
        """Where one gateway publishes its progress: `<prefix>.route.progress.<reporter>`, its NATS user (only that
        user may publish there), so a router settles only the requests that gateway asked for (`reporter_of`)."""
        return f"{self.prefix}.route.progress.{check_token(reporter, 'reporter')}"

    def reporter_of(self, subject: str) -> str | None:
        """The reporter of a `<prefix>.route.progress.<reporter>` subject (None for any other subject)."""
        parts = subject.split(".")
        if len(parts) == 4 and parts[0] == self.prefix and parts[1:3] == ["route", "progress"]:
            return parts[3]
        return None

    @property
    def router_queue(self) -> str:
        return f"{self.prefix}-router"

    # --- simulated fleet only (engine_agents/sim): requests in, completions out ---
    def sim_submit(self, engine_id: str) -> str:
        """Load generator -> a simulated prefill engine: a new request (a real deployment's proxy does this)."""
        return f"{self.prefix}.sim.submit.{check_token(engine_id, 'engine id')}"

    @property
    def sim_completed(self) -> str:
        """Simulated decode engines -> load generator / dashboards: a finished request and its latencies."""
        return f"{self.prefix}.sim.completed"

    # --- JetStream streams and KV buckets (names may not contain dots) ---
    @property
    def expert_load_stream(self) -> str:
        return f"{self.prefix.upper()}_EXPERT_LOAD"

    @property
    def placement_stream(self) -> str:
        return f"{self.prefix.upper()}_PLACEMENT"

    @property
    def routing_samples_stream(self) -> str:
        return f"{self.prefix.upper()}_ROUTING_SAMPLES"

    @property
    def legacy_routing_samples_stream(self) -> str:
        """The routing samples' stream before the rename: `switchyard fit` still reads it where it exists,
        until its samples age out (a week) or an operator deletes it (docs/architecture.md)."""
        return f"{self.prefix.upper()}_CALIBRATION"

    @property
    def router_bucket(self) -> str:
        return f"{self.prefix}-router"

    @property
    def lease_bucket(self) -> str:
        """One owner per engine group across replicas of the placement and migration services."""
        return f"{self.prefix}-leases"

    @property
    def artifact_key(self) -> str:
        return "artifact"

    def streams(self) -> dict[str, list[str]]:
        """Stream name -> subjects it captures; `shared.bus.Bus.ensure_streams` creates them all."""
        return {
            self.expert_load_stream: [self.all_expert_load],
            self.placement_stream: [self.placement_plan, self.calibration_request],
            self.routing_samples_stream: [self.routing_samples],
        }

    # --- durable consumers (each owned by one role; see `Durable`) ---
    @property
    def migration_plans(self) -> Durable:
        """The migration service's plans (its replicas share it)."""
        return Durable("migration", self.placement_stream, "migration", self.placement_plan)

    @property
    def calibration_requests(self) -> Durable:
        """The placement service's calibration requests (the API's `POST /v1/calibrations`)."""
        return Durable("placement", self.placement_stream, "placement-calibrate", self.calibration_request)

    def durables(self) -> list[Durable]:
        """Every durable consumer of the contract; every other consumer is ephemeral."""
        return [self.migration_plans, self.calibration_requests]
