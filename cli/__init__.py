"""The `switchyard` command line. Each command imports its module lazily so `--help` stays instant.

This module is the command table: the app, its commands in the order `switchyard --help` lists them, and `main`
(the console script). The commands live by family:

- `options`: the options several commands share (NATS, database, state folder) and `load_settings`
- `services`: `up`, `migration`, `placement`, `api`, `router`, `gateway`, `epp`
- `fitting`: `fit`, `calibrate`
- `simulation`: `sim`, `sim-dp`, `report`, `fleet`, `loadgen`
- `placement_export`: `placement-export` (a recorded placement as vLLM's initial expert map)
- `admin`: `db upgrade`, `db downgrade`, `nats-config`, `asyncapi`, `settings`
"""

from __future__ import annotations

import typer

from switchyard.cli.admin import asyncapi, db_downgrade, db_upgrade, nats_config, settings
from switchyard.cli.fitting import calibrate, fit
from switchyard.cli.placement_export import placement_export
from switchyard.cli.services import api, epp, gateway, migration, placement, router, up
from switchyard.cli.simulation import fleet, loadgen, report, sim, sim_dp

app = typer.Typer(
    name="switchyard",
    help="Expert-aware control plane for Mixture-of-Experts LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command's context
)


def _print_version(value: bool) -> None:
    """`switchyard --version`: the installed package's version, as `vllm --version` prints its own."""
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("switchyard")
        except PackageNotFoundError:  # run from a checkout that was never installed
            installed = "unknown (not installed)"
        typer.echo(f"switchyard {installed}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", "-V", help="Print the version and exit.", callback=_print_version, is_eager=True
    ),
) -> None:
    """Expert-aware control plane for Mixture-of-Experts LLM serving."""


app.command()(up)
app.command()(migration)
app.command()(placement)
app.command("placement-export")(placement_export)
app.command()(api)
app.command()(fit)
app.command()(router)
app.command()(gateway)
app.command()(epp)
app.command("nats-config")(nats_config)
app.command()(asyncapi)
app.command()(settings)
app.command()(fleet)
app.command()(loadgen)
app.command()(calibrate)
app.command()(sim)
app.command("sim-dp")(sim_dp)
app.command()(report)

db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)
db_app.command("upgrade")(db_upgrade)
db_app.command("downgrade")(db_downgrade)
app.add_typer(db_app, name="db")

__all__ = ["app", "main"]


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
        from switchyard.cli.errors import user_error_message

        message = user_error_message(exc)
        if message is None:
            raise
        command = " ".join(["switchyard", *[a for a in sys.argv[1:3] if not a.startswith("-")]][:3])
        click.echo(f"{command}: error: {message}", err=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)
