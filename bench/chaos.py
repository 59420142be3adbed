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
import contextlib
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from chaos_attacks import HOSTILE_ENGINES, Attacks
from chaos_audit import STALE_AFTER_S, Audit, Auditing, FaultResult
from chaos_faults import (
    ATTACKER,
    EXTRA_FAULTS,
    FAULTS,
    GHOST,
    GHOST_MODEL,
    HTTP_ENGINES,
    MIGRATION_LEASE_TTL_S,
    STUB_MODEL,
    Faults,
    gateway_id,
    run_ghost,
)
from chaos_infra import (
    ServiceProcess,
    ThrowawayPostgres,
    cli,
    find_postgres_bin,
    free_port,
    gateway_available,
    service_env,
)
from chaos_load import Load, Probe, served_by
from chaos_report import Reporting, closing_line, table, totals

log = logging.getLogger("chaos")

#: What the tests and other scripts import from `chaos` (the split modules' names, one address).
__all__ = [
    "ATTACKER",
    "Audit",
    "Chaos",
    "ChaosOptions",
    "FaultResult",
    "Probe",
    "closing_line",
    "served_by",
    "table",
    "totals",
]


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


class Chaos(Load, Faults, Auditing, Reporting):
    """The harness: infrastructure, processes and the run; the load (`chaos_load`), the faults (`chaos_faults`),
    the audit (`chaos_audit`) and the report's notes (`chaos_report`) are mixed in. `run()` returns per-fault
    results."""

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
