"""The `switchyard` command line. Each command imports its module lazily so `--help` stays instant."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="switchyard",
    help="Expert-aware control plane for Mixture-of-Experts LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
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
    from shared.settings import SwitchyardSettings

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
    duration: Annotated[float | None, typer.Option(help="Stop after this many seconds.")] = None,
) -> None:
    """Run the control plane (embedded NATS + SQLite unless told otherwise) until Ctrl-C."""
    from services.up import run_up

    asyncio.run(run_up(load_settings(nats_url, database_url, data_dir), duration=duration))


@app.command()
def migration(nats_url: NatsUrl = None, database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Run the migration service: placement plans in, ordered expert moves out, until Ctrl-C / SIGTERM."""
    from services.migration.service import run_migration
    from services.runtime import run_until_signalled

    settings = load_settings(nats_url, database_url, data_dir)
    run_until_signalled(lambda stop: run_migration(settings, stop))


@app.command()
def placement(nats_url: NatsUrl = None, database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Run the placement service: expert-load windows in, versioned placement plans out, until Ctrl-C / SIGTERM."""
    from services.placement.service import run_placement
    from services.runtime import run_until_signalled

    settings = load_settings(nats_url, database_url, data_dir)
    run_until_signalled(lambda stop: run_placement(settings, stop))


@db_app.command("upgrade")
def db_upgrade(database_url: DatabaseUrl = None, revision: str = "head") -> None:
    """Apply schema migrations up to REVISION (default head)."""
    from shared.db.engine import current_revision, upgrade

    url = load_settings(database_url=database_url).resolved_database_url()
    upgrade(url, revision)
    typer.echo(f"schema at {current_revision(url)}")


@db_app.command("downgrade")
def db_downgrade(revision: str, database_url: DatabaseUrl = None) -> None:
    """Revert schema migrations down to REVISION ('base' drops every table)."""
    from shared.db.engine import current_revision, downgrade

    url = load_settings(database_url=database_url).resolved_database_url()
    downgrade(url, revision)
    typer.echo(f"schema at {current_revision(url)}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
