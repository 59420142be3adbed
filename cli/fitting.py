"""The fit and calibration commands: the ELDR routing artifact from a trace or the fleet's routing samples
(`fit`), and the greedy placement's (alpha, beta, gamma) from offline MINLP solutions (`calibrate`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from switchyard import data as shipped
from switchyard.cli.options import DatabaseUrl, DataDir, load_settings, split_csv
from switchyard.shared import placement_terms

if TYPE_CHECKING:
    from switchyard.shared.settings import SwitchyardSettings
    from switchyard.solver.signatures import RequestCounts


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
            layer_mask=tuple(int(v) for v in split_csv(layers) or []) or None,
            mask_tolerance=mask_tolerance,
            max_pairs=max_pairs,
            holdout_fraction=holdout,
            restarts=restarts,
            seed=seed,
            compare_vanilla=vanilla,
        )
        if trace is not None and from_stream:
            raise ValueError("give either --trace PATH or --from-stream, not both")
        ids = split_csv(decoder_ids)
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
                    artifact, report, settings, out=out, database_url=database_url, nats_servers=split_csv(nats_url)
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
    if out is None and database_url is None and nats_url is None:
        typer.echo("nothing written: pass --out FILE, --database-url or --nats-url to keep the artifact")


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


def calibrate(
    windows: Annotated[
        list[Path] | None,
        typer.Option(
            "--windows",
            help="Recorded windows: .npz / .msgpack files, or folders of SGLang expert-statistics JSONs. "
            "Default: the SGLang DeepSeek-V3 statistics shipped in the package (switchyard/data).",
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
            on_solve=lambda done, total: typer.echo(f"[{done}/{total}] MINLP solves done", err=True),
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
