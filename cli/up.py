"""`switchyard up`: the whole control plane, and a simulated fleet to control, on one machine.

With no external servers given it starts a private nats-server (JetStream) and uses a SQLite file, both
under the data dir; that server takes only this run's own per-role users (`shared.local_nats`: passwords
generated per run, written mode 0600), each component connecting as its role. Then it:

1. fits the ELDR routing artifact on the calibration part of the shipped ESFT routing trace, unless the KV
   bucket already holds one for this fleet's decoders (file, database row and KV bucket, as `switchyard fit`);
2. starts the router, placement, migration and API services (each also deployable alone: `switchyard router`,
   `placement`, `migration`, `api`);
3. starts a live simulated xPyD fleet (`engine_agents.sim.live.engines`) replaying the trace's held-out requests,
   each engine serving OpenAI HTTP, and `switchyard gateway` in front of it (a child process, port 8000 by
   default); a load generator replays the Azure conversation trace for `--duration` seconds as HTTP clients
   of the gateway (`engine_agents.sim.live.http_loadgen`), so every request takes the path a real fleet's do:
   gateway -> prefill engine -> `sy.route.decode` (ELDR) -> decoder -> streamed back. `--no-gateway` sends
   the load on the bus instead (`sy.sim.submit`), the prefill engines handing off themselves;
4. shows a live table of per-engine load (from the engines' telemetry on the bus) and running TTFT/TPOT,
   simulated (the fleet's virtual clock) and as the HTTP clients measured them, then a summary; Ctrl-C or
   SIGTERM stops everything in reverse order, leaving no process behind: the load first, then placement
   (and the migrations it started, so none is left to resume against the next run's fresh engines), the
   gateway, the fleet, and the other services.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from sqlalchemy import func, select

from switchyard import data as shipped
from switchyard.cli.gateway_process import GatewayProcess
from switchyard.cli.up_infra import Infrastructure, describe, infrastructure, role_buses
from switchyard.engine_agents.sim.live.engines import LiveFleet, LiveFleetConfig
from switchyard.engine_agents.sim.live.http_loadgen import ClientStats, HttpLoadGenerator
from switchyard.engine_agents.sim.live.loadgen import Completions, LoadGenerator
from switchyard.engine_agents.sim.live.protocol import SimCompleted
from switchyard.services.api.server import run_api
from switchyard.services.api.settings import ApiSettings
from switchyard.services.artifacts import ArtifactError, get_artifact_kv, publish_artifact
from switchyard.services.fleet_view import FleetView
from switchyard.services.migration.service import UNFINISHED, run_migration
from switchyard.services.placement.service import run_placement
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.db import Migration, Placement, create_async_db
from switchyard.shared.embedded import free_port
from switchyard.shared.engine_manifest import write_listing
from switchyard.shared.local_nats import GATEWAY_ID
from switchyard.shared.schemas import RoutingArtifact
from switchyard.shared.settings import SwitchyardSettings
from switchyard.simulator.core.workload import load_requests
from switchyard.simulator.offline.scenario import Scenario, prepare
from switchyard.solver.eldr_fit import FitOptions, fit_routing_artifact

log = logging.getLogger(__name__)

#: Default compression of the Azure trace's arrival times (see `UpOptions.time_scale`).
BUS_TIME_SCALE, GATEWAY_TIME_SCALE = 10.0, 3.0
console = Console()


@dataclass
class UpOptions:
    duration_s: float | None = 60.0
    policy: str = "eldr"
    prefill: int = 2
    decode: int = 4
    gpus_per_decoder: int = 2
    gpu: str = "H100"
    #: Simulated seconds per wall second for the fleet (lower it on a slow machine).
    speed: float = 1.0
    #: Request arrivals and lengths: the Azure conversation trace, its time divided by `time_scale`; None:
    #: 10 (about 41 req/s) on the bus, 3 (about 11 req/s) through the gateway, which is what a 2-core machine
    #: holds once every request crosses four HTTP hops in Python (docs/simulator.md).
    time_scale: float | None = None
    rate: float | None = None
    requests_csv: Path | None = None
    trace: Path | None = None
    seed: int = 0
    refit: bool = False
    api_port: int | None = None
    #: Only the control plane (no simulated fleet, no load): what operators run beside real engines.
    services_only: bool = False
    #: Real engines' ids: each gets an `engine-<id>` user on the embedded bus (ignored with an external one).
    engines: list[str] = field(default_factory=list)
    #: The load goes through `switchyard gateway` on this port (0: a free one); None: on the bus, no gateway.
    gateway_port: int | None = 8000
    gateway_host: str = "127.0.0.1"
    #: Tokens per streamed chunk from the simulated engines (vLLM's `--stream-interval`).
    stream_interval: int = 1
    extra: dict[str, object] = field(default_factory=dict)


async def ensure_artifact(
    infra: Infrastructure,
    scenario: Scenario,
    decoder_ids: list[str],
    settings: SwitchyardSettings,
    refit: bool,
    seed: int,
    fit_bus: Bus | None = None,
) -> tuple[RoutingArtifact, bool]:
    """The KV bucket's artifact if it was fitted for these decoders and this model; else fit and publish one."""
    fit_bus = fit_bus or infra.bus
    key = settings.artifact_key()
    try:
        current = await get_artifact_kv(fit_bus, key)
    except ArtifactError as exc:  # garbage, or unsigned while a key is set: fit a good one
        log.warning("the KV bucket's routing artifact is not usable (%s): fitting a new one", exc)
        current = None
    model = scenario.model
    if (
        current is not None
        and not refit
        and current.decoder_ids == decoder_ids
        and (current.model.num_layers, current.model.num_experts) == (model.moe_layers, model.num_experts)
    ):
        return current, False
    calibration = scenario.counts.subset(scenario.calib)
    artifact, report = await asyncio.to_thread(
        fit_routing_artifact, calibration, len(decoder_ids), FitOptions(seed=seed), decoder_ids=decoder_ids
    )
    versioned = await publish_artifact(
        artifact,
        report,
        out=settings.data_dir / "routing-artifact.msgpack",
        database_url=infra.database_url,
        bus=fit_bus,
        key=key,
    )
    return versioned, True


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"  # NaN-safe


