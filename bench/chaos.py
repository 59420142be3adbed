"""`make chaos`: the whole loop on loopback, in its production shape, one fault at a time, measured.

Each service runs as its own process (`switchyard router|placement|migration|api|gateway`, the simulated fleet
as `switchyard fleet`), with an embedded nats-server whose JetStream store survives its restart and a throwaway
PostgreSQL cluster this script starts itself (SQLite if no PostgreSQL is installed). The production shape:

- per-role NATS users (`shared.nats_auth`: one per service role, `gateway-<id>` per gateway replica, `fleet`
  for the simulated fleet's engine ids, `engine-<id>` for the ghost decoder, the HTTP stub engines and one
  attacker); each process gets a credentials file holding only its own entry (`SWITCHYARD_NATS_CREDENTIALS`),
  this script connects as `admin`;
- signed routing artifacts (`SWITCHYARD_ARTIFACT_KEY_FILE` for the fit step, the routers, the gateways and the
  API; the artifact is published under the `fit` user);
- an engine manifest (`SWITCHYARD_ENGINE_MANIFEST`, every service) binding each engine the run starts to its
  role, model, group, rank and (HTTP stubs) base URL; the attacker is not in it;
- two replicas each of router, placement, migration and gateway (`--router-replicas`, `--replicas`).

This process sends the client load to the fleet's prefill engines (`sy.sim.submit.<id>`), probes
`sy.route.decode` at a steady rate, watches every engine's telemetry, and runs one extra decoder (`ghost-d0`,
a process of its own that the routing artifact names) to vanish and to be slow. With the gateway installed,
it sends a second client load as OpenAI completions round robin over the gateways (attempt by attempt), which
choose one of two stub DP engines that answer HTTP (`http-e0`, `http-e1`): in-process by default (the router's
core inside each gateway, each replica `g<n>` sharing its decisions as NATS user `gateway-g<n>`), or by asking
the routers' `sy.route.dp` (`--gateway-router remote`).
Then, in turn:

  router / gateway: SIGKILL one of the replicas, restart it at once;
  placement / migration: SIGKILL the replica holding the group leases, restart it at once;
  api: SIGKILL, restart at once (its resume counts in the closing line's max resume);
  nats: stop the server and start it again on the same port and store (with --nats-cluster: every node);
  nats-node (only with --nats-cluster N, N >= 3): NATS is a JetStream cluster of N nodes on loopback (every
  stream and bucket with N replicas); SIGKILL the node leading the plans' stream, restart it after
  --node-down-s on its port and store;
  postgres: crash the cluster (`pg_ctl -m immediate`) and start it again;
  engine-vanish: SIGKILL the ghost decoder (no goodbye);
  slow-engine: a ghost decoder whose telemetry arrives every 1.5 s (later than the 1 s staleness limit);
  migration-active: wait for a running migration, SIGKILL the migration replica holding its group's lease and
  leave it dead for the lease's TTL + half a window: the standby must finish the migration (stuck if not);
  role-claim: with the attacker's credentials, hellos as role `dp`, then `prefill`, naming the base URL of an
  HTTP server this script runs; every client request that reaches it is misrouted;
  stream-flood: with the attacker's credentials, near-limit payloads on its own `sy.engine.attacker.expert_load`
  (captured by the expert-load stream) for the window; the note gives the stream's size before and after and
  whether the other engines' latest windows are still in it (an evicted one is lost);
  nats-quorum (only with --nats-cluster 3 and --faults nats-quorum): SIGKILL 2 of 3 nodes (no stream has a
  quorum), restart both after --node-down-s (`chaos_outages.py`);
  postgres-long (only with --faults postgres-long): PostgreSQL crashed and down --pg-down-s (60 s), restarted;
  both windows run --fault-s past the recovery;
  flood (only with --faults flood): near-limit payloads on the attacker's hello and telemetry subjects, as fast
  as one client can send them; the note counts nats-server's slow consumer cut-offs by connection name.
  engine-bigbody / engine-hugeheader: a listed DP engine whose answers declare 2^30 bytes / never end their
  head; kv-claim: one KvEvents from http-e0 claiming a prompt's blocks, and requests sharing it before and
  after; kv-flood, decision-flood (only when named): 8,192-key KvEvents / 4,096-entry RouteDecisions as fast as
  one client publishes, under an engine's / gateway-g2's credentials (issue 37: `chaos_attacks.py`, which also
  records the gateways' RSS and CPU and the routers' CPU around each of these faults).

Per fault: client requests lost (sent in the fault's window and never completed; through the gateway: never
answered 200 within 20 s of retries every 0.5 s, with the first attempts that failed; the gateway and router
faults' notes say what the gateways' clients saw), probes that failed,
seconds until routing resumed, placements / migrations lost, duplicated or stuck, live layouts that differ
from what the database says was applied (a move applied twice or lost), and probes routed to an engine that
had been silent longer than its staleness limit. After the run: routing samples stored twice or given up by the
fleet (counted as duplicated / lost). The closing line:

  chaos: <faults> faults, lost <n>, duplicated <n>, stuck <n>, misrouted <n>, max resume <s> s

    python bench/chaos.py                      # every fault, ~5-6 minutes
    python bench/chaos.py --faults router,nats --fault-s 8
    python bench/chaos.py --nats-cluster 3 --faults nats-node --fault-s 15   # a NATS cluster loses one node
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import logging
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from chaos_attacks import HOSTILE_ENGINES, NAMED_FAULTS, QUICK_FAULTS, Attacks
from chaos_infra import (
    ServiceProcess,
    ThrowawayPostgres,
    cli,
    find_postgres_bin,
    free_port,
    gateway_available,
    service_env,
)
from chaos_outages import kill_quorum, postgres_outage

log = logging.getLogger("chaos")

SERVICE_FAULTS = ("router", "placement", "migration", "api")
#: Issue 29: the production shape's own faults (an active migration replica killed mid-migration, an engine
#: credential claiming another role, one engine flooding its own expert-load subject into the stream).
ATTACK_FAULTS = ("migration-active", "role-claim", "stream-flood")
#: Issue 37's attacks on the gateways (`chaos_attacks.py`): a hostile engine's answers, a lying KV claim (quick,
#: in the default set); a KV-event flood and a leaked replica's decision flood (named only: each keeps a core busy).
FAULTS = (*SERVICE_FAULTS, "gateway", "nats", "postgres", "engine-vanish", "slow-engine", *ATTACK_FAULTS, *QUICK_FAULTS)
#: Faults run only when asked for (`--faults flood`): issue 15 finding 3, near-limit payloads on the engines'
#: wildcard subjects.
#: `nats-node` (with --nats-cluster): SIGKILL the cluster node leading the plans' stream, restart it after
#: `--node-down-s` (issue 28: a NATS cluster loses one node under load and nothing stored is lost).
#: `nats-quorum` and `postgres-long` (issue 37): 2 of 3 NATS nodes killed, PostgreSQL down --pg-down-s.
EXTRA_FAULTS = ("flood", "nats-node", "nats-quorum", "postgres-long", *NAMED_FAULTS)
#: Faults that need the gateway (its load, its engines).
GATEWAY_FAULTS = ("gateway", "role-claim", *QUICK_FAULTS, *NAMED_FAULTS)
GHOST = "ghost-d0"
GHOST_MODEL = "deepseek-v2-lite"
#: Stub engines (engine_agents/stub.py) behind the gateway: its load goes gateway -> router -> engine over HTTP.
HTTP_ENGINES = ("http-e0", "http-e1")
STUB_MODEL = "stub-model"
#: An engine with valid credentials of its own (`engine-attacker`) and no place in the engine manifest: it claims
#: roles (`role-claim`) and floods its expert-load subject (`stream-flood`, `flood`).
ATTACKER = "attacker"
#: The migration lease's TTL (the services' default): a standby takes a lapsed group over after at most this.
MIGRATION_LEASE_TTL_S = 10.0
#: The stream flood stops after this many bytes even if its window is not over (the store is on this disk).
STREAM_FLOOD_CAP_BYTES = 2 << 30
STALE_AFTER_S = 1.0
#: A probe reply naming an engine silent for longer than this is misrouted (staleness limit + one telemetry
#: interval + scheduling slack: the router and this process see the same telemetry a few ms apart).
MISROUTE_AFTER_S = STALE_AFTER_S + 0.35
FINAL = ("succeeded", "failed", "rolled_back", "refused")


@dataclass
class ChaosOptions:
    faults: tuple[str, ...] = FAULTS
    fault_s: float = 12.0  # each fault's window (the fault is injected 1 s in)
    rate: float = 8.0  # client requests per second
    gateway_rate: float = 8.0  # client requests per second through the gateway (HTTP)
    probe_hz: float = 20.0
    prefill: int = 2
    decode: int = 3
    speed: float = 1.0
    settle_s: float = 20.0  # after the last fault, before the audit
    retry_after_s: float = 20.0  # a client resends a request unfinished this long (once)
    stuck_after_s: float = 30.0  # a placement or migration unresolved this long is stuck
    database: str = "auto"  # auto (PostgreSQL if installed), postgres, sqlite
    workdir: Path | None = None
    seed: int = 0
    #: Router replicas (one queue group); the `router` fault SIGKILLs the first. With one, routing is down until
    #: the new process has started, which on a loaded machine is mostly the interpreter waiting for CPU.
    router_replicas: int = 2
    #: Replicas of placement, migration and the gateway (the production shape: two of each); their faults kill
    #: one (placement and migration: the replica holding the group leases; the gateway: the first).
    replicas: int = 2
    #: How the gateways decide: `inprocess` (the default: the router's core inside each gateway, decisions
    #: shared under the replica's own NATS user) or `remote` (each asks `switchyard router` over sy.route.dp).
    gateway_router: str = "inprocess"
    #: NATS as a JetStream cluster of this many nodes (streams and buckets with as many replicas, at most 5);
    #: 0: one embedded server. The `nats-node` fault needs one.
    nats_cluster: int = 0
    #: How long the `nats-node` fault leaves its node down.
    node_down_s: float = 4.0
    #: How long the `postgres-long` fault leaves PostgreSQL down.
    pg_down_s: float = 60.0


@dataclass
class Probe:
    sent: float
    ok: bool
    engine: str = ""
    answered: float = 0.0
    error: str = ""  # why it failed: the router's error code, or the exception (timeout, no responders)


@dataclass
class FaultResult:
    name: str
    start: float
    injected: float
    end: float
    note: str = ""
    sent: int = 0
    retried: int = 0
    lost: int = 0
    probes: int = 0
    probe_failures: int = 0
    resume_s: float = 0.0
    resumed: bool = True  # a probe succeeded after the last failed one, within the window
    misrouted: int = 0
    api_failed: int = 0  # API probes not answered 2xx (refused connection, timeout, any 5xx: 503 too)
    api_500: int = 0  # API probes answered with a 5xx other than 503 (an outage must say 503)
    api_resume_s: float = 0.0  # seconds until the API answered again (its own restart)
    gw_sent: int = 0  # requests through the gateway
    gw_failed: int = 0  # ... whose first attempt failed (then retried every 0.5 s)
    gw_lost: int = 0  # ... that never succeeded within `retry_after_s`
    gw_resume_s: float = 0.0  # seconds until the gateway answered again after its last failed attempt
    hijacked: int = 0  # requests that reached the attacker's server (role-claim): counted as misrouted
    extra_lost: int = 0  # the fault's own losses (stream-flood: other engines' windows evicted from the stream)
    extra_stuck: int = 0  # the fault's own (migration-active: the killed replica's migration not finished)
    placements: int = 0
    migrations: int = 0
    lost_rows: int = 0
    duplicated: int = 0
    stuck: int = 0


@dataclass
class Audit:
    """The database and the engines after the run, attributed to the fault window each row was created in."""

    placements: list[tuple[int, str, str, float]] = field(default_factory=list)  # id, plan_id, status, created
    migrations: list[tuple[int, int, str, float]] = field(default_factory=list)  # id, placement_id, state, updated
    lost: list[float] = field(default_factory=list)  # created_at of each lost row
    duplicated: list[float] = field(default_factory=list)
    stuck: list[float] = field(default_factory=list)
    layout_mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Routing samples in the stream, those stored twice (same engine and request), and those the fleet gave up
    #: publishing (its log's "not published" warnings: lost).
    samples: int = 0
    samples_duplicated: int = 0
    samples_lost: int = 0


class Chaos:
    """The harness: infrastructure, processes, load, probes and the faults; `run()` returns per-fault results."""

    def __init__(self, options: ChaosOptions) -> None:
        self.o = options
        self.sent: dict[str, float] = {}  # request id -> wall time sent
        self.done: dict[str, float] = {}
        self.submits: dict[str, tuple[str, bytes]] = {}  # request id -> (subject, payload), for the one retry
        self.retried: set[str] = set()
        self.probes: list[Probe] = []
        #: engine id -> the `ts` of each of its telemetry messages (same host, same clock); judged after the run,
        #: so a message that reached this process late (its connection was reconnecting) still counts.
        self.telemetry: dict[str, list[float]] = {}
        #: When this process's own NATS connection was down: telemetry it missed then cannot judge a probe.
        self.blind: list[tuple[float, float]] = []
        self.api_probes: list[tuple[float, int | None]] = []  # (time, HTTP status or None)
        #: Requests through the gateway: (sent, first attempt ok, finally ok); and every attempt (time, ok).
        self.gw_requests: list[tuple[float, bool, bool]] = []
        self.gw_attempts: list[tuple[float, bool]] = []
        #: Every attempt's (time, gateway index, HTTP status or None, the answer's `served_by` engine or "").
        self.gw_answers: list[tuple[float, int, int | None, str]] = []
        self.procs: dict[str, ServiceProcess] = {}
        self.notes: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        #: Replica id -> process name (placement and migration leases name the replica that holds them).
        self.replica_proc: dict[str, str] = {}
        self.gateway_urls: list[str] = []
        self.windows_by: dict[str, list[tuple[float, float]]] = {}  # placement replica -> (time, windows)
        self._attack: dict[str, object] = {}  # what the running attack fault needs in `_after`
        self.attacks = Attacks(self, HTTP_ENGINES, STUB_MODEL)  # issue 37's faults (chaos_attacks.py)

    # ----- infrastructure -----

    def _secure(self, root: Path) -> str:
        """The production shape's secrets: one NATS user per role (each process gets a credentials file holding
        only its own entry), the artifact signing key and the engine manifest. Returns the server's
        `authorization` block."""
        import secrets

        from switchyard.engine_agents.sim.live.fleet_types import LiveFleetConfig
        from switchyard.shared.nats_auth import (
            SERVICE_ROLES,
            Credentials,
            engine_user,
            gateway_user,
            render_authorization,
        )
        from switchyard.shared.subjects import Subjects

        self.config = LiveFleetConfig(prefill=self.o.prefill, decode=self.o.decode, speed=self.o.speed)
        self.fleet_ids = [*self.config.prefill_ids(), *self.config.decode_ids()]
        engines = [GHOST, *HTTP_ENGINES, ATTACKER, *HOSTILE_ENGINES]
        # Each gateway replica its own user: it decides in-process and publishes its decisions under its own id.
        gateways = [gateway_user(gateway_id(replica)) for replica in range(1, self.o.replicas + 1)]
        credentials = Credentials.generate([*SERVICE_ROLES, "fleet", *gateways, *(engine_user(e) for e in engines)])
        self.credentials = credentials
        self.creds_dir = root / "credentials"
        for role, entry in credentials.users.items():
            Credentials({role: entry}).save(self.creds_dir / f"{role}.json")
        self.key_file = root / "artifact.key"
        self.key_file.touch(mode=0o600)
        self.key_file.write_text(secrets.token_hex(32) + "\n")
        self.stub_ports = {engine_id: free_port() for engine_id in HTTP_ENGINES}
        self.attacks.reserve_ports(free_port)
        self.manifest_file = root / "engines.json"  # written once the fleet's model is known (_publish_artifact)
        return render_authorization(Subjects("sy"), credentials, fleet_engines=self.fleet_ids)

    def _write_manifest(self, model: str) -> None:
        """Every engine the run starts, bound to its role, group, rank, model and (for HTTP engines) base URL.
        The attacker is not listed: its credentials are valid, its place in the fleet is not."""
        manifest: dict[str, dict[str, object]] = {}
        for role, ids in (("prefill", self.config.prefill_ids()), ("decode", self.config.decode_ids())):
            for engine_id in ids:
                manifest[engine_id] = {"role": role, "model": model, "ep_group": engine_id, "dp_rank": 0}
        manifest[GHOST] = {"role": "decode", "model": GHOST_MODEL, "ep_group": GHOST, "dp_rank": 0}
        for engine_id, port in self.stub_ports.items():
            manifest[engine_id] = {
                "role": "dp",
                "base_url": f"http://127.0.0.1:{port}",
                "model": STUB_MODEL,
                "ep_group": engine_id,
                "dp_rank": 0,
            }
        manifest.update(self.attacks.manifest())  # the hostile engines: listed, as a compromised engine is
        self.manifest_file.write_text(json.dumps(manifest, indent=2) + "\n")

    @property
    def stream_replicas(self) -> int:
        return min(self.o.nats_cluster, 5) or 1

    def role_settings(self, role: str) -> object:
        from switchyard.shared.settings import SwitchyardSettings

        return SwitchyardSettings(
            nats_servers=self.nats_urls,
            stream_replicas=self.stream_replicas,
            database_url=self.database_url,
            nats_credentials=self.creds_dir / f"{role}.json",
            artifact_key_file=self.key_file,
        )

    async def _start_infra(self, root: Path) -> None:
        from switchyard.shared.bus import Bus
        from switchyard.shared.db.engine import upgrade
        from switchyard.shared.embedded import EmbeddedNats
        from switchyard.shared.nats_cluster import NatsCluster

        self.root = root
        block = self._secure(root)
        self.cluster: NatsCluster | None = None
        if self.o.nats_cluster:  # every stream and bucket on that many nodes: losing one loses nothing
            self.cluster = NatsCluster(root / "nats", self.o.nats_cluster, extra_config=block)
            self.nats_urls = await asyncio.to_thread(self.cluster.start)
            self.nats_nodes: list[EmbeddedNats] = list(self.cluster.nodes)
        else:
            nats = EmbeddedNats(root / "nats", extra_config=block)
            self.nats_urls = [await asyncio.to_thread(nats.start)]
            self.nats_nodes = [nats]
        self.nats_url = ",".join(self.nats_urls)  # SWITCHYARD_NATS_SERVERS and the engines' --nats-url
        self.pg: ThrowawayPostgres | None = None
        bin_dir = find_postgres_bin() if self.o.database in ("auto", "postgres") else None
        if bin_dir is not None:
            self.pg = ThrowawayPostgres(root / "pg", bin_dir)
            await asyncio.to_thread(self.pg.init)
            await asyncio.to_thread(self.pg.start)
            self.database_url = self.pg.url
        else:
            if self.o.database == "postgres":
                raise SystemExit("chaos: --database postgres but no PostgreSQL binaries (initdb, pg_ctl) found")
            self.database_url = f"sqlite:///{root / 'switchyard.db'}"
            self.notes.append("no PostgreSQL binaries found: SQLite instead, the postgres fault is skipped")
        await asyncio.to_thread(upgrade, self.database_url)
        # This process is the operator and the observer: it sets the streams up and watches everything as admin.
        self.settings = self.role_settings("admin")
        self.bus = await Bus.connect(self.settings, name="chaos", role="admin")
        # The script's own telemetry watch (a wildcard) on a connection of its own, as the services have: a
        # flood there must not cut off the connection that sends the probes and the load.
        self.watch_bus = await Bus.connect(self.settings, name="chaos-watch", role="admin")
        await self.bus.ensure_streams()
        await self.bus.ensure_kv(self.bus.subjects.router_bucket)

    async def _publish_artifact(self) -> None:
        from switchyard import data as shipped
        from switchyard.engine_agents.sim.live.engines import LiveFleet
        from switchyard.services.artifacts import publish_artifact
        from switchyard.shared.bus import Bus
        from switchyard.simulator.offline.scenario import prepare
        from switchyard.solver.eldr_fit import FitOptions, fit_routing_artifact

        self.trace = self.settings.trace(shipped.ESFT)
        self.scenario = await asyncio.to_thread(prepare, self.trace, gpu=self.config.gpu, seed=self.o.seed)
        self._write_manifest(self.scenario.model.name)
        decoders = [*self.config.decode_ids(), GHOST]
        calibration = self.scenario.counts.subset(self.scenario.calib)
        artifact, report = await asyncio.to_thread(
            fit_routing_artifact, calibration, len(decoders), FitOptions(seed=self.o.seed), decoder_ids=decoders
        )
        # The fit job: its own NATS user (the only one that may write the artifact) and the signing key.
        fit = self.role_settings("fit")
        fit_bus = await Bus.connect(fit, name="switchyard-fit", role="fit")
        try:
            await publish_artifact(
                artifact,
                report,
                out=self.root / "artifact.msgpack",
                database_url=self.database_url,
                bus=fit_bus,
                key=fit.artifact_key(),
            )
        finally:
            await fit_bus.close()
        self.max_tokens = LiveFleet(self.scenario, self.config).max_tokens
        fleet = LiveFleet(self.scenario, self.config)
        self.signatures = fleet.signatures

    def _processes(self) -> None:
        from switchyard.shared.nats_auth import engine_user, gateway_user

        env = service_env(
            {
                "SWITCHYARD_DATABASE_URL": self.database_url,
                "SWITCHYARD_NATS_SERVERS": self.nats_url,
                "SWITCHYARD_STREAM_REPLICAS": str(self.stream_replicas),
                "SWITCHYARD_LOG_LEVEL": "INFO",
                "SWITCHYARD_ARTIFACT_KEY_FILE": str(self.key_file),
                "SWITCHYARD_ENGINE_MANIFEST": str(self.manifest_file),
                # a loop that does something within a few minutes: plan often, publish any gain
                "SWITCHYARD_PLACEMENT_PERIOD_S": "6",
                "SWITCHYARD_PLACEMENT_MIN_INTERVAL_S": "3",
                "SWITCHYARD_PLACEMENT_GAIN_THRESHOLD": "0",
                "SWITCHYARD_PLACEMENT_INFLIGHT_TIMEOUT_S": "60",
                "SWITCHYARD_MIGRATION_STEP_TIMEOUT_S": "5",
                "SWITCHYARD_MIGRATION_RETRY_BACKOFF_S": "0.2",
                "SWITCHYARD_MIGRATION_LEASE_TTL_S": str(MIGRATION_LEASE_TTL_S),
                "SWITCHYARD_ROUTER_STALE_AFTER_S": str(STALE_AFTER_S),
            }
        )
        logs = self.root / "logs"
        logs.mkdir(exist_ok=True)
        api_port = free_port()
        self.api_url = f"http://127.0.0.1:{api_port}"
        #: process name -> (argv, role, extra environment)
        commands: dict[str, tuple[list[str], str, dict[str, str]]] = {}
        for replica in range(1, self.o.router_replicas + 1):  # the `router` fault kills the first
            commands["router" if replica == 1 else f"router-{replica}"] = (cli("router"), "router", {})
        self.placement_metrics: dict[str, int] = {}
        for kind in ("placement", "migration"):
            for replica in range(1, self.o.replicas + 1):
                name = kind if replica == 1 else f"{kind}-{replica}"
                replica_id = f"chaos-{kind}-{replica}"
                self.replica_proc[replica_id] = name
                extra = {f"SWITCHYARD_{kind.upper()}_REPLICA_ID": replica_id}
                if kind == "placement":
                    self.placement_metrics[name] = free_port()
                    extra["SWITCHYARD_PLACEMENT_METRICS_PORT"] = str(self.placement_metrics[name])
                commands[name] = (cli(kind), kind, extra)
        commands["api"] = (cli("api", "--port", str(api_port)), "api", {})
        fleet_args = ("--prefill", str(self.o.prefill), "--decode", str(self.o.decode), "--speed", str(self.o.speed))
        commands["fleet"] = (cli("fleet", *fleet_args, "--seed", str(self.o.seed)), "fleet", {})
        gateway_ports: dict[str, int] = {}
        if gateway_available():
            for replica in range(1, self.o.replicas + 1):  # the load goes round robin over them
                name = "gateway" if replica == 1 else f"gateway-{replica}"
                gateway_ports[name] = free_port()
                # Its router settings are the routers' (SWITCHYARD_ROUTER_*, key file and manifest: `env`).
                extra = {"SWITCHYARD_GATEWAY_GATEWAY_ID": gateway_id(replica)}
                argv = cli("gateway", "--port", str(gateway_ports[name]), "--router", self.o.gateway_router)
                commands[name] = (argv, gateway_user(gateway_id(replica)), extra)
            for engine_id in HTTP_ENGINES:  # DP engines that answer HTTP: what the gateway's load reaches
                argv = [
                    sys.executable,
                    "-m",
                    "switchyard.engine_agents.stub",
                    *("--engine-id", engine_id, "--nats-url", self.nats_url, "--tokens", "8"),
                    *("--token-interval-s", "0.01", "--port", str(self.stub_ports[engine_id])),
                ]
                commands[engine_id] = (argv, engine_user(engine_id), {})
        self.gateway_urls = [f"http://127.0.0.1:{port}" for port in gateway_ports.values()]
        commands[GHOST] = (self._ghost_argv(late_s=None), engine_user(GHOST), {})
        for name, (argv, role, extra) in commands.items():
            role_env = {**env, "SWITCHYARD_NATS_CREDENTIALS": str(self.creds_dir / f"{role}.json"), **extra}
            log_name = "ghost" if name == GHOST else name
            self.procs[name] = ServiceProcess(name, argv, role_env, logs / f"{log_name}.log")
        self.procs["api"].ready_port = api_port
        for name, port in gateway_ports.items():
            self.procs[name].ready_port = port

    def _ghost_argv(self, late_s: float | None) -> list[str]:
        argv = [sys.executable, str(Path(__file__).resolve()), "--engine", GHOST, "--nats-url", self.nats_url]
        return argv + (["--late-s", str(late_s)] if late_s else [])

    # ----- load, probes, telemetry -----

    async def _watch(self) -> None:
        from switchyard.engine_agents.sim.live.protocol import SimCompleted
        from switchyard.shared.schemas import Telemetry

        def on_telemetry(t: Telemetry, _msg: object) -> None:
            self.telemetry.setdefault(t.engine_id, []).append(t.ts)

        def on_done(done: SimCompleted, _msg: object) -> None:
            self.done.setdefault(done.request_id, time.time())

        await self.watch_bus.subscribe(self.bus.subjects.all_telemetry, Telemetry, on_telemetry)
        await self.bus.subscribe(self.bus.subjects.sim_completed, SimCompleted, on_done)

    async def _load(self) -> None:
        from switchyard.engine_agents.sim.live.protocol import SimSubmit
        from switchyard.shared.codec import encode

        w = self.scenario.workload(4096, seed=self.o.seed + 1, rate=self.o.rate, max_tokens=self.max_tokens)
        # Short replies keep the final drain short: the faults are about the control plane, not long decodes.
        output = np.minimum(w.output, 64)
        prefills = self.config.prefill_ids()
        rng = np.random.default_rng(self.o.seed + 2)
        i = 0
        while not self._stop.is_set():
            k = i % w.size
            rid = f"c{i}"
            submit = SimSubmit(
                request_id=rid,
                replay=int(w.replay[k]),
                prompt_tokens=int(w.prompt[k]),
                output_tokens=int(output[k]),
                sent_at=time.time(),
            )
            self.sent[rid] = time.time()
            subject = self.bus.subjects.sim_submit(prefills[i % len(prefills)])
            self.submits[rid] = (subject, encode(submit))
            try:
                await self.bus.publish(subject, submit)
            except Exception as exc:  # the client could not even send: counted as lost by the audit
                log.warning("load: %s not sent: %s", rid, exc)
            i += 1
            await asyncio.sleep(float(rng.exponential(1.0 / self.o.rate)))

    async def _retry(self) -> None:
        """A client whose request has not finished after `retry_after_s` sends it once more, as a real one would:
        the simulated request path (submit and completion) rides core NATS, which drops what is in flight
        while the server restarts. A request still unfinished after its retry is lost."""
        while True:
            now = time.time()
            for rid, sent in list(self.sent.items()):
                if now - sent > self.o.retry_after_s and rid not in self.done and rid not in self.retried:
                    self.retried.add(rid)
                    subject, payload = self.submits[rid]
                    with contextlib.suppress(Exception):
                        await self.bus.nc.publish(subject, payload)
            await asyncio.sleep(1.0)

    async def _probe_once(self, i: int) -> None:
        from switchyard.shared.errors import RemoteError
        from switchyard.shared.schemas import RouteDecodeReply, RouteDecodeRequest

        sent = time.time()
        request = RouteDecodeRequest(
            request_id=f"probe-{i}", prompt_tokens=1, signature=self.signatures[i % len(self.signatures)]
        )
        try:
            reply = await self.bus.request(self.bus.subjects.route_decode, request, RouteDecodeReply, timeout=0.5)
        except RemoteError as exc:
            self.probes.append(Probe(sent, False, error=exc.code))
            return
        except Exception as exc:
            self.probes.append(Probe(sent, False, error=type(exc).__name__))
            return
        self.probes.append(Probe(sent, True, reply.engine_id, time.time()))

    async def _probes(self) -> None:
        pending: set[asyncio.Task[None]] = set()
        i = 0
        down_since: float | None = None
        while not self._stop.is_set():
            connected = self.bus.nc.is_connected and self.watch_bus.nc.is_connected
            if not connected and down_since is None:
                down_since = time.time()
            elif connected and down_since is not None:
                self.blind.append((down_since, time.time()))
                down_since = None
            task = asyncio.create_task(self._probe_once(i))
            pending.add(task)
            task.add_done_callback(pending.discard)
            i += 1
            await asyncio.sleep(1.0 / self.o.probe_hz)
        if pending:
            await asyncio.wait(pending)

    async def _wait_routing(self, within_s: float = 60.0) -> float:
        """Seconds until a probe succeeds (the loop is up)."""
        start = time.monotonic()
        n = len(self.probes)
        while time.monotonic() - start < within_s:
            if any(p.ok for p in self.probes[n:]):
                return time.monotonic() - start
            await asyncio.sleep(0.05)
        raise RuntimeError("routing never answered: see the logs under " + str(self.root / "logs"))

    # ----- faults -----

    async def _restart(self, name: str) -> None:
        proc = self.procs[name]
        await asyncio.to_thread(proc.kill)
        proc.start()  # not waited for: the probes measure when it answers again

    async def _lease_holders(self, kind: str) -> dict[str, str]:
        """Group -> the replica id holding `kind`'s lease of it, as the leases bucket says now."""
        holders: dict[str, str] = {}
        try:
            kv = await self.bus.js.key_value(self.bus.subjects.lease_bucket)
            keys = await kv.keys()
        except Exception:  # no bucket or no key yet
            return holders
        for key in keys:
            if key.startswith(f"{kind}."):
                with contextlib.suppress(Exception):
                    entry = await kv.get(key)
                    if entry.value:
                        holders[key.removeprefix(f"{kind}.")] = entry.value.decode()
        return holders

    async def _active(self, kind: str, wait_s: float = 6.0) -> tuple[str, str]:
        """The replica of `kind` ("placement", "migration") holding the most group leases: (process, why).

        A migration replica holds a group's lease while it migrates the group, so this waits (up to `wait_s`)
        for one to be held."""
        deadline = time.monotonic() + wait_s
        while True:
            holders = await self._lease_holders(kind)
            counts = Counter(self.replica_proc[owner] for owner in holders.values() if owner in self.replica_proc)
            if counts or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        if not counts:
            return kind, f"no {kind} lease held for {wait_s:.0f} s, the first replica"
        name, n = counts.most_common(1)[0]
        return name, f"{name}, holding {n} of {len(holders)} group leases"

    async def _raw(self, role: str, name: str) -> object:
        """A plain nats-py connection as `role` (what a holder of those credentials would use)."""
        import nats

        from switchyard.shared.nats_auth import inbox_prefix

        async def ignore(_exc: Exception) -> None:
            pass

        creds = self.credentials.users[role]
        return await nats.connect(
            self.nats_urls,
            name=name,
            user=creds["user"],
            password=creds["password"],
            inbox_prefix=inbox_prefix(creds["user"]),
            max_reconnect_attempts=-1,
            error_cb=ignore,
        )

    async def _inject(self, fault: str) -> str:
        if fault == "router":
            await self._restart("router")
            spares = self.o.router_replicas - 1
            return f"SIGKILL of one router ({spares} more replica(s) running), restarted at once"
        if fault in ("placement", "migration"):
            name, why = await self._active(fault)
            await self._restart(name)
            return f"SIGKILL of the active replica ({why}), restarted at once"
        if fault == "gateway":
            await self._restart("gateway")
            return (
                f"SIGKILL of gateway 1 of {len(self.gateway_urls)} ({self.o.gateway_router}; the load goes round "
                "robin), restarted at once"
            )
        if fault == "api":
            await self._restart("api")
            return "SIGKILL, restarted at once"
        if fault == "nats":
            for node in self.nats_nodes:
                await asyncio.to_thread(node.stop)
            await asyncio.sleep(1.0)
            for node in self.nats_nodes:
                await asyncio.to_thread(node.start)
            if self.cluster is not None:
                await asyncio.to_thread(self.cluster.wait_healthy, 60.0)
            return "stopped 1 s, restarted (same port, same JetStream store)" + (
                f" (all {len(self.nats_nodes)} nodes)" if self.cluster is not None else ""
            )
        if fault == "nats-node":
            return await self._kill_nats_node()
        if fault in ("nats-quorum", "postgres-long"):
            return await self._long_outage(fault)
        if fault == "postgres":
            assert self.pg is not None
            await asyncio.to_thread(self.pg.crash)
            await asyncio.sleep(2.0)
            await asyncio.to_thread(self.pg.start)
            return "crashed (immediate), down 2 s, restarted"
        if fault == "flood":
            self._attack["log_offset"] = self._server_log_size()
            self._attack["flood"] = asyncio.create_task(self._flood(max(self.o.fault_s - 3.0, 1.0)))
            return f"payloads of {self.bus.max_payload - 512} bytes on engine-{ATTACKER}'s hello and telemetry"
        if fault == "migration-active":
            return await self._kill_active_migration()
        if fault == "role-claim":
            return await self._claim_roles()
        if fault == "stream-flood":
            return await self._start_stream_flood()
        if fault in QUICK_FAULTS or fault in NAMED_FAULTS:
            return await self.attacks.inject(fault)
        ghost = self.procs[GHOST]
        if fault == "engine-vanish":
            await asyncio.to_thread(ghost.kill)
            return "ghost decoder SIGKILLed (no goodbye)"
        if fault == "slow-engine":
            ghost.argv = self._ghost_argv(late_s=1.5)
            ghost.start()
            return "ghost decoder back, telemetry every 1.5 s (limit 1 s)"
        raise ValueError(f"unknown fault {fault!r}")

    async def _long_outage(self, fault: str) -> str:
        """`nats-quorum` or `postgres-long` (bench/chaos_outages.py); the window runs `fault_s` past recovery."""
        if fault == "nats-quorum":
            leader = None
            if self.cluster is not None:
                info = await self.bus.js.stream_info(self.bus.subjects.placement_stream)
                leader = info.cluster.leader if info.cluster is not None else None
            note = await kill_quorum(self.cluster, leader, self.o.node_down_s)
        else:
            note = await postgres_outage(self.pg, self.o.pg_down_s)
        self._attack["until"] = time.time() + self.o.fault_s
        return note

    async def _after(self, fault: str) -> tuple[str, dict[str, int]]:
        """Undo the fault; returns what to add to its note, and the fault's own counts (FaultResult fields)."""
        attack, self._attack = self._attack, {}
        if fault == "slow-engine":
            await asyncio.to_thread(self.procs[GHOST].kill)
        if fault == "flood":
            started = time.time()
            sent = await attack["flood"]  # type: ignore[misc]
            cut_off = self._cut_offs(attack["log_offset"])  # type: ignore[arg-type]
            who = ", ".join(f"{name} {n}" for name, n in cut_off.most_common()) or "none"
            note = f"; {sent} flood messages; slow-consumer cut-offs: {who}"
            if cut_off["chaos-watch"]:  # this script missed telemetry the router saw: it cannot judge misrouting
                self.blind.append((started - self.o.fault_s, time.time()))
                note += "; this script's telemetry watch was cut off too"
            return note, {}
        if fault == "migration-active":
            return await self._after_migration_kill(attack)
        if fault == "role-claim":
            return await self._after_role_claim(attack)
        if fault == "stream-flood":
            return await self._after_stream_flood(attack)
        if fault in QUICK_FAULTS or fault in NAMED_FAULTS:
            return await self.attacks.after(fault)
        return "", {}

    def _shape(self) -> str:
        kinds = ("router", "placement", "migration", "gateway", "api")
        replicas = Counter(name.split("-")[0] for name in self.procs if name.split("-")[0] in kinds)
        listed = len(json.loads(self.manifest_file.read_text()))
        return (
            f"production shape: {len(self.credentials.users)} NATS users (one per role and engine; each process "
            f"holds only its own), signed routing artifacts, an engine manifest of {listed} engines; replicas: "
            + ", ".join(f"{kind} {n}" for kind, n in replicas.items())
        )

    def _gateway_shape(self) -> str:
        """Which gateway shape the HTTP load went through, as the gateways' own logs say (`serving ... (routing
        <shape>)` at each start), and whether any of them could not share its decisions."""
        names = [name for name in self.procs if name.split("-")[0] == "gateway"]
        starts: Counter[str] = Counter()
        unshared = 0
        for name in names:
            path = self.root / "logs" / f"{name}.log"
            for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
                if "serving OpenAI endpoints" in line and "(routing " in line:
                    starts[line.rsplit("(routing ", 1)[1].rstrip(")")] += 1
                unshared += "may not publish decisions" in line
        seen = ", ".join(f"{shape} {n}" for shape, n in starts.most_common()) or "none logged"
        how = (
            "each decides in-process (the router's core inside the gateway) and shares its decisions as "
            + ", ".join(gateway_user_of(name) for name in names)
            if self.o.gateway_router == "inprocess"
            else "each asks the routers over sy.route.dp (remote)"
        )
        return (
            f"gateway load: HTTP clients -> {len(names)} gateways -> stub DP engines; {how}; gateway starts by "
            f"routing: {seen}; 'may not publish decisions' warnings: {unshared}"
        )

    def _violations(self) -> list[str]:
        """nats-server's permission violations over the whole run, by connection name and subject; and, in a note
        of their own, the replies a restarted server refused.

        A responder may publish one reply to a request's inbox (`allow_responses`), a permission the server grants
        as it delivers the request. A server restarted in between has no record of it, so a reply to a request
        delivered before the restart is refused on the inbox (the requester's timeout and resend cover it). Those
        (an `_INBOX_` subject, logged after the node's second start) are not a role overstepping its permissions.
        """
        found: Counter[str] = Counter()
        late = 0
        for node in range(len(self.nats_nodes)):
            starts = 0
            for line in self._server_log_since(0, node):
                if "Server is ready" in line:
                    starts += 1
                elif "Violation" in line:
                    name = line.split('"')[1].rsplit(":", 1)[-1] if line.count('"') >= 2 else "unnamed"
                    subject = line.rsplit("Subject", 1)[-1].strip(' :"') if "Subject" in line else "?"
                    if starts > 1 and subject.startswith("_INBOX_"):
                        late += 1
                        continue
                    found[f"{name} on {subject}"] += 1
        notes = [
            "nats-server permission violations: "
            + (", ".join(f"{k} ({n})" for k, n in found.most_common(8)) if found else "none")
        ]
        if late:
            notes.append(
                f"replies refused by a restarted nats-server (to requests delivered before the restart): {late}"
            )
        return notes

    def _server_log_size(self) -> int:
        path = self.nats_nodes[0].log_path
        return path.stat().st_size if path.exists() else 0

    def _server_log_since(self, offset: int, node: int = 0) -> list[str]:
        """Node `node`'s log from `offset` (the flood's cut-offs: the first node's; on a cluster, clients on the
        other nodes are cut off in their logs)."""
        with self.nats_nodes[node].log_path.open("rb") as server_log:
            server_log.seek(offset)
            return server_log.read().decode(errors="replace").splitlines()

    async def _kill_nats_node(self) -> str:
        """SIGKILL the cluster node leading the plans' stream, leave it down `node_down_s`, restart it on its port
        and store; the note says which node it was and when the cluster was current again."""
        if self.cluster is None:
            raise SystemExit("chaos: the nats-node fault needs --nats-cluster N (N >= 3)")
        info = await self.bus.js.stream_info(self.bus.subjects.placement_stream)
        leader = info.cluster.leader if info.cluster is not None else None
        victim = self.cluster.node(leader) if leader else self.cluster.nodes[0]
        meta = await asyncio.to_thread(self.cluster.meta_leader)
        killed = time.monotonic()
        await asyncio.to_thread(victim.kill)
        await asyncio.sleep(self.o.node_down_s)
        await asyncio.to_thread(victim.start)
        await asyncio.to_thread(self.cluster.wait_healthy, 60.0)
        role = "also the meta leader" if meta == victim.name else f"meta leader {meta}"
        return (
            f"SIGKILL of {victim.name} of {len(self.cluster.nodes)} (leader of the plans' stream, "
            f"R{info.config.num_replicas}; {role}), down "
            f"{self.o.node_down_s:.0f} s, restarted on its port and store; all nodes current "
            f"{time.monotonic() - killed:.1f} s after the kill"
        )

    def _cut_offs(self, offset: int) -> Counter[str]:
        """nats-server's slow-consumer cut-offs since `offset` of its log, by client connection name."""
        cut_off: Counter[str] = Counter()
        for line in self._server_log_since(offset):
            if "Slow Consumer" in line:
                name = line.split('"')[1].rsplit(":", 1)[-1] if line.count('"') >= 2 else "unnamed"
                cut_off[name] += 1
        return cut_off

    async def _flood(self, seconds: float) -> int:
        """Near-limit garbage on the attacker's own hello and telemetry (the wildcard subjects every service
        ingests; its credentials allow nothing else) for `seconds`; returns the messages sent."""
        from switchyard.shared.nats_auth import engine_user

        nc = await self._raw(engine_user(ATTACKER), "chaos-flood")
        payload = bytes(self.bus.max_payload - 512)  # not msgpack: refused by size before anything is read
        s = self.bus.subjects
        subjects = [s.hello(ATTACKER), s.telemetry(ATTACKER)]
        sent = 0
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                await nc.publish(subjects[sent % len(subjects)], payload)  # type: ignore[attr-defined]
                sent += 1
                if sent % 4 == 0:  # keep the client's own buffer bounded: the server takes what it can
                    with contextlib.suppress(Exception):
                        await nc.flush(timeout=5)  # type: ignore[attr-defined]
        finally:
            with contextlib.suppress(Exception):
                await nc.close()  # type: ignore[attr-defined]
        return sent

    # migration-active: the replica holding a running migration's group lease is SIGKILLed; the standby must
    # take the group over (after the lease's TTL at most) and finish the migration.

    async def _kill_active_migration(self) -> str:
        from sqlalchemy import select

        from switchyard.shared.db import Migration, create_async_db

        engine, sessions = create_async_db(self.database_url)
        self._attack["db"] = engine
        deadline = time.time() + max(self.o.fault_s, 15.0)  # placement plans every 6 s: one comes
        while time.time() < deadline:
            rows: list[tuple[int, str, str]] = []
            with contextlib.suppress(Exception):
                async with sessions() as session:
                    query = (
                        select(Migration.id, Migration.engine_group, Migration.state)
                        .where(Migration.state.in_(("pending", "running")))
                        .order_by(Migration.id.desc())
                    )
                    rows = [tuple(row) for row in (await session.execute(query)).all()]  # type: ignore[misc]
            holders = await self._lease_holders("migration") if rows else {}
            for migration_id, group, state in rows:
                name = self.replica_proc.get(holders.get(group, ""))
                if name is None or not self.procs[name].alive():
                    continue
                await asyncio.to_thread(self.procs[name].kill)
                killed = time.time()
                self._attack.update(migration=migration_id, group=group, killed=name, at=killed)
                # The window lasts until the lease has lapsed and the standby has had time to finish.
                self._attack["until"] = killed + MIGRATION_LEASE_TTL_S + self.o.fault_s / 2
                self._attack["watch"] = asyncio.create_task(self._watch_migration(migration_id, sessions, self._attack))
                return (
                    f"SIGKILL of {name} (holding group {group}'s lease) while migration {migration_id} was {state}; "
                    "not restarted in the window"
                )
            await asyncio.sleep(0.1)
        return "no migration ran in the window: nothing killed"

    async def _watch_migration(self, migration_id: int, sessions: object, into: dict[str, object]) -> None:
        """Record in `into` when the migration reaches a final state (polled every 0.25 s)."""
        from sqlalchemy import select

        from switchyard.shared.db import Migration

        while True:
            with contextlib.suppress(Exception):
                async with sessions() as session:  # type: ignore[operator]
                    state = await session.scalar(select(Migration.state).where(Migration.id == migration_id))
                into["state"] = state
                if state in FINAL:
                    into["finished"] = time.time()
                    return
            await asyncio.sleep(0.25)

    async def _after_migration_kill(self, attack: dict[str, object]) -> tuple[str, dict[str, int]]:
        watch = attack.get("watch")
        if isinstance(watch, asyncio.Task):
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        counts: dict[str, int] = {}
        note = ""
        if "killed" in attack:
            killed_at = float(attack["at"])  # type: ignore[arg-type]
            if "finished" in attack:
                took = float(attack["finished"]) - killed_at  # type: ignore[arg-type]
                note = f"; migration {attack['migration']} {attack['state']} {took:.1f} s after the kill"
            else:
                waited = time.time() - killed_at
                note = (
                    f"; migration {attack['migration']} still {attack.get('state', '?')} {waited:.1f} s after the kill "
                    f"(lease TTL {MIGRATION_LEASE_TTL_S:.0f} s): the standby did not finish it (stuck)"
                )
                counts["extra_stuck"] = 1
            self.procs[str(attack["killed"])].start()  # back to two replicas for what follows
            note += f"; {attack['killed']} restarted after the window"
        engine = attack.get("db")
        if engine is not None:
            await engine.dispose()  # type: ignore[attr-defined]
        return note, counts

    # role-claim: the attacker's credentials (a valid engine user, not in the manifest) announce it as a DP engine,
    # then as a prefill engine, with the base URL of an HTTP server this process runs.

    async def _claim_roles(self) -> str:
        from switchyard.engine_agents.stub import StubConfig, StubEngine
        from switchyard.shared.bus import Bus
        from switchyard.shared.nats_auth import engine_user

        role = engine_user(ATTACKER)
        bus = await Bus.connect(self.role_settings(role), name=ATTACKER, role=role)
        config = StubConfig(engine_id=ATTACKER, role="dp", model=STUB_MODEL, tokens=8, token_interval_s=0.01)
        stub = StubEngine(config, bus)
        await stub.start(0)
        self._attack.update(stub=stub, bus=bus)
        self._attack["flip"] = asyncio.create_task(self._flip_role(stub, self._attack))
        return (
            f"engine-{ATTACKER} (valid credentials, not in the manifest) says hello as role dp with base_url "
            f"{stub.base_url} (this process's server), then as prefill"
        )

    async def _flip_role(self, stub: object, into: dict[str, object]) -> None:
        half = max((self.o.fault_s - 1.0) / 2, 1.0)
        await asyncio.sleep(half)
        into["as_dp"] = len(stub.received)  # type: ignore[attr-defined]
        stub.config.role = "prefill"  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):  # at once, not at its next hello
            await stub.bus.publish(stub.bus.subjects.hello(ATTACKER), stub.hello())  # type: ignore[attr-defined]
        await asyncio.sleep(max(half - 3.5, 0.5))
        stub.saying_hello = False  # type: ignore[attr-defined]  # it keeps serving what the gateways still send

    async def _after_role_claim(self, attack: dict[str, object]) -> tuple[str, dict[str, int]]:
        flip, stub, bus = attack["flip"], attack["stub"], attack["bus"]
        flip.cancel()  # type: ignore[attr-defined]
        await asyncio.gather(flip, return_exceptions=True)  # type: ignore[arg-type]
        await stub.stop()  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):
            await bus.close()  # type: ignore[attr-defined]
        hits = len(stub.received)  # type: ignore[attr-defined]
        as_dp = int(attack.get("as_dp", hits))  # type: ignore[call-overload]
        note = (
            f"; {hits} client requests reached the attacker's server ({as_dp} while it claimed dp, "
            f"{hits - as_dp} after it claimed prefill): counted as misrouted"
        )
        return note, {"hijacked": hits}

    # stream-flood: the attacker's credentials flood its own expert-load subject (captured by the stream).

    async def _start_stream_flood(self) -> str:
        s = self.bus.subjects
        stream = s.expert_load_stream
        before = await self.bus.js.stream_info(stream)
        latest: dict[str, int] = {}
        for engine_id in [*self.fleet_ids, GHOST]:
            with contextlib.suppress(Exception):
                latest[engine_id] = (await self.bus.js.get_last_msg(stream, s.expert_load(engine_id))).seq
        self._attack.update(before=before.state, latest=latest, log_offset=self._server_log_size())
        self._attack["flood"] = asyncio.create_task(self._stream_flood(max(self.o.fault_s - 3.0, 1.0)))
        size = self.bus.max_payload - 512
        return f"engine-{ATTACKER}'s credentials: {size}-byte payloads on its own {s.expert_load(ATTACKER)}"

    async def _stream_flood(self, seconds: float) -> tuple[int, int]:
        """(messages, bytes) sent on the attacker's expert-load subject for `seconds` (or up to the cap)."""
        from switchyard.shared.nats_auth import engine_user

        nc = await self._raw(engine_user(ATTACKER), "chaos-stream-flood")
        payload = bytes(self.bus.max_payload - 512)
        subject = self.bus.subjects.expert_load(ATTACKER)
        sent = 0
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline and sent * len(payload) < STREAM_FLOOD_CAP_BYTES:
                await nc.publish(subject, payload)  # type: ignore[attr-defined]
                sent += 1
                if sent % 2 == 0:
                    with contextlib.suppress(Exception):
                        await nc.flush(timeout=5)  # type: ignore[attr-defined]
        finally:
            with contextlib.suppress(Exception):
                await nc.close()  # type: ignore[attr-defined]
        return sent, sent * len(payload)

    async def _after_stream_flood(self, attack: dict[str, object]) -> tuple[str, dict[str, int]]:
        sent, sent_bytes = await attack["flood"]  # type: ignore[misc]
        s = self.bus.subjects
        stream = s.expert_load_stream
        before = attack["before"]
        after = (await self.bus.js.stream_info(stream)).state
        latest: dict[str, int] = attack["latest"]  # type: ignore[assignment]
        evicted = []
        for engine_id, seq in latest.items():
            try:
                await self.bus.js.get_msg(stream, seq)
            except Exception:  # the window it had before the flood is gone: was anything newer kept?
                evicted.append(engine_id)
        cut_off = self._cut_offs(attack["log_offset"])  # type: ignore[arg-type]
        who = ", ".join(f"{name} {n}" for name, n in cut_off.most_common()) or "none"
        mib = 1 << 20
        note = (
            f"; {sent} messages ({sent_bytes / mib:.0f} MiB) sent; {stream}: {before.bytes / mib:.1f} MiB, "  # type: ignore[attr-defined]
            f"{before.messages} msgs before, {after.bytes / mib:.1f} MiB, {after.messages} msgs after; "  # type: ignore[attr-defined]
            f"other engines' latest windows kept: {len(latest) - len(evicted)} of {len(latest)}"
            + (f" (evicted: {', '.join(evicted)}; counted as lost)" if evicted else "")
            + f"; slow-consumer cut-offs: {who}"
        )
        return note, {"extra_lost": len(evicted)}

    def _enabled(self) -> list[str]:
        enabled = []
        for fault in self.o.faults:
            if fault in GATEWAY_FAULTS and "gateway" not in self.procs:
                self.notes.append(f"{fault} fault skipped: switchyard.services.gateway is not installed")
            elif fault in ("postgres", "postgres-long") and self.pg is None:
                continue
            else:
                enabled.append(fault)
        return enabled

    # ----- run -----

    async def run(self) -> tuple[list[FaultResult], Audit]:
        with contextlib.ExitStack() as stack:
            root = self.o.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chaos-")))
            root.mkdir(parents=True, exist_ok=True)
            await self._start_infra(root)
            try:
                return await self._run()
            finally:
                await self._teardown()

    async def _run(self) -> tuple[list[FaultResult], Audit]:
        await self._publish_artifact()
        self._processes()
        await self._watch()
        for proc in self.procs.values():
            proc.start()
        for proc in self.procs.values():
            await asyncio.to_thread(proc.wait_port)
        self._tasks = [
            asyncio.create_task(self._probes()),
            asyncio.create_task(self._load()),
            *(asyncio.create_task(self._sample_windows(n, port)) for n, port in self.placement_metrics.items()),
            asyncio.create_task(self._probe_api()),
            *([asyncio.create_task(self._gateway_load())] if self.gateway_urls else []),
            *([asyncio.create_task(self.attacks.sample())] if self.gateway_urls else []),
        ]
        retry = asyncio.create_task(self._retry())
        up = await self._wait_routing()
        log.info("loop up: routing answered %.1f s after the services started", up)
        await asyncio.sleep(5.0)  # telemetry, first windows
        if not (await self._active("placement", wait_s=30.0))[1].startswith("no "):  # placement has planned
            log.info("loop planning: a placement replica holds group leases")
        results = []
        for fault in self._enabled():
            start = time.time()
            await asyncio.sleep(1.0)
            injected = time.time()
            note = await self._inject(fault)
            log.info("fault %s: %s", fault, note)
            until = max(start + self.o.fault_s, float(self._attack.get("until", 0.0)))  # type: ignore[arg-type]
            await asyncio.sleep(max(until - time.time(), 0.0))
            more, counts = await self._after(fault)
            result = FaultResult(fault, start, injected, time.time(), note + more)
            for attr, value in counts.items():
                setattr(result, attr, value)
            results.append(result)
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._drain(self.o.retry_after_s + 30.0)
        retry.cancel()
        # Quiesce before comparing live layouts with the database: no new plans, in-flight migrations finish.
        for name in self.placement_metrics:
            await asyncio.to_thread(self.procs[name].stop)
        await self._wait_migrations(self.o.stuck_after_s)
        await asyncio.sleep(self.o.settle_s)
        audit = await self._audit()
        (self.root / "windows.json").write_text(json.dumps(self.windows_by))
        self.notes.insert(0, self._shape())
        if self.gateway_urls:
            self.notes.insert(1, self._gateway_shape())
        self.notes.extend(self._violations())
        self._score(results, audit)
        return results, audit

    async def _drain(self, within_s: float = 60.0) -> None:
        deadline = time.monotonic() + within_s
        while set(self.sent) - set(self.done) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.2)

    async def _wait_migrations(self, within_s: float) -> None:
        """Until no migration is pending or running (or `within_s` passes: the audit then calls them stuck)."""
        from sqlalchemy import func, select

        from switchyard.shared.db import Migration, create_async_db

        engine, sessions = create_async_db(self.database_url)
        deadline = time.monotonic() + within_s
        try:
            while time.monotonic() < deadline:
                async with sessions() as session:
                    open_ = await session.scalar(select(func.count()).where(Migration.state.not_in(FINAL)))
                if not open_:
                    return
                await asyncio.sleep(0.5)
        finally:
            await engine.dispose()

    async def _teardown(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        attack, self._attack = self._attack, {}
        for value in attack.values():  # a fault interrupted by an error: its tasks, the attacker's server
            if isinstance(value, asyncio.Task):
                value.cancel()
        if "stub" in attack:
            with contextlib.suppress(Exception):
                await attack["stub"].stop()  # type: ignore[attr-defined]
        await self.attacks.teardown()
        for name, proc in reversed(list(self.procs.items())):
            code = await asyncio.to_thread(proc.stop)
            if code not in (0, None, -9) and name != GHOST:
                self.notes.append(f"{name} exited with {code} on SIGTERM")
        with contextlib.suppress(Exception):
            await self.bus.close()
        with contextlib.suppress(Exception):
            await self.watch_bus.close()
        for node in self.nats_nodes:
            await asyncio.to_thread(node.stop)
        if self.pg is not None:
            await asyncio.to_thread(self.pg.stop)

    # ----- audit -----

    async def _audit(self) -> Audit:
        from sqlalchemy import func, select

        from switchyard.services.history import applied_placement, load_layout
        from switchyard.shared.db import Migration, Placement, create_async_db
        from switchyard.shared.schemas import LayoutReply, LayoutRequest
        from switchyard.solver.placement.layouts import default_layout

        audit = Audit()
        now = time.time()
        engine, sessions = create_async_db(self.database_url)
        try:
            async with sessions() as session:
                for row in (await session.scalars(select(Placement))).all():
                    created = row.created_at.timestamp() if row.created_at.tzinfo else _utc(row.created_at)
                    audit.placements.append((row.id, row.plan_id, row.status, created))
                for m in (await session.scalars(select(Migration))).all():
                    updated = m.updated_at.timestamp() if m.updated_at.tzinfo else _utc(m.updated_at)
                    created = m.created_at.timestamp() if m.created_at.tzinfo else _utc(m.created_at)
                    audit.migrations.append((m.id, m.placement_id, m.state, created))
                    if m.state not in FINAL and now - updated > self.o.stuck_after_s:
                        audit.stuck.append(created)
                migrated = {pid for _, pid, _, _ in audit.migrations}
                for pid, _plan, status, created in audit.placements:
                    old = now - created > self.o.stuck_after_s
                    if status == "proposed" and old:
                        audit.stuck.append(created)
                    elif status not in ("rejected", "proposed") and pid not in migrated:
                        audit.lost.append(created)  # published (or later) yet never taken up
                doubles = (
                    await session.execute(
                        select(Migration.engine_group, Migration.plan_version, func.count())
                        .group_by(Migration.engine_group, Migration.plan_version)
                        .having(func.count() > 1)
                    )
                ).all()
                audit.duplicated += [now] * len(doubles)
                for group in self.config.decode_ids():
                    placement = await applied_placement(session, group)
                    try:
                        live = await self.bus.request(
                            self.bus.subjects.layout(group), LayoutRequest(engine_group=group), LayoutReply, timeout=5
                        )
                    except Exception as exc:
                        audit.notes.append(f"{group}: layout not readable ({exc})")
                        continue
                    num_experts = self.scenario.model.num_experts
                    if placement is not None:
                        want = await load_layout(session, placement)
                    else:
                        want = default_layout(live.layout.shape[0], num_experts, live.layout.shape[1])
                    if want.shape != live.layout.shape or not np.array_equal(want, live.layout):
                        audit.layout_mismatches.append(group)
        finally:
            await engine.dispose()
        await self._audit_samples(audit)
        return audit

    async def _audit_samples(self, audit: Audit) -> None:
        """Every routing sample in the stream read by sequence: none stored twice, none given up by the fleet."""
        from nats.js.errors import NotFoundError

        from switchyard.shared.codec import decode
        from switchyard.shared.schemas import RoutingSample

        stream = self.bus.subjects.routing_samples_stream
        state = (await self.bus.js.stream_info(stream)).state
        seen: Counter[tuple[str, str]] = Counter()
        for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
            try:
                sample = decode((await self.bus.js.get_msg(stream, seq)).data, RoutingSample)
            except NotFoundError:  # a gap (deleted message): nothing to count
                continue
            seen[(sample.engine_id, sample.request_id)] += 1
        audit.samples = sum(seen.values())
        audit.samples_duplicated = sum(n - 1 for n in seen.values())
        fleet_log = self.root / "logs" / "fleet.log"
        text = fleet_log.read_text(errors="replace") if fleet_log.exists() else ""
        audit.samples_lost = sum("routing sample" in line and "not published" in line for line in text.splitlines())
        audit.notes.append(
            f"routing samples: {audit.samples} stored, {audit.samples_duplicated} stored twice, "
            f"{audit.samples_lost} given up by the fleet (not published)"
        )

    def _misrouted(self, p: Probe) -> bool:
        """Routed to the attacker (no engine of the fleet), or to an engine that had sent no telemetry for longer
        than the staleness limit (+ slack)."""
        if p.ok and p.engine == ATTACKER:
            return True
        if not p.ok or self._blind(p.answered):
            return False
        stamps = self.telemetry.get(p.engine, [])
        i = bisect.bisect_right(stamps, p.answered)
        return i == 0 or p.answered - stamps[i - 1] > MISROUTE_AFTER_S

    def _blind(self, t: float) -> bool:
        return any(down <= t <= up + MISROUTE_AFTER_S + 1.0 for down, up in self.blind)

    def _windows_stalled(self, r: FaultResult) -> bool:
        """No expert-load window folded by any placement replica in the last third of the fault's window."""
        tails = [
            [v for t, v in samples if r.end - (r.end - r.injected) / 3 <= t <= r.end]
            for samples in self.windows_by.values()
        ]
        tails = [tail for tail in tails if len(tail) >= 2]
        return bool(tails) and all(tail[-1] == tail[0] for tail in tails)

    async def _probe_api(self) -> None:
        """The history API as a dashboard uses it: a page of placements every 0.25 s."""

        def get() -> int | None:
            try:
                with urllib.request.urlopen(f"{self.api_url}/v1/placements?limit=1", timeout=2) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                return exc.code
            except OSError:
                return None

        while not self._stop.is_set():
            sent = time.time()
            self.api_probes.append((sent, await asyncio.to_thread(get)))
            await asyncio.sleep(0.25)

    async def _gateway_request(self, client: object, i: int, body: dict[str, object] | None = None) -> str:
        """One OpenAI completion through the gateway, retried every 0.5 s for `retry_after_s` as a client with
        retries would; lost if it never succeeds (a refused connection, a timeout or a 5xx is a failure). Returns
        the engine that served it (the stub's `served_by`; "" if none did)."""
        import httpx

        assert isinstance(client, httpx.AsyncClient)
        body = body or {"model": STUB_MODEL, "prompt": f"chaos request {i}", "max_tokens": 8}
        sent = time.time()
        first: bool | None = None
        attempt = 0
        while True:
            at = time.time()
            # Requests go round robin over the gateways; a retry goes to the next one (a client that knows them
            # all, or a load balancer that takes a refusing one out).
            index = (i + attempt) % len(self.gateway_urls)
            attempt += 1
            status: int | None = None
            served = ""
            try:
                answer = await client.post(f"{self.gateway_urls[index]}/v1/completions", json=body)
                status = answer.status_code
                served = served_by(answer.content) if status == 200 else ""
            except httpx.HTTPError:
                pass
            ok = status == 200
            self.gw_attempts.append((at, ok))
            self.gw_answers.append((at, index, status, served))
            first = ok if first is None else first
            if ok or time.time() - sent > self.o.retry_after_s:
                self.gw_requests.append((sent, first, ok))
                return served
            await asyncio.sleep(0.5)

    async def _gateway_load(self) -> None:
        """Client requests through the gateways (HTTP, to the stub DP engines), at `gateway_rate` per second."""
        import httpx

        rng = np.random.default_rng(self.o.seed + 3)
        pending: set[asyncio.Task[None]] = set()
        async with httpx.AsyncClient(timeout=5.0) as client:
            i = 0
            while not self._stop.is_set():
                task = asyncio.create_task(self._gateway_request(client, i))
                pending.add(task)
                task.add_done_callback(pending.discard)
                i += 1
                await asyncio.sleep(float(rng.exponential(1.0 / self.o.gateway_rate)))
            if pending:
                await asyncio.wait(pending)

    async def _sample_windows(self, name: str, port: int) -> None:
        def scrape() -> float | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as response:
                    text = response.read().decode()
            except OSError:
                return None
            for line in text.splitlines():
                if line.startswith("switchyard_placement_windows_total "):
                    return float(line.split()[1])
            return None

        while not self._stop.is_set():
            value = await asyncio.to_thread(scrape)
            if value is not None:
                self.windows_by.setdefault(name, []).append((time.time(), value))
            await asyncio.sleep(0.5)

    def _gateway_clients(self, r: FaultResult) -> str:
        """What the clients through the gateways saw in window `r` (its note): for the gateway fault, what the
        SIGKILL cost them; for the router fault, whether the gateways' load depended on the router at all."""
        seen = f"{r.gw_sent} requests, {r.gw_failed} first attempts failed, {r.gw_lost} lost"
        if r.name == "gateway":
            back = f"; attempts answered 200 again {r.gw_resume_s:.2f} s after the SIGKILL" if r.gw_failed else ""
            return f"; clients through the {self.o.gateway_router} gateways: {seen}{back}"
        if self.o.gateway_router == "inprocess":
            return f"; the gateways decide in-process (their load does not go through the router): {seen}"
        return f"; the gateways ask the router (remote): {seen}"

    def _router_startups(self) -> list[str]:
        """The restarted router's own account of each restart (`process up ... s: connect ...`), in order."""
        path = self.root / "logs" / "router.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return [line.split("process up ", 1)[1] for line in lines if "process up " in line][1:]

    def _score(self, results: list[FaultResult], audit: Audit) -> None:
        startups = iter(self._router_startups())
        for r in results:
            if r.name == "router":
                r.note += f"; the restarted process served after {next(startups, '(not seen)')}"

        def window(t: float) -> FaultResult | None:
            for r in results:
                if r.start <= t < r.end:
                    return r
            return None

        for r in results:
            in_window = [p for p in self.probes if r.start <= p.sent < r.end]
            r.probes = len(in_window)
            r.probe_failures = sum(not p.ok for p in in_window)
            r.misrouted = sum(self._misrouted(p) for p in in_window) + r.hijacked
            r.stuck += r.extra_stuck
            r.lost_rows += r.extra_lost
            unjudged = sum(p.ok and self._blind(p.answered) for p in in_window)
            if unjudged:
                r.note += f"; {unjudged} probes not judged for misrouting (this process was reconnecting)"
            if self._windows_stalled(r):
                r.stuck += 1
                r.note += "; placement stopped folding expert-load windows"
            failed = [p.sent for p in in_window if not p.ok]
            if failed:  # from the first failed probe to the first success after the last one
                after = [p.sent for p in in_window if p.ok and p.sent > failed[-1]]
                r.resume_s = (after[0] if after else r.end) - failed[0]
                why = Counter(p.error for p in in_window if not p.ok)
                r.note += "; failed probes: " + ", ".join(f"{k} {v}" for k, v in why.most_common())
                r.resumed = bool(after)
            api = [(t, code) for t, code in self.api_probes if r.start <= t < r.end]
            r.api_failed = sum(not answered_2xx(code) for _, code in api)
            r.api_500 = sum(code is not None and code >= 500 and code != 503 for _, code in api)
            if r.name == "api":  # its own restart, however long it takes (later windows included)
                answered = [t for t, code in self.api_probes if t > r.injected and answered_2xx(code)]
                last = self.api_probes[-1][0] if self.api_probes else r.end
                r.api_resume_s = (answered[0] if answered else last) - r.injected
                r.resumed = r.resumed and bool(answered)
                r.note += f"; the API answered again {r.api_resume_s:.2f} s after its SIGKILL"
            else:  # an outage that began in this window (one carried over from an earlier fault is not its own)
                up = [t for t, code in api if answered_2xx(code)]
                before = [code for t, code in self.api_probes if t < r.start][-1:]
                was_down = bool(before) and not answered_2xx(before[0])
                down = [t for t, code in api if not answered_2xx(code) and (not was_down or (up and t > up[0]))]
                if down:  # the first 2xx after the last refused connection or 5xx (a 503 is an outage too)
                    after = [t for t, code in api if answered_2xx(code) and t > down[-1]]
                    r.api_resume_s = (after[0] if after else r.end) - r.injected
                    r.resumed = r.resumed and bool(after)
                    r.note += f"; the API did not answer 2xx to {r.api_failed} probes, again {r.api_resume_s:.2f} s in"
            gw = [(first, ok) for t, first, ok in self.gw_requests if r.start <= t < r.end]
            r.gw_sent, r.gw_failed = len(gw), sum(not first for first, _ in gw)
            r.gw_lost = sum(not ok for _, ok in gw)
            attempts = [(t, ok) for t, ok in self.gw_attempts if r.start <= t < r.end]
            down = [t for t, ok in attempts if not ok]
            if down:
                after = [t for t, ok in attempts if ok and t > down[-1]]
                r.gw_resume_s = (after[0] if after else r.end) - r.injected
                # With several gateways the failed attempts are the killed one's (until it is back); clients
                # were served again once their retry reached another: resumed unless a request was lost.
                failover = len(self.gateway_urls) > 1 and r.gw_lost == 0
                r.resumed = r.resumed and (bool(after) or failover)
            if r.name in ("router", "gateway") and self.gateway_urls:
                r.note += self._gateway_clients(r)
            sent = [rid for rid, t in self.sent.items() if r.start <= t < r.end]
            r.sent = len(sent)
            r.retried = sum(rid in self.retried for rid in sent)
            r.lost = sum(rid not in self.done for rid in sent)
        for _, _, _, created in audit.placements:
            if (r := window(created)) is not None:
                r.placements += 1
        for _, _, _, created in audit.migrations:
            if (r := window(created)) is not None:
                r.migrations += 1
        for attr, times in (("lost_rows", audit.lost), ("duplicated", audit.duplicated), ("stuck", audit.stuck)):
            for t in times:
                r = window(t) or (results[-1] if results else None)
                if r is not None:
                    setattr(r, attr, getattr(r, attr) + 1)
        if audit.layout_mismatches and results:
            results[-1].duplicated += len(audit.layout_mismatches)


def served_by(body: bytes) -> str:
    """The engine a stub's answer names (`served_by`); "?" for an answer that is not one (junk, no field)."""
    try:
        answer = json.loads(body)
    except ValueError:
        return "?"
    engine = answer.get("served_by") if isinstance(answer, dict) else None
    return engine if isinstance(engine, str) else "?"


def answered_2xx(code: int | None) -> bool:
    """An API probe answered: a 2xx. A refused connection (None) and any 5xx, 503 included, are an outage: an
    API that answers 503 to every request for 15 s while PostgreSQL is down is down for its clients."""
    return code is not None and 200 <= code < 300


def gateway_user_of(process: str) -> str:
    """The NATS user of the gateway process `process` (`gateway`, `gateway-2`, ...)."""
    from switchyard.shared.nats_auth import gateway_user

    replica = 1 if process == "gateway" else int(process.rsplit("-", 1)[1])
    return gateway_user(gateway_id(replica))


def gateway_id(replica: int) -> str:
    """Gateway replica `replica`'s id (1-based): its NATS user is `gateway-<id>`, its decisions'
    subject `sy.route.decided.gateway.<id>`."""
    return f"g{replica}"


def _utc(naive: object) -> float:
    from datetime import UTC

    return naive.replace(tzinfo=UTC).timestamp()  # type: ignore[attr-defined]


def totals(results: list[FaultResult], audit: Audit) -> dict[str, float]:
    return {
        "faults": len(results),
        "lost": sum(r.lost + r.gw_lost + r.lost_rows for r in results) + audit.samples_lost,
        "duplicated": sum(r.duplicated for r in results) + audit.samples_duplicated,
        "stuck": sum(r.stuck for r in results),
        "misrouted": sum(r.misrouted for r in results),
        # Routing's resume and the API's (the first answer after it stopped answering, from the fault).
        "max_resume_s": max((max(r.resume_s, r.api_resume_s) for r in results), default=0.0),
    }


def closing_line(results: list[FaultResult], audit: Audit) -> str:
    t = totals(results, audit)
    return (
        f"chaos: {t['faults']} faults, lost {t['lost']}, duplicated {t['duplicated']}, stuck {t['stuck']}, "
        f"misrouted {t['misrouted']}, max resume {t['max_resume_s']:.1f} s"
    )


def table(results: list[FaultResult]) -> str:
    head = (
        f"{'fault':<17}{'requests':>9}{'retried':>8}{'lost':>6}{'probes':>8}{'failed':>8}{'resume s':>10}"
        f"{'misrouted':>11}{'api resume s':>13}{'api 5xx':>8}"
        f"{'gw req':>7}{'gw fail':>8}{'gw lost':>8}{'gw resume s':>12}"
        f"{'plans':>7}{'migr.':>7}{'rows lost':>10}{'dup':>5}{'stuck':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.name:<17}{r.sent:>9}{r.retried:>8}{r.lost:>6}{r.probes:>8}{r.probe_failures:>8}{r.resume_s:>10.2f}"
            f"{r.misrouted:>11}{r.api_resume_s:>13.2f}{r.api_500:>8}"
            f"{r.gw_sent:>7}{r.gw_failed:>8}{r.gw_lost:>8}{r.gw_resume_s:>12.2f}"
            f"{r.placements:>7}{r.migrations:>7}{r.lost_rows:>10}{r.duplicated:>5}{r.stuck:>7}"
        )
    lines += [f"{r.name}: {r.note}" for r in results]
    return "\n".join(lines)


# ----- the ghost decoder (a process of its own, so that SIGKILL makes it vanish for real) -----


async def run_ghost(nats_url: str, engine_id: str, late_s: float | None) -> None:
    from switchyard.engine_agents.core import EngineAgent
    from switchyard.shared.bus import Bus
    from switchyard.shared.nats_auth import engine_user
    from switchyard.shared.schemas import Capacity, Hello, ModelShape
    from switchyard.shared.settings import SwitchyardSettings

    settings = SwitchyardSettings(nats_servers=nats_url.split(","))  # credentials: SWITCHYARD_NATS_CREDENTIALS
    bus = await Bus.connect(settings, name=engine_id, role=engine_user(engine_id))
    hello = Hello(
        engine_id=engine_id,
        role="decode",
        model=ModelShape(name=GHOST_MODEL, num_layers=26, num_experts=64, top_k=6),
        ep_group=engine_id,
        gpus=[f"{engine_id}-gpu0", f"{engine_id}-gpu1"],
        capacity=Capacity(max_running=256, kv_blocks=4096, block_size=16),
        ts=time.time(),
        agent="sim",
        agent_version="chaos-ghost",
        hello_interval_s=5.0,
        telemetry_interval_s=0.1,
    )
    idle = {
        "kv_usage": 0.0,
        "num_running": 0,
        "num_waiting": 0,
        "waiting_prefill_tokens": 0,
        "remaining_prefill_tokens": 0,
        "step_time_ema": 0.02,
    }
    agent = EngineAgent(bus, hello, lambda: idle)
    if late_s:  # announces 100 ms telemetry, sends it every `late_s`
        agent.hello = hello.model_copy(update={"telemetry_interval_s": late_s})
        agent.say_hello = _announce_fast(agent, hello)  # type: ignore[method-assign]
    await agent.start()
    await asyncio.Event().wait()


def _announce_fast(agent: object, hello: object):
    from switchyard.shared.schemas import Hello

    async def say_hello() -> None:
        assert isinstance(hello, Hello)
        bus = agent.bus  # type: ignore[attr-defined]
        await bus.publish(bus.subjects.hello(hello.engine_id), hello.model_copy(update={"ts": time.time()}))

    return say_hello


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, in order")
    parser.add_argument("--fault-s", type=float, default=ChaosOptions.fault_s)
    parser.add_argument("--rate", type=float, default=ChaosOptions.rate, help="client requests per second")
    parser.add_argument(
        "--gateway-rate", type=float, default=ChaosOptions.gateway_rate, help="requests per second via the gateway"
    )
    parser.add_argument("--settle-s", type=float, default=ChaosOptions.settle_s)
    parser.add_argument("--database", choices=("auto", "postgres", "sqlite"), default="auto")
    parser.add_argument(
        "--router-replicas",
        type=int,
        default=ChaosOptions.router_replicas,
        help="router replicas; the router fault kills one (1: routing waits for its restart)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=ChaosOptions.replicas,
        help="replicas of placement, migration and the gateway (their faults kill one)",
    )
    parser.add_argument(
        "--gateway-router",
        choices=("inprocess", "remote"),
        default=ChaosOptions.gateway_router,
        help="how the gateways decide: in-process (default) or by asking the routers (remote)",
    )
    parser.add_argument(
        "--nats-cluster",
        type=int,
        default=0,
        help="run NATS as a JetStream cluster of N nodes (streams and buckets with N replicas); nats-node needs it",
    )
    parser.add_argument(
        "--node-down-s", type=float, default=ChaosOptions.node_down_s, help="nats-node, nats-quorum: seconds down"
    )
    parser.add_argument("--pg-down-s", type=float, default=ChaosOptions.pg_down_s, help="postgres-long: seconds down")
    parser.add_argument("--workdir", type=Path, help="keep logs and stores here (default: a temp dir, removed)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    parser.add_argument("--late-s", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request through the gateway otherwise
    if args.engine:
        asyncio.run(run_ghost(args.nats_url, args.engine, args.late_s))
        return 0
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    unknown = sorted(set(faults) - set(FAULTS) - set(EXTRA_FAULTS))
    if unknown:
        print(f"chaos: unknown fault(s) {', '.join(unknown)}; choose from {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    if {"nats-node", "nats-quorum"} & set(faults) and args.nats_cluster < 3:
        print("chaos: the nats-node and nats-quorum faults need --nats-cluster 3 (or more)", file=sys.stderr)
        return 2
    options = ChaosOptions(
        faults=faults,
        fault_s=args.fault_s,
        rate=args.rate,
        gateway_rate=args.gateway_rate,
        settle_s=args.settle_s,
        database=args.database,
        workdir=args.workdir,
        router_replicas=max(args.router_replicas, 1),
        replicas=max(args.replicas, 1),
        gateway_router=args.gateway_router,
        nats_cluster=max(args.nats_cluster, 0),
        node_down_s=args.node_down_s,
        pg_down_s=args.pg_down_s,
    )
    for name in ("switchyard", "nats"):
        logging.getLogger(name).setLevel(logging.WARNING)
    chaos = Chaos(options)
    results, audit = asyncio.run(chaos.run())
    print(table(results))
    for note in [*chaos.notes, *audit.notes]:
        print(f"note: {note}")
    if any(r.api_500 for r in results):
        print(f"note: the API answered {sum(r.api_500 for r in results)} requests with a 5xx other than 503")
    if audit.layout_mismatches:
        print(f"note: live layout differs from the applied placement on {', '.join(audit.layout_mismatches)}")
    print(closing_line(results, audit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
