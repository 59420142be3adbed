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


def _split_csv(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


@app.command()
def fit(
    trace: Annotated[Path, typer.Option("--trace", help="Routing trace: an .npz file or the ESFT folder.")],
    decoders: Annotated[int, typer.Option("--decoders", "-k", help="Decode engines: one centroid each.", min=1)],
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
    tau: Annotated[float, typer.Option(help="Similarity band of the online router.")] = 0.1,
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
    """Fit the ELDR routing artifact (layer mask, IDF, one centroid per decoder) from a routing trace."""
    import json

    from solver.eldr_fit import FitError, FitOptions, fit_routing_artifact
    from solver.traces import TraceError, load_trace

    try:
        options = FitOptions(
            tau=tau,
            representation=representation,  # type: ignore[arg-type]
            layer_mask=tuple(int(v) for v in _split_csv(layers) or []) or None,
            mask_tolerance=mask_tolerance,
            max_pairs=max_pairs,
            holdout_fraction=holdout,
            restarts=restarts,
            seed=seed,
            compare_vanilla=vanilla,
        )
        loaded = load_trace(trace, fmt, prefill_fraction=prefill_fraction, window=window)  # type: ignore[arg-type]
        artifact, report = fit_routing_artifact(loaded, decoders, options, decoder_ids=_split_csv(decoder_ids))
    except (TraceError, FitError, ValueError) as exc:
        typer.echo(f"switchyard fit: {exc}", err=True)
        raise typer.Exit(2) from None
    if out is not None or database_url is not None or nats_url is not None:
        from sqlalchemy.exc import SQLAlchemyError

        from services.artifacts import publish_to

        settings = load_settings(database_url=database_url)
        try:
            artifact = asyncio.run(
                publish_to(
                    artifact, report, settings, out=out, database_url=database_url, nats_servers=_split_csv(nats_url)
                )
            )
        except (OSError, SQLAlchemyError, ValueError) as exc:  # ConnectionError is an OSError
            typer.echo(f"switchyard fit: could not store the artifact: {exc}", err=True)
            raise typer.Exit(1) from None
    report.update(version=artifact.version, out=str(out) if out else None, trace=str(trace))
    if as_json:
        typer.echo(json.dumps(report, allow_nan=False))
        return
    typer.echo(f"trace {trace}: {report['num_requests']} requests ({report['dropped_requests']} dropped)")
    typer.echo("ρ by representation: " + ", ".join(f"{k} {v:.4f}" for k, v in report["rho"].items() if v is not None))
    typer.echo(f"chose {report['representation']}, layers {report['layer_mask']}: ρ {report['rho_selected']:.4f}")
    typer.echo(f"cluster sizes {report['cluster_sizes']} (capacity {report['capacity']})")
    typer.echo(f"artifact v{artifact.version} {artifact.content_hash[:16]} in {report['fit_seconds']:.2f} s")


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
