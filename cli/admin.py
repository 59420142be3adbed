"""The admin commands: the database schema (`db upgrade`, `db downgrade`), the NATS server's configuration
with one user per role (`nats-config`) and the bus contract as an AsyncAPI document (`asyncapi`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from switchyard.cli.options import DatabaseUrl, load_settings, split_csv


def db_upgrade(database_url: DatabaseUrl = None, revision: str = "head") -> None:
    """Apply schema migrations up to REVISION (default head)."""
    from switchyard.shared.db.engine import current_revision, upgrade

    url = load_settings(database_url=database_url).resolved_database_url()
    upgrade(url, revision)
    typer.echo(f"schema at {current_revision(url)}")


def db_downgrade(revision: str, database_url: DatabaseUrl = None) -> None:
    """Revert schema migrations down to REVISION ('base' drops every table)."""
    from switchyard.shared.db.engine import current_revision, downgrade

    url = load_settings(database_url=database_url).resolved_database_url()
    downgrade(url, revision)
    typer.echo(f"schema at {current_revision(url)}")


def nats_config(
    out: Annotated[Path, typer.Option(help="Folder for nats-server.conf and credentials.json.")],
    engines: Annotated[
        str | None,
        typer.Option(
            help="Engines, comma-separated, as ID, ID:EP_GROUP:DP_RANK, ID:ROLE:URL or ID:ROLE:URL:EP_GROUP:DP_RANK "
            "(ROLE: dp, prefill or decode; URL: its OpenAI base URL): one NATS user each, and an engines.json "
            "manifest that binds each engine to what it lists (SWITCHYARD_ENGINE_MANIFEST); a warning for each "
            "engine given without ROLE:URL."
        ),
    ] = None,
    fleet_engines: Annotated[
        str | None,
        typer.Option(
            help="Engine ids of a simulated fleet process (user `fleet`), comma-separated; listed in engines.json "
            "by id."
        ),
    ] = None,
    gateways: Annotated[
        str | None,
        typer.Option(
            help="Gateway replica ids, comma-separated: one NATS user each (`gateway-<id>`), the only one that may "
            "publish that replica's routing decisions; run each with SWITCHYARD_GATEWAY_GATEWAY_ID=<id>."
        ),
    ] = None,
    epps: Annotated[
        str | None,
        typer.Option(
            help="Endpoint picker ids (`switchyard epp`), comma-separated: one NATS user each (`epp-<id>`), reading "
            "the fleet and publishing only that picker's decisions; run each with SWITCHYARD_EPP_EPP_ID=<id>."
        ),
    ] = None,
    listen: Annotated[str, typer.Option(help="Client listen address.")] = "127.0.0.1:4222",
    monitor: Annotated[str, typer.Option(help="Monitoring listen address ('' for none).")] = "127.0.0.1:8222",
    store_dir: Annotated[str, typer.Option(help="JetStream store folder.")] = "/var/lib/nats/jetstream",
    tls_cert: Annotated[Path | None, typer.Option(help="Server TLS certificate (with --tls-key, --tls-ca).")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Server TLS key.")] = None,
    tls_ca: Annotated[Path | None, typer.Option(help="CA that signed the clients' certificates.")] = None,
) -> None:
    """Write a nats-server config with one user per role and each role's permissions (docs/security.md)."""
    from switchyard.shared.engine_manifest import EngineEntry, EngineManifest, parse_engine_specs, partial_bindings
    from switchyard.shared.nats_auth import (
        SERVICE_ROLES,
        Credentials,
        engine_user,
        epp_user,
        gateway_user,
        render_server_config,
    )
    from switchyard.shared.stream_limits import file_store_bytes

    settings = load_settings()
    try:
        engine_ids, manifest = parse_engine_specs(engines or "")
    except ValueError as exc:
        raise typer.BadParameter(f"--engines: {exc}") from None
    fleet_ids = split_csv(fleet_engines) or []
    gateway_ids = list(dict.fromkeys(split_csv(gateways) or []))
    try:
        gateway_users = [gateway_user(g) for g in gateway_ids]
    except ValueError as exc:
        raise typer.BadParameter(f"--gateways: {exc}") from None
    epp_ids = list(dict.fromkeys(split_csv(epps) or []))
    if both := sorted(set(epp_ids) & set(gateway_ids)):  # a picker shares decisions as a gateway replica does
        raise typer.BadParameter(f"--epps: {', '.join(both)} also named in --gateways (one id, one replica)")
    try:
        epp_users = [epp_user(e) for e in epp_ids]
    except ValueError as exc:
        raise typer.BadParameter(f"--epps: {exc}") from None
    roles = [
        *SERVICE_ROLES,
        *(["fleet"] if fleet_ids else []),
        *[engine_user(e) for e in engine_ids],
        *gateway_users,
        *epp_users,
    ]
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
        max_file_store=file_store_bytes(settings),
        tls=tls,
    )
    out.mkdir(parents=True, exist_ok=True)
    conf_path = out / "nats-server.conf"
    conf_path.touch(mode=0o600)
    conf_path.write_text(config)
    credentials.save(out / "credentials.json")
    typer.echo(f"wrote {conf_path} ({len(roles)} users) and {out / 'credentials.json'}")
    if manifest is not None:
        for engine in partial_bindings(manifest):
            typer.echo(
                f"warning: engine {engine} is given without ROLE:URL: its entry binds no role or base URL, so its "
                f"credentials may send clients' prompts anywhere (give {engine}:ROLE:URL)",
                err=True,
            )
    listed = {**dict.fromkeys(fleet_ids, EngineEntry()), **(manifest.entries if manifest is not None else {})}
    if listed:
        (out / "engines.json").write_text(EngineManifest(listed).to_json() + "\n")
        typer.echo(f"wrote {out / 'engines.json'}: SWITCHYARD_ENGINE_MANIFEST for every service and the gateway")
    typer.echo(f"run: nats-server -c {conf_path}; services: SWITCHYARD_NATS_CREDENTIALS={out / 'credentials.json'}")
    for gateway_id in gateway_ids:
        typer.echo(f"gateway {gateway_id}: SWITCHYARD_GATEWAY_GATEWAY_ID={gateway_id} (user gateway-{gateway_id})")
    for epp_id in epp_ids:
        typer.echo(f"endpoint picker {epp_id}: SWITCHYARD_EPP_EPP_ID={epp_id} (user epp-{epp_id})")