@dataclass
class Load:
    """What sends the load and what measured it: the fleet's simulated completions, the clients' own view."""

    sender: LoadGenerator | HttpLoadGenerator
    completions: Completions
    client: ClientStats | None = None
    gateway_url: str | None = None
    #: The gateway's counters at the end (`GatewayProcess.counters`).
    gateway_counters: dict[str, float] = field(default_factory=dict)
    #: How the gateway decided (`GatewayProcess.routing`).
    gateway_routing: str = ""

    @property
    def sent(self) -> int:
        return self.sender.sent


def _latency_rows(table: Table, name: str, s: dict[str, float]) -> None:
    table.add_row(name, _ms(s["ttft_p50_ms"]), _ms(s["ttft_p99_ms"]), _ms(s["tpot_p50_ms"]), _ms(s["tpot_p99_ms"]))


def _live_table(view: FleetView, load: Load, fleet: LiveFleet, started: float) -> Group:
    engines = Table(title="engines (from their telemetry on the bus)")
    for column in ("engine", "role", "running", "waiting", "KV %", "step ms", "expert pressure", "migrating"):
        engines.add_column(column, justify="right" if column not in ("engine", "role") else "left")
    for engine_id in sorted(view.engines):
        state = view.engines[engine_id]
        t, hello = state.telemetry, state.hello
        if t is None or hello is None:
            continue
        stale = " (stale)" if view.is_stale(state) else ""
        engines.add_row(
            engine_id + stale,
            hello.role,
            str(t.num_running),
            str(t.num_waiting),
            f"{t.kv_usage * 100:.0f}",
            f"{t.step_time_ema * 1e3:.2f}",
            f"{t.expert_pressure:.2f}",
            "yes" if t.migrating else "",
        )
    done = load.completions
    latency = Table(title=f"requests: {load.sent} sent, {len(done)} done, {time.monotonic() - started:.0f} s")
    for column in ("window", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"):
        latency.add_column(column, justify="right")
    _latency_rows(latency, "simulated, last 200", done.summary(recent=200))
    _latency_rows(latency, "simulated, all", done.summary())
    if load.client is not None:
        speed = fleet.config.speed
        _latency_rows(latency, "HTTP clients, last 200", load.client.summary(recent=200, scale=speed))
        _latency_rows(latency, "HTTP clients, all", load.client.summary(scale=speed))
    behind = fleet.behind_s()
    note = (
        f"fleet keeps up with the wall clock (behind {behind * 1e3:.1f} ms)"
        if behind < 0.05
        else (f"[yellow]fleet is {behind:.2f} s behind the wall clock: lower --speed[/yellow]")
    )
    return Group(engines, latency, note)


async def _history_counts(database_url: str) -> dict[str, int]:
    engine, sessions = create_async_db(database_url)
    try:
        async with sessions() as session:
            placements = (
                await session.execute(select(Placement.status, func.count()).group_by(Placement.status))
            ).all()
            migrations = (await session.execute(select(Migration.state, func.count()).group_by(Migration.state))).all()
        counts = {f"placements {status}": n for status, n in placements}
        counts.update({f"migrations {state}": n for state, n in migrations})
        return counts
    finally:
        await engine.dispose()


def _summary(
    options: UpOptions,
    load: Load,
    fleet: LiveFleet,
    artifact: RoutingArtifact,
    history: dict[str, int],
    elapsed: float,
) -> Table:
    done = load.completions
    s = done.summary()
    table = Table(title=f"summary: policy {options.policy}, {options.prefill}P{options.decode}D", show_header=False)
    table.add_row("workload", load.sender.workload.description)
    if load.client is not None:
        failed = ", ".join(f"{k} {v}" for k, v in sorted(load.client.failed.items())) or "none"
        table.add_row(
            "requests",
            f"{load.sent} sent, {len(load.client)} completed at the HTTP clients (failed: {failed}); "
            f"{len(done)} finished in the fleet, {fleet.counters.rejected} rejected by it",
        )
        table.add_row(
            "path",
            f"HTTP clients -> gateway {load.gateway_url} ({load.gateway_routing}) -> prefill -> router -> decoder",
        )
    else:
        table.add_row(
            "requests", f"{load.sent} sent, {len(done)} completed, {fleet.counters.rejected} rejected by the fleet"
        )
    table.add_row(
        "throughput",
        f"{len(done) / max(elapsed, 1e-9):.1f} req/s, {done.tokens / max(elapsed, 1e-9):.0f} output tokens/s (wall)",
    )
    table.add_row("TTFT p50 / p99", f"{_ms(s['ttft_p50_ms'])} / {_ms(s['ttft_p99_ms'])} ms (simulated time)")
    table.add_row("TPOT p50 / p99", f"{_ms(s['tpot_p50_ms'])} / {_ms(s['tpot_p99_ms'])} ms (simulated time)")
    if load.client is not None:
        c = load.client.summary(scale=fleet.config.speed)
        scaled = f", wall x speed {fleet.config.speed:g}" if fleet.config.speed != 1 else ""
        table.add_row(
            "client TTFT p50 / p99", f"{_ms(c['ttft_p50_ms'])} / {_ms(c['ttft_p99_ms'])} ms (HTTP clients{scaled})"
        )
        table.add_row(
            "client TPOT p50 / p99", f"{_ms(c['tpot_p50_ms'])} / {_ms(c['tpot_p99_ms'])} ms (HTTP clients{scaled})"
        )
    table.add_row(
        "routing artifact",
        f"v{artifact.version}, K={artifact.centroids.shape[0]}, "
        f"{len(artifact.layer_mask)} layers, rho {artifact.rho:.3f}, "
        + (f"mean band {s['mean_band_size']:.2f}" if done.band_sizes else "band sizes: in the router's metrics"),
    )
    by_engine = done.by_engine
    table.add_row("requests per decoder", ", ".join(f"{e} {by_engine[e]}" for e in sorted(by_engine)))
    fallbacks = dict(done.fallbacks)
    if load.client is not None:  # the gateway asked the router, not the fleet: its counters say how it went
        counters = load.gateway_counters
        fallbacks = {k.split(" ", 1)[1]: int(v) for k, v in counters.items() if k.startswith("routing_fallbacks")}
        shown = ("requests", "signatures", "upstream_errors", "retries", "client_aborts")
        table.add_row(
            "gateway counters",
            ", ".join(f"{k} {v:.0f}" for k, v in sorted(counters.items()) if k.startswith(shown)) or "unavailable",
        )
    table.add_row("routing fallbacks", ", ".join(f"{k} {v}" for k, v in fallbacks.items()) or "none")
    table.add_row("history", ", ".join(f"{k} {v}" for k, v in sorted(history.items())) or "no placements yet")
    return table


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to `seconds`; True if `stop` was set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    return stop.is_set()


def _log_to_console_and_file(settings: SwitchyardSettings) -> Path:
    """Warnings to the console (through rich, so they don't tear the live table), everything to a file."""
    from rich.logging import RichHandler

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    path = settings.data_dir / "switchyard.log"
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_file.setLevel(settings.log_level)
    to_console = RichHandler(console=console, show_path=False)
    to_console.setLevel(logging.WARNING)
    root.addHandler(to_file)
    root.addHandler(to_console)
    root.setLevel(min(logging.getLevelName(settings.log_level), logging.WARNING))
    return path


async def run_up(settings: SwitchyardSettings, options: UpOptions | None = None) -> None:
    options = options or UpOptions()
    log_path = _log_to_console_and_file(settings)
    console.print(f"logs: {log_path}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        fleet = _fleet_config(options)
        simulated = [*fleet.prefill_ids(), *fleet.decode_ids()]
        known = [*([] if options.services_only else simulated), *options.engines]
        if settings.engine_manifest is None and known:  # strict mode takes the engines it starts or is told of
            settings = settings.model_copy(
                update={"engine_manifest": write_listing(settings.data_dir / "engines.json", known)}
            )
        async with infrastructure(settings, simulated, options.engines) as infra:
            await _run(settings, options, infra, stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    console.print("[green]stopped cleanly[/green]")


async def _run(settings: SwitchyardSettings, options: UpOptions, infra: Infrastructure, stop: asyncio.Event) -> None:
    services_settings = settings.model_copy(
        update={
            "nats_servers": [infra.nats_url],
            "database_url": infra.database_url,
            "nats_credentials": infra.nats_credentials,
        }
    )
    api = ApiSettings(**({"port": options.api_port} if options.api_port is not None else {}))
    if api.port == 0:  # any free port, but one we can print
        api = api.model_copy(update={"port": free_port(api.host)})
    stop_placement, stop_services = asyncio.Event(), asyncio.Event()
    router = RouterService(services_settings, RouterSettings(policy=options.policy, seed=options.seed))
    await router.start()
    placement = asyncio.create_task(run_placement(services_settings, stop_placement), name="placement")
    tasks = [
        placement,
        asyncio.create_task(run_migration(services_settings, stop_services), name="migration"),
        asyncio.create_task(run_api(services_settings, stop_services, api), name="api"),
    ]
    for task in tasks:
        task.add_done_callback(_log_death)

    async def quiesce() -> None:
        """No new placements, and the migrations already started finish against the engines they began on."""
        stop_placement.set()
        await asyncio.gather(placement, return_exceptions=True)
        left = await _wait_for_migrations(infra.database_url, timeout_s=30.0)
        if left:
            log.warning("stopping with %d migration(s) unfinished; the migration service resumes them", left)

    console.print(describe(infra, settings, f"http://{api.host}:{api.port}"))
    if infra.nats_credentials:  # on a line of its own too, whole, to copy (a table cell may fold it)
        console.print(f"SWITCHYARD_NATS_CREDENTIALS={infra.nats_credentials.resolve()}", soft_wrap=True)
    try:
        if options.services_only:
            console.print("[green]up[/green] - control plane only; Ctrl-C to stop")
            deadline = time.monotonic() + (options.duration_s if options.duration_s is not None else float("inf"))
            while time.monotonic() < deadline and not any(t.done() for t in tasks):
                if await _wait(stop, min(0.5, max(deadline - time.monotonic(), 0.0))):
                    break
        else:
            async with role_buses(services_settings, infra) as buses:
                await _run_fleet(settings, options, infra, stop, tasks, quiesce, buses)
        console.print("stopping...")
    finally:
        stop_placement.set()
        await router.stop()
        stop_services.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for task, result in zip(tasks, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                console.print(f"[red]{task.get_name()} service failed: {result}[/red]")


async def _wait_for_migrations(database_url: str, timeout_s: float) -> int:
    """Wait until no migration is pending or running (or `timeout_s` passes); returns how many are left."""
    engine, sessions = create_async_db(database_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            async with sessions() as session:
                left = int(await session.scalar(select(func.count()).where(Migration.state.in_(UNFINISHED))) or 0)
            if left == 0 or time.monotonic() > deadline:
                return left
            await asyncio.sleep(0.2)
    finally:
        await engine.dispose()


def _log_death(task: asyncio.Task[None]) -> None:
    """A service that dies puts its traceback in the log at once (the console only says it failed)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("%s service died", task.get_name(), exc_info=task.exception())


async def _start_gateway(
    settings: SwitchyardSettings, options: UpOptions, infra: Infrastructure, model: str
) -> GatewayProcess:
    port = options.gateway_port or free_port(options.gateway_host)
    # It decides in-process: the router's settings, and on the embedded bus the id its own user is for.
    env = {"SWITCHYARD_ROUTER_POLICY": options.policy, "SWITCHYARD_ROUTER_SEED": str(options.seed)}
    if infra.embedded_nats is not None:
        env["SWITCHYARD_GATEWAY_GATEWAY_ID"] = GATEWAY_ID
    if settings.engine_manifest is not None:
        env["SWITCHYARD_ENGINE_MANIFEST"] = str(settings.engine_manifest.resolve())
    gateway = GatewayProcess(
        infra.nats_url, options.gateway_host, port, settings.data_dir / "gateway.log", infra.nats_credentials, env
    )
    gateway.start()
    await gateway.wait_ready(model)
    return gateway


def _fleet_config(options: UpOptions) -> LiveFleetConfig:
    """The simulated fleet's configuration (also what the embedded bus's `fleet` user may speak for)."""
    return LiveFleetConfig(
        prefill=options.prefill,
        decode=options.decode,
        gpus_per_decoder=options.gpus_per_decoder,
        gpu=options.gpu,
        speed=options.speed,
        http=options.gateway_port is not None,
        stream_interval=options.stream_interval,
    )


async def _run_fleet(
    settings: SwitchyardSettings,
    options: UpOptions,
    infra: Infrastructure,
    stop: asyncio.Event,
    services: list[asyncio.Task[None]],
    quiesce: Callable[[], Awaitable[None]],
    buses: dict[str, Bus],
) -> None:
    trace = options.trace or settings.trace(shipped.ESFT)
    csv_path = options.requests_csv or settings.trace(shipped.AZURE_CONV)
    scenario = await asyncio.to_thread(prepare, trace, gpu=options.gpu, seed=options.seed)
    through_gateway = options.gateway_port is not None
    config = _fleet_config(options)
    artifact, fitted = await ensure_artifact(
        infra, scenario, config.decode_ids(), settings, options.refit, options.seed, buses["fit"]
    )
    console.print(
        f"routing artifact v{artifact.version} ({'fitted now' if fitted else 'reused'}): "
        f"K={artifact.centroids.shape[0]} decoders, {len(artifact.layer_mask)} of "
        f"{artifact.model.num_layers} layers, {artifact.representation}, rho {artifact.rho:.3f}"
    )
    fleet = LiveFleet(scenario, config)
    gateway: GatewayProcess | None = None
    load: Load | None = None
    sending: asyncio.Task[None] | None = None
    quiesced = False
    try:
        await fleet.start(buses["fleet"])
        view = FleetView()
        await view.subscribe(buses["readonly"], requester="switchyard-up")
        requests = await asyncio.to_thread(load_requests, csv_path)
        # Without a duration the workload (10 minutes of it) repeats until Ctrl-C.
        duration = options.duration_s if options.duration_s is not None else 600.0
        time_scale = options.time_scale or (GATEWAY_TIME_SCALE if through_gateway else BUS_TIME_SCALE)
        expected = int((options.rate or requests.rate * time_scale) * duration * options.speed) + 100
        workload = scenario.workload(
            expected,
            seed=options.seed + 1,
            rate=options.rate,
            requests=requests,
            time_scale=time_scale,
            max_tokens=fleet.max_tokens,
        )
        model = scenario.model.name
        if through_gateway:
            gateway = await _start_gateway(settings, options, infra, model)
            completions = Completions()
            await buses["loadgen"].subscribe(
                buses["loadgen"].subjects.sim_completed, SimCompleted, lambda done, _msg: completions.add(done)
            )
            client = HttpLoadGenerator(gateway.url, workload, model=model, speed=options.speed)
            await client.__aenter__()
            load = Load(client, completions, client.stats, gateway.url)
            console.print(
                f"gateway {gateway.url}: try curl -N {gateway.url}/v1/completions -H 'content-type: "
                f'application/json\' -d \'{{"model": "{model}", "prompt": "hi", "max_tokens": 8, '
                f'"stream": true}}\''
            )
        else:
            bus_load = LoadGenerator(buses["loadgen"], workload, config.prefill_ids(), speed=options.speed)
            await bus_load.listen()
            load = Load(bus_load, bus_load.completions)
        console.print(
            f"fleet {config.prefill}P{config.decode}D ({model} on {options.gpu}, "
            f"{config.gpus_per_decoder} GPUs per decoder), policy {options.policy}; load: {workload.description}"
            + (" through the gateway" if through_gateway else " on the bus")
        )
        started = time.monotonic()
        sending = asyncio.create_task(load.sender.run(options.duration_s, repeat=options.duration_s is None))
        interactive = console.is_terminal
        with (
            Live(_live_table(view, load, fleet, started), console=console, refresh_per_second=2, transient=False)
            if interactive
            else contextlib.nullcontext() as live
        ):
            last_print = 0.0
            while not sending.done() and not stop.is_set():
                if any(t.done() for t in services):
                    break  # a service died: stop and report it
                if gateway is not None and gateway.process is not None and gateway.process.poll() is not None:
                    console.print(f"[red]the gateway exited ({gateway.process.returncode}); see its log[/red]")
                    break
                await _wait(stop, 0.5)
                if live is not None:
                    live.update(_live_table(view, load, fleet, started))
                elif time.monotonic() - last_print >= 10:
                    last_print = time.monotonic()
                    s = load.completions.summary(recent=200)
                    line = (
                        f"{time.monotonic() - started:5.0f} s: {load.sent} sent, "
                        f"{len(load.completions)} done; TTFT p50 {_ms(s['ttft_p50_ms'])} ms, "
                        f"TPOT p50 {_ms(s['tpot_p50_ms'])} ms (simulated, last 200)"
                    )
                    if load.client is not None:
                        c = load.client.summary(recent=200, scale=options.speed)
                        line += f"; clients: TTFT p50 {_ms(c['ttft_p50_ms'])} ms, TPOT p50 {_ms(c['tpot_p50_ms'])} ms"
                    console.print(line)
        if not stop.is_set():
            if isinstance(load.sender, HttpLoadGenerator):
                await load.sender.drain(timeout_s=30.0)
                for _ in range(20):  # the fleet's own reports of the last requests
                    if len(load.completions) >= len(load.sender.stats):
                        break
                    await asyncio.sleep(0.1)
            else:
                await load.sender.drain(timeout_s=30.0)
        elapsed = time.monotonic() - started
    finally:
        if sending is not None:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending
        if load is not None and isinstance(load.sender, HttpLoadGenerator):
            await load.sender.__aexit__(None, None, None)
        with contextlib.suppress(Exception):
            await quiesce()
            quiesced = True
        if gateway is not None:
            if load is not None:
                load.gateway_counters = await gateway.counters()
                load.gateway_routing = gateway.routing()
            await gateway.stop()
        await fleet.stop()
    if not quiesced:
        log.warning("placement did not stop cleanly")
    history = await _history_counts(infra.database_url)
    with contextlib.suppress(Exception):  # a refit (`switchyard fit --from-stream`) may have replaced it meanwhile
        artifact = await get_artifact_kv(buses["fit"], settings.artifact_key()) or artifact
    console.print(_summary(options, load, fleet, artifact, history, elapsed))
