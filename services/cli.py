"""The `switchyard` command line. Each command imports its module lazily so `--help` stays instant."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from switchyard import data as shipped
from switchyard.shared import placement_terms
from switchyard.simulator.core.defaults import (
    DECODE_MAX_RUNNING,
    DP_MAX_RUNNING,
    INFLIGHT_GRACE_S,
    TOKEN_BUDGET,
)

if TYPE_CHECKING:
    from switchyard.engine_agents.sim.live.engines import LiveFleetConfig
    from switchyard.shared.settings import SwitchyardSettings
    from switchyard.solver.signatures import RequestCounts

app = typer.Typer(
    name="switchyard",
    help="Expert-aware control plane for Mixture-of-Experts LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)
app.add_typer(db_app, name="db")

NatsUrl = Annotated[
    str | None,
    typer.Option("--nats-url", help="External NATS server(s), comma-separated; default: start an embedded one."),
]
DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", help="postgresql://... or sqlite:///path; default: SQLite under --data-dir."),
]
DataDir = Annotated[Path | None, typer.Option("--data-dir", help="State folder (default .switchyard).")]


def load_settings(nats_url: str | None = None, database_url: str | None = None, data_dir: Path | None = None):
    """Environment settings, overridden by command-line options."""
    from switchyard.shared.settings import SwitchyardSettings

    overrides: dict[str, object] = {}
    if nats_url:
        overrides["nats_servers"] = nats_url
    if database_url:
        overrides["database_url"] = database_url
    if data_dir:
        overrides["data_dir"] = data_dir
    settings = SwitchyardSettings(**overrides)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return settings


@app.command()
def up(
    nats_url: NatsUrl = None,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
    duration: Annotated[float, typer.Option(help="Seconds of simulated load (0: until Ctrl-C).")] = 60.0,
    policy: Annotated[str, typer.Option(help="Decode profile: eldr, jsq, p2c, rr, random, domain.")] = "eldr",
    prefill: Annotated[int, typer.Option(min=1, help="Simulated prefill engines.")] = 2,
    decode: Annotated[int, typer.Option(min=1, help="Simulated decode engines.")] = 4,
    gpus_per_decoder: Annotated[int, typer.Option(min=1, help="Expert-parallel GPUs per decoder.")] = 2,
    gpu: Annotated[str, typer.Option(help="GPU preset of the simulated engines (H100, H200, MI300X).")] = "H100",
    speed: Annotated[float, typer.Option(min=0.01, help="Simulated seconds per wall second.")] = 1.0,
    time_scale: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Compress the Azure trace's arrival times by this (default: 3 through the gateway, 10 on the bus).",
        ),
    ] = None,
    rate: Annotated[float | None, typer.Option(help="Poisson arrivals at this rate instead (req/s).")] = None,
    refit: Annotated[bool, typer.Option(help="Fit a new routing artifact even if one exists.")] = False,
    api_port: Annotated[int | None, typer.Option(help="API port (default SWITCHYARD_API_PORT, 8080).")] = None,
    services_only: Annotated[bool, typer.Option(help="Only the control plane: no simulated fleet or load.")] = False,
    engines: Annotated[
        str | None,
        typer.Option(
            help="Real engine ids, comma-separated: an engine-<id> user each on the embedded bus, in its "
            "credentials file (<data dir>/nats/credentials.json)."
        ),
    ] = None,
    gateway: Annotated[
        bool, typer.Option(help="Send the load as HTTP clients through `switchyard gateway` (else on the bus).")
    ] = True,
    gateway_port: Annotated[int, typer.Option(min=0, max=65535, help="The gateway's port (0: a free one).")] = 8000,
    stream_interval: Annotated[
        int, typer.Option(min=1, help="Tokens per streamed chunk from the simulated engines (vLLM's).")
    ] = 1,
    seed: int = 0,
) -> None:
    """Run the whole control plane and a simulated fleet (embedded NATS + SQLite unless told otherwise)."""
    from switchyard.services.up import UpOptions, run_up
    from switchyard.solver.routing.profiles import DECODE_PROFILES, EXPERIMENT_VARIANTS

    if policy not in DECODE_PROFILES:  # the router's profiles; the simulator's experiment variants are refused
        why = f" ({EXPERIMENT_VARIANTS[policy]}, not a router profile)" if policy in EXPERIMENT_VARIANTS else ""
        raise typer.BadParameter(f"unknown policy {policy!r}{why}; choose from {', '.join(DECODE_PROFILES)}")
    from switchyard.shared.subjects import check_token

    try:
        engine_ids = [check_token(e, "engine id") for e in _split_csv(engines) or []]
    except ValueError as exc:
        raise typer.BadParameter(f"--engines: {exc}") from None
    options = UpOptions(
        duration_s=duration or None,
        policy=policy,
        prefill=prefill,
        decode=decode,
        gpus_per_decoder=gpus_per_decoder,
        gpu=gpu,
        speed=speed,
        time_scale=time_scale,
        rate=rate,
        refit=refit,
        api_port=api_port,
        services_only=services_only,
        engines=engine_ids,
        gateway_port=gateway_port if gateway else None,
        stream_interval=stream_interval,
        seed=seed,
    )
    asyncio.run(run_up(load_settings(nats_url, database_url, data_dir), options))


@app.command()
def migration(nats_url: NatsUrl = None, database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Run the migration service: placement plans in, ordered expert moves out, until Ctrl-C / SIGTERM."""
    from switchyard.services.migration.service import run_migration
    from switchyard.services.runtime import run_until_signalled

    settings = load_settings(nats_url, database_url, data_dir)
    run_until_signalled(lambda stop: run_migration(settings, stop))