def asyncapi(
    out: Annotated[Path | None, typer.Option(help="Write the document here (default: print it).")] = None,
    prefix: Annotated[str, typer.Option(help="Subject prefix of the deployment.")] = "sy",
) -> None:
    """Print the bus contract as an AsyncAPI 3.0.0 document (JSON; infra/asyncapi.json is prefix sy's)."""
    from switchyard.engine_agents.sim.live.protocol import SimCompleted, SimSubmit
    from switchyard.shared.asyncapi import build, render
    from switchyard.shared.subjects import Subjects

    try:
        subjects = Subjects(prefix)
    except ValueError as exc:
        raise typer.BadParameter(f"--prefix: {exc}") from None
    text = render(build({"SimSubmit": SimSubmit, "SimCompleted": SimCompleted}, subjects))
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text, encoding="utf-8")
        typer.echo(f"wrote {out}")


def settings(
    markdown: Annotated[
        bool, typer.Option("--markdown", help="A Markdown reference (docs/settings.md is one).")
    ] = False,
) -> None:
    """Print every SWITCHYARD_* setting with its default and what it does: by default as a commented .env file."""
    import textwrap

    from switchyard.services.settings_reference import markdown as render_markdown
    from switchyard.services.settings_reference import reference

    if markdown:
        typer.echo(render_markdown(), nl=False)
        return
    for class_name, what, entries in reference():
        typer.echo(f"# ===== {what} ({class_name}) =====")
        previous = None
        for entry in entries:
            if entry.doc != previous:  # one comment for a group of settings documented together
                typer.echo("")
                for line in textwrap.wrap(entry.doc or "(undocumented)", 110):
                    typer.echo(f"# {line}")
            previous = entry.doc
            value = "" if entry.default in ("unset", "empty", "(required)") else entry.default
            typer.echo(f"# {entry.env}={value}")
        typer.echo("")
