"""The options several commands share, declared once, and the settings they resolve to.

`--nats-url`, `--database-url` and `--data-dir` mean the same in every command that takes them. `load_settings`
lays them over the environment's settings (SWITCHYARD_*, which also name the NATS credentials file and the log
level) and sets up logging; every command runs with what it returns.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from switchyard.shared.settings import SwitchyardSettings

#: For `up`, the one command that starts a bus of its own when given none.
EmbeddedNatsUrl = Annotated[
    str | None,
    typer.Option("--nats-url", help="External NATS server(s), comma-separated; default: start an embedded one."),
]
#: For every command that joins a running bus (it starts none).
NatsUrl = Annotated[
    str | None,
    typer.Option(
        "--nats-url", help="NATS server(s), comma-separated (required unless SWITCHYARD_NATS_SERVERS names them)."
    ),
]
DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", help="postgresql://... or sqlite:///path; default: SQLite under --data-dir."),
]
DataDir = Annotated[Path | None, typer.Option("--data-dir", help="State folder (default .switchyard).")]
#: The request trace of `sim` and `sim-dp`.
RequestsOption = Annotated[
    Path | None,
    typer.Option("--requests", help="Request trace: Azure-style CSV, or JSONL (with hash_ids: prefix caching)."),
]
TimeScaleOption = Annotated[float, typer.Option("--time-scale", help="Divide the CSV's arrival times by this.")]
RateOption = Annotated[
    float | None, typer.Option("--rate", help="Poisson arrivals at this rate (req/s); with --requests: its lengths.")
]


def load_settings(
    nats_url: str | None = None,
    database_url: str | None = None,
    data_dir: Path | None = None,
    *,
    needs_bus: bool = False,
) -> SwitchyardSettings:
    """Environment settings, overridden by command-line options. `needs_bus`: the command joins a running bus, so
    a missing server is refused here, before the command touches a database or a port (one line, exit 2)."""
    from switchyard.shared.errors import ConfigError
    from switchyard.shared.settings import SwitchyardSettings

    overrides: dict[str, object] = {}
    if nats_url:
        overrides["nats_servers"] = nats_url
    if database_url:
        overrides["database_url"] = database_url
    if data_dir:
        overrides["data_dir"] = data_dir
    settings = SwitchyardSettings(**overrides)
    if needs_bus and not settings.nats_servers:
        raise ConfigError("no NATS server configured: set SWITCHYARD_NATS_SERVERS or pass --nats-url")
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # schema upgrades say what they did at debug only
        logging.getLogger("alembic").setLevel(logging.WARNING)
    return settings


def split_csv(value: str | None) -> list[str] | None:
    """A comma-separated option as its non-empty items (None when not given)."""
    return [v.strip() for v in value.split(",") if v.strip()] if value else None