@app.command()
def placement(nats_url: NatsUrl = None, database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Run the placement service: expert-load windows in, versioned placement plans out, until Ctrl-C / SIGTERM."""
    from switchyard.services.placement.service import run_placement
    from switchyard.services.runtime import run_until_signalled

    settings = load_settings(nats_url, database_url, data_dir)
    run_until_signalled(lambda stop: run_placement(settings, stop))


@app.command()
def api(
    nats_url: NatsUrl = None,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
    host: Annotated[str | None, typer.Option(help="Listen address (default SWITCHYARD_API_HOST, 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (default SWITCHYARD_API_PORT, 8080).")] = None,
) -> None:
    """Serve the HTTP API (history, live engines, metrics; OpenAPI at /docs) until Ctrl-C / SIGTERM."""
    from switchyard.services.api.server import run_api
    from switchyard.services.api.settings import ApiSettings
    from switchyard.services.runtime import run_until_signalled

    settings = load_settings(nats_url, database_url, data_dir)
    config = ApiSettings(**{k: v for k, v in {"host": host, "port": port}.items() if v is not None})
    run_until_signalled(lambda stop: run_api(settings, stop, config))


async def _routing_samples_from_stream(
    settings: SwitchyardSettings, since_s: float | None, max_samples: int, ids: list[str] | None
) -> tuple[RequestCounts, list[str], dict[str, object]]:
    """The fleet's routing samples as the fit's input, and the decoders to fit for (the live ones unless given)."""
    from switchyard.services.refit import counts_from_samples, decoders_of, fleet_hellos, read_samples
    from switchyard.shared.bus import Bus

    bus = await Bus.connect(settings, name="switchyard-fit", role="fit")
    try:
        live, top_k, model = decoders_of(await fleet_hellos(bus))
        read = await read_samples(bus, since_s, max_samples)
    finally:
        await bus.close()
    counts = counts_from_samples(read.samples, top_k, model)
    report = {"samples": len(read.samples), "rejected_samples": read.rejected, "live_decoders": live}
    return counts, ids or live, report


def _split_csv(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def _name_weights(value: str | None) -> tuple[tuple[str, float], ...]:
    """``name=weight,name=weight`` as pairs (a bad entry is a usage error)."""
    pairs = []
    for item in _split_csv(value) or ():
        name, sep, weight = item.partition("=")
        try:
            pairs.append((name.strip(), float(weight)))
        except ValueError:
            raise typer.BadParameter(f"{item!r} is not name=weight") from None
        if not sep or not name.strip():
            raise typer.BadParameter(f"{item!r} is not name=weight")
    return tuple(pairs)


@app.command()
def fit(
    trace: Annotated[
        Path | None,
        typer.Option("--trace", help="Routing trace: an .npz file or the ESFT folder (default: the shipped ESFT)."),
    ] = None,
    decoders: Annotated[
        int | None,
        typer.Option("--decoders", "-k", help="Decoders, one centroid each (--from-stream: the live ones).", min=1),
    ] = None,
    from_stream: Annotated[
        bool,
        typer.Option(
            "--from-stream",
            help="Fit on the routing samples the fleet published (SY_ROUTING_SAMPLES), one centroid per live "
            "decoder, and publish the artifact to the router KV bucket of the same NATS.",
        ),
    ] = False,
    since_s: Annotated[
        float | None, typer.Option(help="--from-stream: only samples of the last this many seconds.", min=0)
    ] = None,
    max_samples: Annotated[
        int, typer.Option(help="--from-stream: at most this many (newest) samples.", min=1)
    ] = 20_000,
    fmt: Annotated[str, typer.Option("--format", help="Trace format: auto, npz or esft.")] = "auto",
    prefill_fraction: Annotated[
        float, typer.Option(help="Share of each request treated as prefill when the trace records no phase.")
    ] = 0.5,
    window: Annotated[
        int | None, typer.Option(help="Cut each sequence into windows of about this many tokens (more requests).")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write the artifact (msgpack) to this file.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the fit report as one JSON object.")] = False,
    representation: Annotated[str, typer.Option(help="auto (best ρ), count, count_idf or binary.")] = "auto",
    layers: Annotated[str | None, typer.Option(help="Fixed layer mask, e.g. 0,3,7 (default: greedy on ρ).")] = None,
    mask_tolerance: Annotated[
        float, typer.Option(help="Take the fewest layers whose ρ is within this of the peak (0: the peak).")
    ] = 0.0,
    tau: Annotated[
        float | None, typer.Option(help="Similarity band of the online router (default: the routing layer's, 0.1).")
    ] = None,
    max_pairs: Annotated[int, typer.Option(help="Request pairs for ρ (all if fewer).")] = 5_000,
    holdout: Annotated[float, typer.Option(help="Share of requests held out to report ρ on unseen requests.")] = 0.2,
    restarts: Annotated[int, typer.Option(help="K-means restarts.", min=1)] = 3,
    seed: Annotated[int, typer.Option(help="Random seed (pairs, split, K-means).")] = 0,
    vanilla: Annotated[bool, typer.Option("--vanilla", help="Also report vanilla K-means cluster sizes.")] = False,
    decoder_ids: Annotated[str | None, typer.Option(help="Comma-separated engine id of each centroid.")] = None,
    database_url: Annotated[
        str | None, typer.Option("--database-url", help="Also record the artifact in this database.")
    ] = None,
    nats_url: Annotated[
        str | None, typer.Option("--nats-url", help="Also publish the artifact to the router KV bucket here.")
    ] = None,
) -> None:
    """Fit the ELDR routing artifact (layer mask, IDF, one centroid per decoder) from a routing trace, or from
    the routing samples a running fleet published (--from-stream)."""
    import json

    from switchyard.shared.routing_trace import TraceError
    from switchyard.shared.trace_files import load_trace
    from switchyard.solver.eldr_fit import FitError, FitOptions, fit_routing_artifact
    from switchyard.solver.routing.defaults import DEFAULT_TAU

    try:
        options = FitOptions(
            tau=DEFAULT_TAU if tau is None else tau,
            representation=representation,  # type: ignore[arg-type]
            layer_mask=tuple(int(v) for v in _split_csv(layers) or []) or None,
            mask_tolerance=mask_tolerance,
            max_pairs=max_pairs,
            holdout_fraction=holdout,
            restarts=restarts,
            seed=seed,
            compare_vanilla=vanilla,
        )
        if trace is not None and from_stream:
            raise ValueError("give either --trace PATH or --from-stream, not both")
        ids = _split_csv(decoder_ids)
        stream_report: dict[str, object] = {}
        if from_stream:
            settings = load_settings(nats_url)
            if not settings.nats_servers:
                raise ValueError("--from-stream needs --nats-url (or SWITCHYARD_NATS_SERVERS)")
            nats_url = ",".join(settings.nats_servers)  # the artifact goes back to the bus it came from
            data, ids, stream_report = asyncio.run(_routing_samples_from_stream(settings, since_s, max_samples, ids))
        else:
            path = trace or load_settings().trace(shipped.ESFT)
            data = load_trace(path, fmt, prefill_fraction=prefill_fraction, window=window)  # type: ignore[arg-type]
        if decoders is None and ids is None:
            raise ValueError("--decoders K is required with --trace")
        if decoders is not None and ids is not None and decoders != len(ids):
            raise ValueError(f"--decoders {decoders} but {len(ids)} decoder ids ({', '.join(ids)})")
        artifact, report = fit_routing_artifact(data, decoders or len(ids or []), options, decoder_ids=ids)
        report.update(stream_report)
    except (TraceError, FitError, ValueError, OSError) as exc:  # RefitError is a ValueError
        typer.echo(f"switchyard fit: error: {exc}", err=True)
        raise typer.Exit(2) from None
    if out is not None or database_url is not None or nats_url is not None:
        from sqlalchemy.exc import SQLAlchemyError

        from switchyard.services.artifacts import publish_to

        settings = load_settings(database_url=database_url)
        try:
            artifact = asyncio.run(
                publish_to(
                    artifact, report, settings, out=out, database_url=database_url, nats_servers=_split_csv(nats_url)
                )
            )
        except (OSError, SQLAlchemyError, ValueError) as exc:  # ConnectionError is an OSError
            typer.echo(f"switchyard fit: error: could not store the artifact: {exc}", err=True)
            raise typer.Exit(1) from None
    source = str(trace) if trace is not None else "routing-sample stream"
    report.update(version=artifact.version, out=str(out) if out else None, trace=source)
    if as_json:
        typer.echo(json.dumps(report, allow_nan=False))
        return
    typer.echo(f"{source}: {report['num_requests']} requests ({report['dropped_requests']} dropped)")
    typer.echo("ρ by representation: " + ", ".join(f"{k} {v:.4f}" for k, v in report["rho"].items() if v is not None))
    typer.echo(f"chose {report['representation']}, layers {report['layer_mask']}: ρ {report['rho_selected']:.4f}")
    typer.echo(f"cluster sizes {report['cluster_sizes']} (capacity {report['capacity']})")
    typer.echo(f"artifact v{artifact.version} {artifact.content_hash[:16]} in {report['fit_seconds']:.2f} s")


@app.command()
def router(
    nats_url: NatsUrl = None,
    policy: Annotated[str | None, typer.Option(help="Decode policy (default: SWITCHYARD_ROUTER_POLICY, eldr).")] = None,
    dp_rule: Annotated[
        str | None, typer.Option(help="sy.route.dp rule: gimbal or vllm (default: SWITCHYARD_ROUTER_DP_RULE, gimbal).")
    ] = None,
) -> None:
    """Run one router replica: answers sy.route.decode and sy.route.dp in a queue group."""
    from switchyard.services.router.service import RouterService
    from switchyard.services.router.settings import RouterSettings
    from switchyard.services.runtime import run_until_signalled

    settings = load_settings(nats_url)
    overrides = {k: v for k, v in {"policy": policy, "dp_rule": dp_rule}.items() if v}
    router_settings = RouterSettings(**overrides)
    _fast_event_loop()
    run_until_signalled(RouterService(settings, router_settings).run)


def _fast_event_loop() -> None:
    """uvloop's event loop where it is installed: the request path (the gateway, the router's replies) is
    socket-bound, and uvloop spends less CPU per message and per wake-up than asyncio's selector loop."""
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


