"""What `switchyard up` stands on: NATS (an embedded server with per-run per-role users, or the one given), the
database with its schema at head, the per-role connections its own parts use, and the start-up table that says
where all of it is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from switchyard.shared.bus import Bus
from switchyard.shared.db.engine import upgrade
from switchyard.shared.embedded import EmbeddedNats
from switchyard.shared.local_nats import secured_embedded
from switchyard.shared.settings import SwitchyardSettings

log = logging.getLogger(__name__)


@dataclass
class Infrastructure:
    """Where the control plane's NATS and database are, and whether we own them."""

    nats_url: str
    database_url: str
    bus: Bus
    embedded_nats: EmbeddedNats | None
    #: The per-role credentials every component connects with (generated for an embedded server).
    nats_credentials: Path | None = None


@contextlib.asynccontextmanager
async def infrastructure(
    settings: SwitchyardSettings, fleet_engines: list[str] | None = None, engines: list[str] | None = None
) -> AsyncIterator[Infrastructure]:
    """Start (or connect to) NATS and the database; tear down in reverse order on exit.

    An embedded server gets fresh per-role credentials (`fleet_engines`: the ids the `fleet` user speaks for;
    `engines`: real engines, an `engine-<id>` user each), so no other local process can use it; an external
    one keeps whatever the settings say.
    """
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    embedded: EmbeddedNats | None = None
    servers = settings.nats_servers
    if not servers:
        if settings.nats_credentials is not None:
            log.info("the embedded NATS server uses its own per-run credentials, not %s", settings.nats_credentials)
        local = secured_embedded(
            settings.data_dir / "nats",
            settings.subjects,
            fleet_engines or [],
            engines=engines,
            max_payload=settings.max_payload_bytes,
        )
        embedded = local.server
        settings = settings.model_copy(update={"nats_credentials": local.credentials_path})
        servers = [await asyncio.to_thread(embedded.start)]
    try:
        database_url = settings.resolved_database_url()
        await asyncio.to_thread(upgrade, database_url)
        bus = await Bus.connect(settings, name="switchyard-up", servers=servers, role="admin")
        try:
            await bus.ensure_streams()
            await bus.ensure_kv(bus.subjects.router_bucket)
            yield Infrastructure(servers[0], database_url, bus, embedded, settings.nats_credentials)
        finally:
            await bus.close()
    finally:
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)


@contextlib.asynccontextmanager
async def role_buses(settings: SwitchyardSettings, infra: Infrastructure) -> AsyncIterator[dict[str, Bus]]:
    """One connection per role (fit, fleet, loadgen, readonly) under per-role credentials; else the shared one."""
    roles = ("fit", "fleet", "loadgen", "readonly")
    if settings.nats_credentials is None:
        yield dict.fromkeys(roles, infra.bus)
        return
    buses: dict[str, Bus] = {}
    try:
        for role in roles:
            buses[role] = await Bus.connect(settings, name=f"switchyard-up-{role}", servers=[infra.nats_url], role=role)
        yield buses
    finally:
        for bus in buses.values():
            await bus.close()


def describe(infra: Infrastructure, settings: SwitchyardSettings, api_url: str | None) -> Table:
    table = Table(title="Switchyard control plane", show_header=False)
    table.add_column()
    table.add_column(overflow="fold")  # a long path folds onto the next line, never cut with an ellipsis
    nats_kind = "embedded" if infra.embedded_nats else "external"
    table.add_row("NATS", f"{infra.nats_url} ({nats_kind})")
    if infra.embedded_nats:
        table.add_row("JetStream store", str(infra.embedded_nats.store_dir.resolve()))
    if infra.nats_credentials:
        table.add_row("NATS users", f"one per role, SWITCHYARD_NATS_CREDENTIALS={infra.nats_credentials.resolve()}")
    db_kind = "SQLite" if infra.database_url.startswith("sqlite") else "PostgreSQL"
    shown = infra.database_url if db_kind == "SQLite" else infra.database_url.split("@")[-1]
    table.add_row("database", f"{shown} ({db_kind}, schema at head)")
    subjects = settings.subjects
    table.add_row(
        "subjects",
        f"{subjects.prefix}.engine.<id>.{{hello,telemetry,expert_load,migrate,layout}}, "
        f"{subjects.route_decode}, {subjects.route_dp}, {subjects.placement_plan}",
    )
    table.add_row("streams", ", ".join(subjects.streams()))
    table.add_row("KV bucket", subjects.router_bucket)
    if api_url:
        table.add_row("API", f"{api_url}/docs (OpenAPI), {api_url}/v1/engines, {api_url}/metrics")
    return table
