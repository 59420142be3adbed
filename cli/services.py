"""The service commands: the whole control plane at once (`up`) and each service on its own (`migration`,
`placement`, `api`, `router`, `gateway`, `epp`), each running until Ctrl-C / SIGTERM."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from switchyard.cli.options import (
    DatabaseUrl,
    DataDir,
    EmbeddedNatsUrl,
    NatsUrl,
    load_settings,
    split_csv,
)


def up(
    nats_url: EmbeddedNatsUrl = None,
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
    from switchyard.cli.up import UpOptions, run_up
    from switchyard.solver.routing.profiles import DECODE_PROFILES, EXPERIMENT_VARIANTS

    if policy not in DECODE_PROFILES:  # the router's profiles; the simulator's experiment variants are refused
        why = f" ({EXPERIMENT_VARIANTS[policy]}, not a router profile)" if policy in EXPERIMENT_VARIANTS else ""
        raise typer.BadParameter(f"unknown policy {policy!r}{why}; choose from {', '.join(DECODE_PROFILES)}")
    from switchyard.shared.subjects import check_token

    try:
        engine_ids = [check_token(e, "engine id") for e in split_csv(engines) or []]
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


def migration(nats_url: NatsUrl = None, database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Run the migration service: placement plans in, ordered expert moves out, until Ctrl-C / SIGTERM."""
    from switchyard.services.migration.service import run_migration
    from switchyard.services.runtime import run_until_signalled

    settings = load_settings(nats_url, database_url, data_dir, needs_bus=True)
    run_until_signalled(lambda stop: run_migration(settings, stop))


def placement(nats_url: NatsUrl = None, database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Run the placement service: expert-load windows in, versioned placement plans out, until Ctrl-C / SIGTERM."""
    from switchyard.services.placement.service import run_placement
    from switchyard.services.runtime import run_until_signalled

    settings = load_settings(nats_url, database_url, data_dir, needs_bus=True)
    run_until_signalled(lambda stop: run_placement(settings, stop))


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

    settings = load_settings(nats_url, database_url, data_dir, needs_bus=True)
    config = ApiSettings(**{k: v for k, v in {"host": host, "port": port}.items() if v is not None})
    run_until_signalled(lambda stop: run_api(settings, stop, config))


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

    settings = load_settings(nats_url, needs_bus=True)
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


def gateway(
    nats_url: NatsUrl = None,
    host: Annotated[
        str | None, typer.Option(help="Listen address (default: SWITCHYARD_GATEWAY_HOST, 127.0.0.1).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (default: SWITCHYARD_GATEWAY_PORT, 8000).")] = None,
    mode: Annotated[
        str | None, typer.Option(help="auto, dp or disagg (default: SWITCHYARD_GATEWAY_MODE, auto).")
    ] = None,
    router: Annotated[
        str | None,
        typer.Option(
            help="inprocess (decide here with the router's core and SWITCHYARD_ROUTER_* settings) or remote (ask "
            "`switchyard router` on sy.route.dp / sy.route.decode) (default: SWITCHYARD_GATEWAY_ROUTER, inprocess)."
        ),
    ] = None,
) -> None:
    """Run the OpenAI-compatible gateway: decides each request's engine (in-process, or by asking the router)."""
    from switchyard.services.gateway.service import GatewayService
    from switchyard.services.gateway.settings import GatewaySettings
    from switchyard.services.runtime import run_until_signalled

    if router is not None and router not in ("inprocess", "remote"):
        raise typer.BadParameter(f"--router must be inprocess or remote, not {router!r}")
    settings = load_settings(nats_url, needs_bus=True)
    fields = {"host": host, "port": port, "mode": mode, "router": router}
    overrides = {k: v for k, v in fields.items() if v is not None}
    _fast_event_loop()
    run_until_signalled(GatewayService(settings, GatewaySettings(**overrides)).run)


def epp(
    nats_url: NatsUrl = None,
    host: Annotated[
        str | None, typer.Option(help="gRPC listen address (default: SWITCHYARD_EPP_HOST, 127.0.0.1).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="gRPC listen port (default: SWITCHYARD_EPP_PORT, 9002).")] = None,
    fallbacks: Annotated[
        int | None,
        typer.Option(
            help="Endpoints sent after the chosen one (default: SWITCHYARD_EPP_FALLBACKS, 2; 0 for an ORIGINAL_DST "
            "cluster, which reads one address)."
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(help="PEM certificate chain: serve TLS (with --tls-key; SWITCHYARD_EPP_TLS_CERT).")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Its private key (SWITCHYARD_EPP_TLS_KEY).")] = None,
) -> None:
    """Run the endpoint picker: Envoy's ext_proc (Gateway API Inference Extension) answered by the router's core.

    Envoy (or any GIE gateway: Istio, kgateway, Envoy Gateway) asks it where each OpenAI request goes; it answers
    x-gateway-destination-endpoint (header and envoy.lb metadata) with the chosen engine's ip:port and fallbacks,
    or an OpenAI error (400, 404, 413, 429, 503). It decides as the in-process gateway does (SWITCHYARD_ROUTER_*
    profiles, prefix keys, every replica's decisions), serves data-parallel engines, and publishes its decisions
    on sy.route.decided.gateway.<id> (as NATS user epp-<id>: nats-config --epps). docs/epp.md.

    Other settings (environment): SWITCHYARD_EPP_METRICS_PORT (HTTP: Prometheus /metrics and POST /v1/select, AIBrix's
    external routing request; 9090; 0: none),
    SWITCHYARD_EPP_SHED_LOAD (429 when every engine has this many requests outstanding; 0: never),
    SWITCHYARD_EPP_MAX_BODY_BYTES (413 past it; the gateway's 16 MiB), SWITCHYARD_EPP_PREFIX_KEYS (name prompt
    blocks for prefix routing; true), SWITCHYARD_EPP_TOKENIZERS (model=path,...), SWITCHYARD_EPP_ARTIFACT_POLL_S
    (1), SWITCHYARD_EPP_EJECT_AFTER_FAILURES (2 failed answers in a row take an engine out until its /health
    answers), SWITCHYARD_EPP_HEALTH_CHECK_INTERVAL_S (1), SWITCHYARD_EPP_HEALTH_TIMEOUT_S (1),
    SWITCHYARD_EPP_MAX_STREAMS (4096 ext_proc streams at once), SWITCHYARD_EPP_EPP_ID (its id on the bus).
    """
    from pydantic import ValidationError

    from switchyard.services.epp.service import EppService
    from switchyard.services.epp.settings import EppSettings
    from switchyard.services.runtime import run_until_signalled

    settings = load_settings(nats_url, needs_bus=True)
    fields = {"host": host, "port": port, "fallbacks": fallbacks, "tls_cert": tls_cert, "tls_key": tls_key}
    try:
        epp_settings = EppSettings(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # one line naming what is wrong, not pydantic's report
        raise typer.BadParameter("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
    # asyncio's own loop: grpc.aio supports it (uvloop only experimentally). The service is made inside the loop: its
    # HTTP client for ejected engines' health checks binds to the running loop.
    run_until_signalled(lambda stop: EppService(settings, epp_settings).run(stop))