@app.command()
def gateway(
    nats_url: NatsUrl = None,
    host: Annotated[
        str | None, typer.Option(help="Listen address (default: SWITCHYARD_GATEWAY_HOST, 127.0.0.1).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (default: SWITCHYARD_GATEWAY_PORT, 8000).")] = None,
    mode: Annotated[
        str | None, typer.Option(help="auto, dp or disagg (default: SWITCHYARD_GATEWAY_MODE, auto).")
    ] = None,
) -> None:
    """Run the OpenAI-compatible gateway: routes each request through sy.route.dp / sy.route.decode to engines."""
    from switchyard.services.gateway.service import GatewayService
    from switchyard.services.gateway.settings import GatewaySettings
    from switchyard.services.runtime import run_until_signalled

    settings = load_settings(nats_url)
    overrides = {k: v for k, v in {"host": host, "port": port, "mode": mode}.items() if v is not None}
    _fast_event_loop()
    run_until_signalled(GatewayService(settings, GatewaySettings(**overrides)).run)


@app.command("nats-config")
def nats_config(
    out: Annotated[Path, typer.Option(help="Folder for nats-server.conf and credentials.json.")],
    engines: Annotated[
        str | None,
        typer.Option(
            help="Engines, comma-separated, as ID, ID:EP_GROUP:DP_RANK, ID:ROLE:URL or ID:ROLE:URL:EP_GROUP:DP_RANK "
            "(ROLE: dp, prefill or decode; URL: its OpenAI base URL): one NATS user each; with any binding, also an "
            "engines.json manifest that binds each engine to what it lists (SWITCHYARD_ENGINE_MANIFEST)."
        ),
    ] = None,
    fleet_engines: Annotated[
        str | None, typer.Option(help="Engine ids of a simulated fleet process (user `fleet`), comma-separated.")
    ] = None,
    listen: Annotated[str, typer.Option(help="Client listen address.")] = "127.0.0.1:4222",
    monitor: Annotated[str, typer.Option(help="Monitoring listen address ('' for none).")] = "127.0.0.1:8222",
    store_dir: Annotated[str, typer.Option(help="JetStream store folder.")] = "/var/lib/nats/jetstream",
    tls_cert: Annotated[Path | None, typer.Option(help="Server TLS certificate (with --tls-key, --tls-ca).")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Server TLS key.")] = None,
    tls_ca: Annotated[Path | None, typer.Option(help="CA that signed the clients' certificates.")] = None,
) -> None:
    """Write a nats-server config with one user per role and each role's permissions (docs/security.md)."""
    from switchyard.shared.engine_manifest import parse_engine_specs
    from switchyard.shared.nats_auth import SERVICE_ROLES, Credentials, engine_user, render_server_config

    settings = load_settings()
    try:
        engine_ids, manifest = parse_engine_specs(engines or "")
    except ValueError as exc:
        raise typer.BadParameter(f"--engines: {exc}") from None
    fleet_ids = _split_csv(fleet_engines) or []
    roles = [*SERVICE_ROLES, *(["fleet"] if fleet_ids else []), *[engine_user(e) for e in engine_ids]]
    tls = None
    if tls_cert or tls_key or tls_ca:
        if not (tls_cert and tls_key):
            raise typer.BadParameter("--tls-cert and --tls-key go together")
        tls = {"cert_file": str(tls_cert), "key_file": str(tls_key), **({"ca_file": str(tls_ca)} if tls_ca else {})}
    credentials = Credentials.generate(roles)
    config = render_server_config(
        settings.subjects,
        credentials,
        fleet_engines=fleet_ids,
        listen=listen,
        monitor=monitor or None,
        store_dir=store_dir,
        max_payload=settings.max_payload_bytes,
        tls=tls,
    )
    out.mkdir(parents=True, exist_ok=True)
    conf_path = out / "nats-server.conf"
    conf_path.touch(mode=0o600)
    conf_path.write_text(config)
    credentials.save(out / "credentials.json")
    typer.echo(f"wrote {conf_path} ({len(roles)} users) and {out / 'credentials.json'}")
    if manifest is not None:
        (out / "engines.json").write_text(manifest.to_json() + "\n")
        typer.echo(f"wrote {out / 'engines.json'}: SWITCHYARD_ENGINE_MANIFEST for every service and the gateway")
    typer.echo(f"run: nats-server -c {conf_path}; services: SWITCHYARD_NATS_CREDENTIALS={out / 'credentials.json'}")


FleetName = Annotated[str, typer.Option(help="Engine id prefix of the simulated fleet.")]
TracePath = Annotated[Path | None, typer.Option(help="Routing trace (default: the shipped ESFT trace).")]


def _fleet_config(
    name: str, prefill: int, decode: int, gpus_per_decoder: int, gpu: str, speed: float, **http: object
) -> LiveFleetConfig:
    from switchyard.engine_agents.sim.live.engines import LiveFleetConfig

    return LiveFleetConfig(
        prefill=prefill, decode=decode, gpus_per_decoder=gpus_per_decoder, gpu=gpu, speed=speed, name=name, **http
    )  # type: ignore[arg-type]


@app.command()
def fleet(
    nats_url: NatsUrl = None,
    trace: TracePath = None,
    name: FleetName = "sim",
    prefill: Annotated[int, typer.Option(min=1)] = 2,
    decode: Annotated[int, typer.Option(min=1)] = 4,
    gpus_per_decoder: Annotated[int, typer.Option(min=1)] = 2,
    gpu: str = "H100",
    speed: Annotated[float, typer.Option(min=0.01, help="Simulated seconds per wall second.")] = 1.0,
    http: Annotated[bool, typer.Option(help="Each engine serves OpenAI-compatible HTTP (Hello.base_url).")] = True,
    http_host: Annotated[str, typer.Option(help="Address the engines' HTTP servers listen on.")] = "127.0.0.1",
    http_port: Annotated[
        int, typer.Option(min=0, max=65535, help="First engine's port, the others follow (0: free ports).")
    ] = 0,
    stream_interval: Annotated[int, typer.Option(min=1, help="Tokens per streamed chunk (vLLM's).")] = 1,
    seed: int = 0,
) -> None:
    """Run a live simulated xPyD fleet on the bus (the engines speak the vLLM agent's protocol and OpenAI HTTP)."""
    from switchyard.engine_agents.sim.live.processes import run_fleet
    from switchyard.services.runtime import run_until_signalled

    settings = load_settings(nats_url)
    config = _fleet_config(
        name,
        prefill,
        decode,
        gpus_per_decoder,
        gpu,
        speed,
        http=http,
        http_host=http_host,
        http_port=http_port,
        stream_interval=stream_interval,
    )
    path = trace or settings.trace(shipped.ESFT)
    run_until_signalled(lambda stop: run_fleet(settings, config, path, seed, stop))


@app.command()
def loadgen(
    nats_url: NatsUrl = None,
    trace: TracePath = None,
    name: FleetName = "sim",
    prefill: Annotated[int, typer.Option(min=1, help="Prefill engines of the target fleet.")] = 2,
    decode: Annotated[int, typer.Option(min=1, help="Decode engines of the target fleet.")] = 4,
    gpus_per_decoder: Annotated[int, typer.Option(min=1)] = 2,
    gpu: str = "H100",
    speed: Annotated[float, typer.Option(min=0.01)] = 1.0,
    num_requests: Annotated[int, typer.Option(min=1)] = 1000,
    requests: Annotated[Path | None, typer.Option(help="Azure-format request CSV (arrivals and lengths).")] = None,
    time_scale: float = 10.0,
    rate: Annotated[float | None, typer.Option(help="Poisson arrivals at this rate (req/s).")] = None,
    url: Annotated[
        str | None,
        typer.Option(help="Send the requests as OpenAI HTTP clients to this base URL (a gateway or an engine)."),
    ] = None,
    model: Annotated[str | None, typer.Option(help="With --url: the model (default: the first listed).")] = None,
    seed: int = 0,
) -> None:
    """Replay a request trace against a running simulated fleet and print TTFT/TPOT as JSON.

    On the bus (default) the latencies are the fleet's simulated ones; with --url they are what the HTTP
    clients measured (wall time x --speed), from each request's scheduled send time.
    """
    from switchyard.engine_agents.sim.live.processes import run_http_loadgen, run_loadgen
    from switchyard.services.runtime import run_until_signalled

    settings = load_settings(nats_url)
    config = _fleet_config(name, prefill, decode, gpus_per_decoder, gpu, speed)
    path = trace or settings.trace(shipped.ESFT)
    if requests is None and rate is None:
        requests = settings.trace(shipped.AZURE_CONV)

    if url is not None and not url.startswith(("http://", "https://")):
        raise typer.BadParameter(f"--url must be an http:// or https:// base URL, got {url!r}")

    async def main(stop: asyncio.Event) -> None:
        if url is not None:
            result = await run_http_loadgen(
                url, config, path, seed, num_requests, requests, time_scale, rate, stop, model=model
            )
        else:
            result = await run_loadgen(settings, config, path, seed, num_requests, requests, time_scale, rate, stop)
        typer.echo(json.dumps(result))

    run_until_signalled(main)


@db_app.command("upgrade")
def db_upgrade(database_url: DatabaseUrl = None, revision: str = "head") -> None:
    """Apply schema migrations up to REVISION (default head)."""
    from switchyard.shared.db.engine import current_revision, upgrade

    url = load_settings(database_url=database_url).resolved_database_url()
    upgrade(url, revision)
    typer.echo(f"schema at {current_revision(url)}")


@db_app.command("downgrade")
def db_downgrade(revision: str, database_url: DatabaseUrl = None) -> None:
    """Revert schema migrations down to REVISION ('base' drops every table)."""
    from switchyard.shared.db.engine import current_revision, downgrade

    url = load_settings(database_url=database_url).resolved_database_url()
    downgrade(url, revision)
    typer.echo(f"schema at {current_revision(url)}")


def _weights_summary(params: object, weights: object) -> dict:
    """The fitted (α, β, γ) beside the Gimbal paper's, with what each is measured in."""
    return {
        "alpha": params.alpha,  # type: ignore[attr-defined]
        "beta": params.beta,  # type: ignore[attr-defined]
        "gamma": params.gamma,  # type: ignore[attr-defined]
        "units": "dimensionless multipliers of the exact marginal increase of each weighted objective term; "
        "objective in canonical units (mean GPU load per layer = 1) with weights "
        f"w_load={weights.load:g}, w_comm={weights.comm:g}, w_mig={weights.mig:g}",  # type: ignore[attr-defined]
        "paper": {
            "alpha": 1.0,
            "beta": 0.0025,
            "gamma": 1.0,
            "units": "Gimbal's score on its un-normalised terms (its own load and traffic units); not transferable",
        },
    }


@app.command()
def calibrate(
    windows: Annotated[
        list[Path] | None,
        typer.Option(
            "--windows",
            help="Recorded windows: .npz / .msgpack files, or folders of SGLang expert-statistics JSONs. "
            "Default: the SGLang DeepSeek-V3 statistics under SWITCHYARD_SHARED_DATA_DIR.",
        ),
    ] = None,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
    gpus: Annotated[int, typer.Option(min=1, help="GPUs in the expert-parallel group.")] = 4,
    time_limit: Annotated[
        float, typer.Option(min=0.01, help="CP-SAT time limit per layer, seconds.")
    ] = placement_terms.DEFAULT_TIME_LIMIT_S,
    parallel_layers: Annotated[
        int, typer.Option(min=1, help="Layers solved at once (threads).")
    ] = placement_terms.DEFAULT_PARALLEL_LAYERS,
    workers_per_layer: Annotated[
        int, typer.Option(min=1, help="CP-SAT workers per layer.")
    ] = placement_terms.DEFAULT_WORKERS_PER_LAYER,
    migration_cost: Annotated[
        float, typer.Option(min=0.0, help="Cost of one host change, in mean-GPU-loads of traffic.")
    ] = placement_terms.DEFAULT_MIGRATION_COST,
    load_weight: Annotated[
        float, typer.Option(min=0.0, help="Objective weight of load balance.")
    ] = placement_terms.DEFAULT_WEIGHTS["load"],
    comm_weight: Annotated[
        float, typer.Option(min=0.0, help="Objective weight of communication.")
    ] = placement_terms.DEFAULT_WEIGHTS["comm"],
    mig_weight: Annotated[
        float, typer.Option(min=0.0, help="Objective weight of migration.")
    ] = placement_terms.DEFAULT_WEIGHTS["mig"],
    objective_tolerance: Annotated[
        float, typer.Option(min=0.0, help="Fitted greedy may cost this much more than the best greedy.")
    ] = placement_terms.DEFAULT_OBJECTIVE_TOLERANCE,
    layers: Annotated[int | None, typer.Option(min=1, help="Use only the first N MoE layers.")] = None,
    experts: Annotated[int | None, typer.Option(min=1, help="Use only the first N experts.")] = None,
    sources_per_window: Annotated[int, typer.Option(min=1, help="SGLang workloads per window.")] = 4,
    engine_group: Annotated[str | None, typer.Option(help="Engine group the calibration is for.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Fit the greedy placement's (alpha, beta, gamma) to offline MINLP solutions and record it."""
    import json

    from switchyard.services.calibration import WindowError, load_window, persist, run_calibration, sglang_windows
    from switchyard.solver.placement import MinlpOptions, PlacementError, Weights

    settings = load_settings(database_url=database_url, data_dir=data_dir)
    sources = windows or [settings.trace(shipped.SGLANG_EXPERT_LOAD)]
    try:
        recorded = [
            w for p in sources for w in (sglang_windows(p, sources_per_window) if p.is_dir() else [load_window(p)])
        ]
        options = MinlpOptions(
            time_limit_s=time_limit, parallel_layers=parallel_layers, workers_per_layer=workers_per_layer
        )
        weights = Weights(load=load_weight, comm=comm_weight, mig=mig_weight)
        result = run_calibration(
            recorded,
            gpus,
            options,
            migration_cost=migration_cost,
            weights=weights,
            objective_tolerance=objective_tolerance,
            layers=layers,
            experts=experts,
        )
    except (WindowError, PlacementError) as exc:
        typer.echo(f"switchyard calibrate: error: {exc}", err=True)
        raise typer.Exit(2) from None
    setup = {
        "windows": [w.name for w in recorded],
        "gpus": gpus,
        "migration_cost": migration_cost,
        "weights": dict(weights),
        "time_limit_s": time_limit,
        "parallel_layers": parallel_layers,
        "workers_per_layer": workers_per_layer,
    }
    row_id = persist(settings.resolved_database_url(), result, engine_group=engine_group, extra={"setup": setup})
    summary = {
        "id": row_id,
        "alpha": result.params.alpha,
        "beta": result.params.beta,
        "gamma": result.params.gamma,
        "agreement": result.agreement,
        "comm_gap": result.comm_gap,
        "objective_gap": result.objective_gap,
        **result.methods,  # greedy, place, keep_layout, eplb: objective_gap, agreement, agreement_moved, comm_gap
        "reference_agreement": result.reference_agreement,
        "weights": _weights_summary(result.params, weights),
        "minlp_gap": result.minlp_gap,
        "solve_seconds": result.minlp_seconds,
        "fit_seconds": result.fit_seconds,
        "num_windows": result.num_windows,
    }
    if as_json:
        typer.echo(json.dumps(summary))
        return
    lines = [
        f"calibration {row_id}: alpha={result.params.alpha:g} beta={result.params.beta:.4g} "
        f"gamma={result.params.gamma:.4g} (paper: 1, 0.0025, 1 in its own units); MINLP gap {result.minlp_gap:.2%}, "
        f"{result.minlp_seconds:.1f} s over {result.num_windows} windows"
    ]
    for name, m in result.methods.items():
        moved = "n/a" if m["agreement_moved"] is None else f"{m['agreement_moved']:.1%}"
        lines.append(
            f"  {name}: objective gap {m['objective_gap']:+.2%}, agreement {m['agreement']:.1%} "
            f"(moved copies {moved}), comm gap {m['comm_gap']:+.2%} vs {m['reference']}"
        )
    typer.echo("\n".join(lines))


@app.command()
def sim(
    trace: Annotated[
        Path | None,
        typer.Option("--trace", help="Routing trace: the ESFT folder/npz or a Switchyard npz (default: shipped ESFT)."),
    ] = None,
    fmt: Annotated[str, typer.Option("--format", help="auto | esft | npz")] = "auto",
    requests: Annotated[
        Path | None, typer.Option("--requests", help="Azure-style request CSV for arrivals and lengths.")
    ] = None,
    time_scale: Annotated[float, typer.Option("--time-scale", help="Divide the CSV's arrival times by this.")] = 1.0,
    rate: Annotated[
        float | None,
        typer.Option("--rate", help="Poisson arrivals at this rate (req/s); with --requests: its lengths."),
    ] = None,
    prefill: Annotated[int, typer.Option("--prefill", help="Prefill engines (P).")] = 8,
    decode: Annotated[int, typer.Option("--decode", help="Decode engines (D).")] = 16,
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated decode policies.")] = "rr,jsq,eldr",
    num_requests: Annotated[int, typer.Option("--num-requests", help="Requests to simulate.")] = 1000,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    gpu: Annotated[str, typer.Option("--gpu", help="H100 | H200 | MI300X")] = "H100",
    gpus: Annotated[int | None, typer.Option("--gpus", help="GPUs per engine (default: the model's).")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model preset (default: the trace's shape).")] = None,
    calib_fraction: Annotated[float, typer.Option(help="Share of trace requests kept for the ELDR fit.")] = 0.5,
    prefill_fraction: Annotated[float, typer.Option(help="Prefill share of traces without phases.")] = 0.5,
    max_running: Annotated[int, typer.Option(help="Max running requests per decode engine.")] = DECODE_MAX_RUNNING,
    kv_blocks: Annotated[int | None, typer.Option(help="KV blocks per decode engine (default: what fits).")] = None,
    prefill_policy: Annotated[str, typer.Option(help="rr | hash")] = "rr",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the summary JSON here.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Folder for JSON, CSV and PNG plots.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Simulate an xPyD fleet replaying a real routing trace under each decode policy."""
    import json

    from switchyard.simulator.offline.run import SimOptions, run_sim

    opts = SimOptions(
        trace=trace or load_settings().trace(shipped.ESFT),
        fmt=fmt,  # type: ignore[arg-type]
        requests=requests,
        time_scale=time_scale,
        rate=rate,
        prefill=prefill,
        decode=decode,
        policies=tuple(_split_csv(policies) or ()),
        num_requests=num_requests,
        seed=seed,
        gpu=gpu,
        gpus=gpus,
        model=model,
        calib_fraction=calib_fraction,
        prefill_fraction=prefill_fraction,
        max_running=max_running,
        kv_blocks=kv_blocks,
        prefill_policy=prefill_policy,
        progress=progress,
    )
    try:
        payload = run_sim(opts, json_path=json_out, out_dir=out)
    except (ValueError, KeyError) as exc:
        raise typer.BadParameter(str(exc)) from None
    keys = ("tpot_p50", "tpot_p99", "ttft_p50", "throughput", "mean_distinct_experts")
    typer.echo(json.dumps(payload["config"]))
    typer.echo(f"{'policy':14s} " + " ".join(f"{k:>22s}" for k in keys))
    for name, s in payload["policies"].items():  # type: ignore[union-attr]
        typer.echo(f"{name:14s} " + " ".join(f"{s[k]:22.6g}" for k in keys))


@app.command("sim-dp")
def sim_dp(
    requests: Annotated[
        Path | None, typer.Option("--requests", help="Azure-style request CSV for arrivals and lengths.")
    ] = None,
    time_scale: Annotated[float, typer.Option("--time-scale", help="Divide the CSV's arrival times by this.")] = 1.0,
    rate: Annotated[
        float | None,
        typer.Option("--rate", help="Poisson arrivals at this rate (req/s); with --requests: its lengths."),
    ] = None,
    start: Annotated[int, typer.Option("--start", help="First CSV request to replay (another stretch).")] = 0,
    engines: Annotated[int, typer.Option("--engines", min=1, help="DP engines.")] = 2,
    tp: Annotated[int, typer.Option("--tp", min=1, help="GPUs per DP engine (tensor parallel).")] = 2,
    coupled: Annotated[
        bool, typer.Option("--coupled/--independent", help="Experts over all engines, lock-step (vLLM DP+EP).")
    ] = True,
    dispatch: Annotated[
        str, typer.Option("--dispatch", help="Comma-separated DP profiles: rr, jsq, vllm, vllm-main, gimbal.")
    ] = "vllm,gimbal",
    order: Annotated[str, typer.Option("--order", help="Queue order: fcfs, sjf-aging or both.")] = "both",
    num_requests: Annotated[int, typer.Option("--num-requests", help="Requests to simulate.")] = 2000,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    gpu: Annotated[str, typer.Option("--gpu", help="H100 | H200 | MI300X")] = "H100",
    trace: Annotated[
        Path | None, typer.Option("--trace", help="Routing trace for expert selections (default: ESFT).")
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model preset (default: the trace's shape).")] = None,
    max_running: Annotated[
        int, typer.Option(help="Max running requests per engine (vLLM max_num_seqs).")
    ] = DP_MAX_RUNNING,
    token_budget: Annotated[int, typer.Option(help="Tokens per step (vLLM max_num_batched_tokens).")] = TOKEN_BUDGET,
    kv_blocks: Annotated[int | None, typer.Option(help="KV blocks per engine (default: what fits).")] = None,
    telemetry_ms: Annotated[
        float, typer.Option(help="Engine telemetry period, ms (in-flight grace: min(50, period/2)).")
    ] = 100.0,
    aligned_telemetry: Annotated[
        bool, typer.Option(help="Every engine reports at the same instants (default: a random phase each).")
    ] = False,
    inflight_drain: Annotated[
        float,
        typer.Option(help="Experiment: in-flight tokens drain at this many tokens/s (0: until the next report)."),
    ] = 0.0,
    dp_weights: Annotated[
        str | None,
        typer.Option(help="Scorer weights, e.g. kv_penalty=2,moe_penalty=0 (each to the profiles that have it)."),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the summary JSON here.")] = None,
) -> None:
    """Simulate a data-parallel fleet: each dispatch rule with FCFS and/or Gimbal's SJF-with-aging ordering."""
    from switchyard.simulator.offline.dp_run import DPSimOptions, run_sim_dp

    orders = ("fcfs", "sjf-aging") if order == "both" else (order,)
    opts = DPSimOptions(
        trace=trace or load_settings().trace(shipped.ESFT),
        requests=requests,
        time_scale=time_scale,
        rate=rate,
        start=start,
        engines=engines,
        tp=tp,
        coupled=coupled,
        dispatch=tuple(_split_csv(dispatch) or ()),
        dispatch_weights=_name_weights(dp_weights),
        orders=orders,
        num_requests=num_requests,
        seed=seed,
        gpu=gpu,
        model=model,
        max_running=max_running,
        token_budget=token_budget,
        kv_blocks=kv_blocks,
        telemetry_interval_s=telemetry_ms / 1e3,
        inflight_grace_s=min(INFLIGHT_GRACE_S, telemetry_ms / 2e3),
        telemetry_aligned=aligned_telemetry,
        inflight_drain_tokens_per_s=inflight_drain,
    )
    try:
        payload = run_sim_dp(opts, json_path=json_out)
    except (ValueError, KeyError) as exc:
        raise typer.BadParameter(str(exc)) from None
    ms = ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99")
    typer.echo(json.dumps(payload["config"]))
    head = " ".join(f"{k + ' ms':>14s}" for k in ms)
    typer.echo(f"{'dispatch+order':20s} {head} {'tok/s':>10s} {'gap tok/s':>10s}")
    for name, s in payload["runs"].items():  # type: ignore[union-attr]
        cells = " ".join(f"{s[k] * 1e3:14.2f}" for k in ms)
        typer.echo(f"{name:20s} {cells} {s['throughput']:10.0f} {s['prompt_tput_gap']:10.0f}")


@app.command()
def report(
    out: Annotated[Path | None, typer.Option("--out", help="Report folder (default: <data-dir>/report).")] = None,
    quick: Annotated[bool, typer.Option(help="A small, fast version (seconds) of every experiment.")] = False,
    trace: Annotated[Path | None, typer.Option("--trace", help="Routing trace (default: the ESFT trace).")] = None,
    requests: Annotated[Path | None, typer.Option("--requests", help="Request CSV (default: Azure conv).")] = None,
    num_requests: Annotated[int | None, typer.Option("--num-requests", help="Requests per run.")] = None,
    rates: Annotated[str | None, typer.Option("--rates", help="Comma-separated rates (req/s) of the sweep.")] = None,
    gpu: Annotated[str, typer.Option("--gpu", help="GPU of every engine (default: the seed's MI300X).")] = "MI300X",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    data_dir: DataDir = None,
    progress: Annotated[bool, typer.Option(help="Show progress.")] = True,
    sections: Annotated[
        str | None,
        typer.Option(
            "--sections",
            help="Comma-separated sections to run: fig2, fig4, fig11, fig15, fig16, table2, bracket (default: all).",
        ),
    ] = None,
) -> None:
    """Regenerate the ELDR experiments (Fig. 2, 4, 11, 15, 16, Table 2, the cost-term bracket) as Markdown + PNG."""
    from switchyard.simulator.offline.report import SECTIONS, ReportOptions, build_report

    settings = load_settings(data_dir=data_dir)
    chosen = tuple(x.strip() for x in sections.split(",") if x.strip()) if sections else SECTIONS
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown or not chosen:
        raise typer.BadParameter(f"unknown section(s) {', '.join(unknown) or '(none)'}; known: {', '.join(SECTIONS)}")
    opts = ReportOptions(
        quick=quick,
        trace=trace or settings.trace(shipped.ESFT),
        requests=requests or settings.trace(shipped.AZURE_CONV),
        num_requests=num_requests,
        rates=tuple(float(r) for r in rates.split(",")) if rates else None,
        gpu=gpu,
        seed=seed,
        progress=progress,
        sections=chosen,
    )
    path = build_report(out or settings.data_dir / "report", opts)
    typer.echo(f"report written to {path}")


def main() -> None:
    """Run the CLI. A usage mistake or a user error prints one or two plain lines and exits 2 (no traceback);
    a genuine bug keeps its traceback."""
    import sys

    try:  # typer >= 0.22 carries its own click; its exceptions are what the app raises
        from typer import _click as click
    except ImportError:  # pragma: no cover - older typer on the system click
        import click

    try:
        code = app(standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.UsageError as exc:
        command = exc.ctx.command_path if exc.ctx else "switchyard"
        click.echo(f"{command}: error: {exc.format_message()}", err=True)
        click.echo(f"Try '{command} --help' for help.", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.ClickException as exc:
        click.echo(f"switchyard: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except Exception as exc:
        from switchyard.services.cli_errors import user_error_message

        message = user_error_message(exc)
        if message is None:
            raise
        command = " ".join(["switchyard", *[a for a in sys.argv[1:3] if not a.startswith("-")]][:3])
        click.echo(f"{command}: error: {message}", err=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
