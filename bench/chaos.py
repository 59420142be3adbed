"""`make chaos`: the whole loop on loopback, one fault at a time, measured.

Each service runs as its own process (`switchyard router|placement|migration|api`, the simulated fleet as
`switchyard fleet`), with an embedded nats-server whose JetStream store survives its restart and a throwaway
PostgreSQL cluster this script starts itself (SQLite if no PostgreSQL is installed). This process sends the
client load to the fleet's prefill engines (`sy.sim.submit.<id>`), probes `sy.route.decode` at a steady rate,
watches every engine's telemetry, and runs one extra decoder (`ghost-d0`, a process of its own that the
routing artifact names) to vanish and to be slow. With the gateway installed, it also runs `switchyard
gateway` (on a free port) and two stub DP engines that answer HTTP (`http-e0`, `http-e1`), and sends a second
client load as OpenAI completions through the gateway (which asks the router's `sy.route.dp` for each).
Then, in turn:

  router / placement / migration / api / gateway: SIGKILL and restart at once;
  nats: stop the server and start it again on the same port and store;
  postgres: crash the cluster (`pg_ctl -m immediate`) and start it again;
  engine-vanish: SIGKILL the ghost decoder (no goodbye);
  slow-engine: a ghost decoder whose telemetry arrives every 1.5 s (later than the 1 s staleness limit);
  flood (only with --faults flood): payloads just under the server's 8 MiB limit on `sy.engine.*.hello` and
  `.telemetry`, as fast as one client can send them, for the window; the note counts nats-server's slow
  consumer cut-offs by connection name.

Per fault: client requests lost (sent in the fault's window and never completed; through the gateway: never
answered 200 within 20 s of retries every 0.5 s), probes that failed,
seconds until routing resumed, placements / migrations lost, duplicated or stuck, live layouts that differ
from what the database says was applied (a move applied twice or lost), and probes routed to an engine that
had been silent longer than its staleness limit. The closing line:

  chaos: <faults> faults, lost <n>, duplicated <n>, stuck <n>, misrouted <n>, max resume <s> s

    python bench/chaos.py                      # every fault, ~3-4 minutes
    python bench/chaos.py --faults router,nats --fault-s 8
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
from chaos_infra import (
    ServiceProcess,
    ThrowawayPostgres,
    cli,
    find_postgres_bin,
    free_port,
    gateway_available,
    service_env,
)

log = logging.getLogger("chaos")

SERVICE_FAULTS = ("router", "placement", "migration", "api")
FAULTS = (*SERVICE_FAULTS, "gateway", "nats", "postgres", "engine-vanish", "slow-engine")
#: Faults run only when asked for (`--faults flood`): issue 15 finding 3, near-limit payloads on the engines'
#: wildcard subjects.
EXTRA_FAULTS = ("flood",)
GHOST = "ghost-d0"
#: Stub engines (engine_agents/stub.py) behind the gateway: its load goes gateway -> router -> engine over HTTP.
HTTP_ENGINES = ("http-e0", "http-e1")
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
    api_failed: int = 0  # API probes unanswered (refused connection, timeout)
    api_500: int = 0  # API probes answered with a 5xx other than 503 (an outage must say 503)
    api_resume_s: float = 0.0  # seconds until the API answered again (its own restart)
    gw_sent: int = 0  # requests through the gateway
    gw_failed: int = 0  # ... whose first attempt failed (then retried every 0.5 s)
    gw_lost: int = 0  # ... that never succeeded within `retry_after_s`
    gw_resume_s: float = 0.0  # seconds until the gateway answered again after its last failed attempt
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
        self.windows: list[tuple[float, float]] = []  # (time, placement's windows counter) samples
        #: When this process's own NATS connection was down: telemetry it missed then cannot judge a probe.
        self.blind: list[tuple[float, float]] = []
        self.api_probes: list[tuple[float, int | None]] = []  # (time, HTTP status or None)
        #: Requests through the gateway: (sent, first attempt ok, finally ok); and every attempt (time, ok).
        self.gw_requests: list[tuple[float, bool, bool]] = []
        self.gw_attempts: list[tuple[float, bool]] = []
        self.procs: dict[str, ServiceProcess] = {}
        self.notes: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()

    # ----- infrastructure -----

    async def _start_infra(self, root: Path) -> None:
        from switchyard.shared.bus import Bus
        from switchyard.shared.db.engine import upgrade
        from switchyard.shared.embedded import EmbeddedNats
        from switchyard.shared.settings import SwitchyardSettings

        self.root = root
        self.nats = EmbeddedNats(root / "nats")
        self.nats_url = await asyncio.to_thread(self.nats.start)
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
        self.settings = SwitchyardSettings(nats_servers=[self.nats_url], database_url=self.database_url)
        self.bus = await Bus.connect(self.settings, name="chaos")
        # The script's own telemetry watch (a wildcard) on a connection of its own, as the services have: a
        # flood there must not cut off the connection that sends the probes and the load.
        self.watch_bus = await Bus.connect(self.settings, name="chaos-watch")
        await self.bus.ensure_streams()
        await self.bus.ensure_kv(self.bus.subjects.router_bucket)

    async def _publish_artifact(self) -> None:
        from switchyard import data as shipped
        from switchyard.engine_agents.sim.live.engines import LiveFleet, LiveFleetConfig
        from switchyard.services.artifacts import publish_artifact
        from switchyard.simulator.offline.scenario import prepare
        from switchyard.solver.eldr_fit import FitOptions, fit_routing_artifact

        self.config = LiveFleetConfig(prefill=self.o.prefill, decode=self.o.decode, speed=self.o.speed)
        self.trace = self.settings.trace(shipped.ESFT)
        self.scenario = await asyncio.to_thread(prepare, self.trace, gpu=self.config.gpu, seed=self.o.seed)
        decoders = [*self.config.decode_ids(), GHOST]
        calibration = self.scenario.counts.subset(self.scenario.calib)
        artifact, report = await asyncio.to_thread(
            fit_routing_artifact, calibration, len(decoders), FitOptions(seed=self.o.seed), decoder_ids=decoders
        )
        await publish_artifact(
            artifact, report, out=self.root / "artifact.msgpack", database_url=self.database_url, bus=self.bus
        )
        self.max_tokens = LiveFleet(self.scenario, self.config).max_tokens
        fleet = LiveFleet(self.scenario, self.config)
        self.signatures = fleet.signatures

    def _processes(self) -> None:
        env = service_env(
            {
                "SWITCHYARD_DATABASE_URL": self.database_url,
                "SWITCHYARD_NATS_SERVERS": self.nats_url,
                "SWITCHYARD_LOG_LEVEL": "INFO",
                # a loop that does something within a few minutes: plan often, publish any gain
                "SWITCHYARD_PLACEMENT_PERIOD_S": "6",
                "SWITCHYARD_PLACEMENT_MIN_INTERVAL_S": "3",
                "SWITCHYARD_PLACEMENT_GAIN_THRESHOLD": "0",
                "SWITCHYARD_PLACEMENT_INFLIGHT_TIMEOUT_S": "60",
                "SWITCHYARD_MIGRATION_STEP_TIMEOUT_S": "5",
                "SWITCHYARD_MIGRATION_RETRY_BACKOFF_S": "0.2",
                "SWITCHYARD_ROUTER_STALE_AFTER_S": str(STALE_AFTER_S),
            }
        )
        logs = self.root / "logs"
        logs.mkdir(exist_ok=True)
        api_port = free_port()
        self.placement_metrics = free_port()
        env = {**env, "SWITCHYARD_PLACEMENT_METRICS_PORT": str(self.placement_metrics)}
        self.api_url = f"http://127.0.0.1:{api_port}"
        commands = {
            "router": cli("router"),
            "placement": cli("placement"),
            "migration": cli("migration"),
            "api": cli("api", "--port", str(api_port)),
            "fleet": cli(
                "fleet",
                "--prefill",
                str(self.o.prefill),
                "--decode",
                str(self.o.decode),
                "--speed",
                str(self.o.speed),
                "--seed",
                str(self.o.seed),
            ),
        }
        for replica in range(2, self.o.router_replicas + 1):  # spares the `router` fault leaves running
            commands[f"router-{replica}"] = cli("router")
        gateway_port = free_port()
        self.gateway_url = f"http://127.0.0.1:{gateway_port}"
        if gateway_available():
            commands["gateway"] = cli("gateway", "--port", str(gateway_port))
            for engine_id in HTTP_ENGINES:  # DP engines that answer HTTP: what the gateway's load reaches
                commands[engine_id] = [
                    sys.executable,
                    "-m",
                    "switchyard.engine_agents.stub",
                    *("--engine-id", engine_id, "--nats-url", self.nats_url, "--tokens", "8"),
                    *("--token-interval-s", "0.01"),
                ]
        for name, argv in commands.items():
            self.procs[name] = ServiceProcess(name, argv, env, logs / f"{name}.log")
        self.procs["api"].ready_port = api_port
        if "gateway" in self.procs:
            self.procs["gateway"].ready_port = gateway_port
        self.procs[GHOST] = ServiceProcess(GHOST, self._ghost_argv(late_s=None), env, logs / "ghost.log")

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

    async def _inject(self, fault: str) -> str:
        if fault in (*SERVICE_FAULTS, "gateway"):
            await self._restart(fault)
            return "SIGKILL, restarted at once"
        if fault == "nats":
            await asyncio.to_thread(self.nats.stop)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(self.nats.start)
            return "stopped 1 s, restarted (same port, same JetStream store)"
        if fault == "postgres":
            assert self.pg is not None
            await asyncio.to_thread(self.pg.crash)
            await asyncio.sleep(2.0)
            await asyncio.to_thread(self.pg.start)
            return "crashed (immediate), down 2 s, restarted"
        if fault == "flood":
            self._flooding = asyncio.create_task(self._flood(max(self.o.fault_s - 3.0, 1.0)))
            return f"payloads of {self.bus.max_payload - 512} bytes on engine hello and telemetry subjects"
        ghost = self.procs[GHOST]
        if fault == "engine-vanish":
            await asyncio.to_thread(ghost.kill)
            return "ghost decoder SIGKILLed (no goodbye)"
        if fault == "slow-engine":
            ghost.argv = self._ghost_argv(late_s=1.5)
            ghost.start()
            return "ghost decoder back, telemetry every 1.5 s (limit 1 s)"
        raise ValueError(f"unknown fault {fault!r}")

    async def _after(self, fault: str) -> str:
        """Undo the fault; returns what to add to its note."""
        if fault == "slow-engine":
            await asyncio.to_thread(self.procs[GHOST].kill)
        if fault == "flood":
            started = time.time()
            sent, cut_off = await self._flooding
            who = ", ".join(f"{name} {n}" for name, n in cut_off.most_common()) or "none"
            note = f"; {sent} flood messages; slow-consumer cut-offs: {who}"
            if cut_off["chaos-watch"]:  # this script missed telemetry the router saw: it cannot judge misrouting
                self.blind.append((started - self.o.fault_s, time.time()))
                note += "; this script's telemetry watch was cut off too"
            return note
        return ""

    async def _flood(self, seconds: float) -> tuple[int, Counter[str]]:
        """Send near-limit garbage on engine wildcard subjects for `seconds`; (messages sent, the server's
        slow-consumer cut-offs meanwhile by client connection name)."""
        import nats

        log_path = self.nats.log_path
        offset = log_path.stat().st_size if log_path.exists() else 0
        nc = await nats.connect(self.nats_url, name="chaos-flood", max_reconnect_attempts=-1)
        payload = bytes(self.bus.max_payload - 512)  # not msgpack: refused by size before anything is read
        s = self.bus.subjects
        subjects = [subject(f"flood-{i}") for i in range(4) for subject in (s.hello, s.telemetry)]
        sent = 0
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                await nc.publish(subjects[sent % len(subjects)], payload)
                sent += 1
                if sent % 4 == 0:  # keep the client's own buffer bounded: the server takes what it can
                    with contextlib.suppress(Exception):
                        await nc.flush(timeout=5)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
        with log_path.open("rb") as server_log:
            server_log.seek(offset)
            lines = server_log.read().decode(errors="replace").splitlines()
        cut_off: Counter[str] = Counter()
        for line in lines:
            if "Slow Consumer" in line:
                name = line.split('"')[1].rsplit(":", 1)[-1] if line.count('"') >= 2 else "unnamed"
                cut_off[name] += 1
        return sent, cut_off

    def _enabled(self) -> list[str]:
        enabled = []
        for fault in self.o.faults:
            if fault == "gateway" and "gateway" not in self.procs:
                self.notes.append("gateway fault skipped: switchyard.services.gateway is not installed")
            elif fault == "postgres" and self.pg is None:
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
            asyncio.create_task(self._sample_windows(self.placement_metrics)),
            asyncio.create_task(self._probe_api()),
            *([asyncio.create_task(self._gateway_load())] if "gateway" in self.procs else []),
        ]
        retry = asyncio.create_task(self._retry())
        up = await self._wait_routing()
        log.info("loop up: routing answered %.1f s after the services started", up)
        await asyncio.sleep(5.0)  # telemetry, first windows
        results = []
        for fault in self._enabled():
            start = time.time()
            await asyncio.sleep(1.0)
            injected = time.time()
            note = await self._inject(fault)
            log.info("fault %s: %s", fault, note)
            await asyncio.sleep(max(start + self.o.fault_s - time.time(), 0.0))
            note += await self._after(fault)
            results.append(FaultResult(fault, start, injected, time.time(), note))
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._drain(self.o.retry_after_s + 30.0)
        retry.cancel()
        # Quiesce before comparing live layouts with the database: no new plans, in-flight migrations finish.
        await asyncio.to_thread(self.procs["placement"].stop)
        await self._wait_migrations(self.o.stuck_after_s)
        await asyncio.sleep(self.o.settle_s)
        audit = await self._audit()
        (self.root / "windows.json").write_text(json.dumps(self.windows))
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
        for name, proc in reversed(list(self.procs.items())):
            code = await asyncio.to_thread(proc.stop)
            if code not in (0, None, -9) and name != GHOST:
                self.notes.append(f"{name} exited with {code} on SIGTERM")
        with contextlib.suppress(Exception):
            await self.bus.close()
        with contextlib.suppress(Exception):
            await self.watch_bus.close()
        await asyncio.to_thread(self.nats.stop)
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
        return audit

    def _misrouted(self, p: Probe) -> bool:
        """Routed to an engine that had sent no telemetry for longer than the staleness limit (+ slack)."""
        if not p.ok or self._blind(p.answered):
            return False
        stamps = self.telemetry.get(p.engine, [])
        i = bisect.bisect_right(stamps, p.answered)
        return i == 0 or p.answered - stamps[i - 1] > MISROUTE_AFTER_S

    def _blind(self, t: float) -> bool:
        return any(down <= t <= up + MISROUTE_AFTER_S + 1.0 for down, up in self.blind)

    def _windows_stalled(self, r: FaultResult) -> bool:
        """No expert-load window folded by placement in the last third of the fault's window."""
        tail = [v for t, v in self.windows if r.end - (r.end - r.injected) / 3 <= t <= r.end]
        return len(tail) >= 2 and tail[-1] == tail[0]

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

    async def _gateway_request(self, client: object, i: int) -> None:
        """One OpenAI completion through the gateway, retried every 0.5 s for `retry_after_s` as a client with
        retries would; lost if it never succeeds (a refused connection, a timeout or a 5xx is a failure)."""
        import httpx

        assert isinstance(client, httpx.AsyncClient)
        body = {"model": "stub-model", "prompt": f"chaos request {i}", "max_tokens": 8}
        sent = time.time()
        first: bool | None = None
        while True:
            at = time.time()
            try:
                answer = await client.post("/v1/completions", json=body)
                ok = answer.status_code == 200
            except httpx.HTTPError:
                ok = False
            self.gw_attempts.append((at, ok))
            first = ok if first is None else first
            if ok or time.time() - sent > self.o.retry_after_s:
                self.gw_requests.append((sent, first, ok))
                return
            await asyncio.sleep(0.5)

    async def _gateway_load(self) -> None:
        """Client requests through the gateway (HTTP, to the stub DP engines), at `gateway_rate` per second."""
        import httpx

        rng = np.random.default_rng(self.o.seed + 3)
        pending: set[asyncio.Task[None]] = set()
        async with httpx.AsyncClient(base_url=self.gateway_url, timeout=5.0) as client:
            i = 0
            while not self._stop.is_set():
                task = asyncio.create_task(self._gateway_request(client, i))
                pending.add(task)
                task.add_done_callback(pending.discard)
                i += 1
                await asyncio.sleep(float(rng.exponential(1.0 / self.o.gateway_rate)))
            if pending:
                await asyncio.wait(pending)

    async def _sample_windows(self, port: int) -> None:
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
                self.windows.append((time.time(), value))
            await asyncio.sleep(0.5)

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
            r.misrouted = sum(self._misrouted(p) for p in in_window)
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
            r.api_failed = sum(code is None for _, code in api)
            r.api_500 = sum(code is not None and code >= 500 and code != 503 for _, code in api)
            down = [t for t, code in api if code is None]
            if down:  # the first answer after the last refused connection
                after = [t for t, code in api if code is not None and t > down[-1]]
                r.api_resume_s = (after[0] if after else r.end) - r.injected
                r.resumed = r.resumed and bool(after)
            gw = [(first, ok) for t, first, ok in self.gw_requests if r.start <= t < r.end]
            r.gw_sent, r.gw_failed = len(gw), sum(not first for first, _ in gw)
            r.gw_lost = sum(not ok for _, ok in gw)
            attempts = [(t, ok) for t, ok in self.gw_attempts if r.start <= t < r.end]
            down = [t for t, ok in attempts if not ok]
            if down:
                after = [t for t, ok in attempts if ok and t > down[-1]]
                r.gw_resume_s = (after[0] if after else r.end) - r.injected
                r.resumed = r.resumed and bool(after)
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


