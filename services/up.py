"""`switchyard up`: the whole control plane on one machine.

With no external servers given it starts a private nats-server (JetStream) and uses a SQLite file, both
under the data dir; it creates the bus contract's streams and KV bucket, brings the schema to head, prints
where everything is, and runs until Ctrl-C / SIGTERM (or `--duration`), then stops in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from shared.bus import Bus
from shared.db.engine import upgrade
from shared.embedded import EmbeddedNats
from shared.settings import SwitchyardSettings

console = Console()


@dataclass
class Infrastructure:
    """Where the control plane's NATS and database are, and whether we own them."""

    nats_url: str
    database_url: str
    bus: Bus
    embedded_nats: EmbeddedNats | None


@contextlib.asynccontextmanager
async def infrastructure(settings: SwitchyardSettings) -> AsyncIterator[Infrastructure]:
    """Start (or connect to) NATS and the database; tear down in reverse order on exit."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    embedded: EmbeddedNats | None = None
    servers = settings.nats_servers
    if not servers:
        embedded = EmbeddedNats(settings.data_dir / "nats", max_payload=settings.max_payload_bytes)
        servers = [await asyncio.to_thread(embedded.start)]
    try:
        database_url = settings.resolved_database_url()
        await asyncio.to_thread(upgrade, database_url)
        bus = await Bus.connect(settings, name="switchyard-up", servers=servers)
        try:
            await bus.ensure_streams()
            await bus.ensure_kv(bus.subjects.router_bucket)
            yield Infrastructure(servers[0], database_url, bus, embedded)
        finally:
            await bus.close()
    finally:
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)


def _describe(infra: Infrastructure, settings: SwitchyardSettings) -> Table:
    table = Table(title="Switchyard control plane", show_header=False)
    nats_kind = "embedded" if infra.embedded_nats else "external"
    table.add_row("NATS", f"{infra.nats_url} ({nats_kind})")
    if infra.embedded_nats:
        table.add_row("JetStream store", str(infra.embedded_nats.store_dir.resolve()))
    db_kind = "SQLite" if infra.database_url.startswith("sqlite") else "PostgreSQL"
    shown = infra.database_url if db_kind == "SQLite" else infra.database_url.split("@")[-1]
    table.add_row("database", f"{shown} ({db_kind}, schema at head)")
    subjects = settings.subjects
    table.add_row(
        "subjects",
        f"{subjects.prefix}.engine.<id>.{{hello,telemetry,expert_load,migrate}}, "
        f"{subjects.route_decode}, {subjects.route_dp}, {subjects.placement_plan}",
    )
    table.add_row("streams", ", ".join(subjects.streams()))
    table.add_row("KV bucket", subjects.router_bucket)
    return table


async def run_up(settings: SwitchyardSettings, duration: float | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with infrastructure(settings) as infra:
            console.print(_describe(infra, settings))
            console.print("[green]up[/green] - Ctrl-C to stop")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=duration)
            console.print("stopping...")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    console.print("[green]stopped cleanly[/green]")