def _utc(naive: object) -> float:
    from datetime import UTC

    return naive.replace(tzinfo=UTC).timestamp()  # type: ignore[attr-defined]


def totals(results: list[FaultResult], audit: Audit) -> dict[str, float]:
    return {
        "faults": len(results),
        "lost": sum(r.lost + r.gw_lost + r.lost_rows for r in results),
        "duplicated": sum(r.duplicated for r in results),
        "stuck": sum(r.stuck for r in results),
        "misrouted": sum(r.misrouted for r in results),
        "max_resume_s": max((r.resume_s for r in results), default=0.0),
    }


def closing_line(results: list[FaultResult], audit: Audit) -> str:
    t = totals(results, audit)
    return (
        f"chaos: {t['faults']} faults, lost {t['lost']}, duplicated {t['duplicated']}, stuck {t['stuck']}, "
        f"misrouted {t['misrouted']}, max resume {t['max_resume_s']:.1f} s"
    )


def table(results: list[FaultResult]) -> str:
    head = (
        f"{'fault':<14}{'requests':>9}{'retried':>8}{'lost':>6}{'probes':>8}{'failed':>8}{'resume s':>10}"
        f"{'misrouted':>11}{'api resume s':>13}{'api 5xx':>8}"
        f"{'gw req':>7}{'gw fail':>8}{'gw lost':>8}{'gw resume s':>12}"
        f"{'plans':>7}{'migr.':>7}{'rows lost':>10}{'dup':>5}{'stuck':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.name:<14}{r.sent:>9}{r.retried:>8}{r.lost:>6}{r.probes:>8}{r.probe_failures:>8}{r.resume_s:>10.2f}"
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
    from switchyard.shared.schemas import Capacity, Hello, ModelShape
    from switchyard.shared.settings import SwitchyardSettings

    settings = SwitchyardSettings(nats_servers=[nats_url])
    bus = await Bus.connect(settings, name=engine_id)
    hello = Hello(
        engine_id=engine_id,
        role="decode",
        model=ModelShape(name="deepseek-v2-lite", num_layers=26, num_experts=64, top_k=6),
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
    options = ChaosOptions(
        faults=faults,
        fault_s=args.fault_s,
        rate=args.rate,
        gateway_rate=args.gateway_rate,
        settle_s=args.settle_s,
        database=args.database,
        workdir=args.workdir,
        router_replicas=max(args.router_replicas, 1),
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
