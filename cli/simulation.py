"""The simulation and report commands: offline xPyD and data-parallel fleets replaying real traces (`sim`,
`sim-dp`), the ELDR experiments (`report`), and a live simulated fleet on the bus with its load (`fleet`,
`loadgen`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from switchyard import data as shipped
from switchyard.cli.options import (
    DataDir,
    NatsUrl,
    RateOption,
    RequestsOption,
    TimeScaleOption,
    load_settings,
    split_csv,
)
from switchyard.simulator.core.defaults import (
    DECODE_MAX_RUNNING,
    DP_MAX_RUNNING,
    INFLIGHT_GRACE_S,
    TOKEN_BUDGET,
)

if TYPE_CHECKING:
    from switchyard.engine_agents.sim.live.fleet_types import LiveFleetConfig


def sim(
    trace: Annotated[
        Path | None,
        typer.Option("--trace", help="Routing trace: the ESFT folder/npz or a Switchyard npz (default: shipped ESFT)."),
    ] = None,
    fmt: Annotated[str, typer.Option("--format", help="auto | esft | npz")] = "auto",
    requests: RequestsOption = None,
    time_scale: TimeScaleOption = 1.0,
    rate: RateOption = None,
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
    prefix_caching: Annotated[
        bool, typer.Option(help="vLLM's prefix caching on the prefill engines (JSONL traces with hash_ids).")
    ] = True,
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
        policies=tuple(split_csv(policies) or ()),
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
        prefix_caching=prefix_caching,
    )
    try:
        payload = run_sim(opts, json_path=json_out, out_dir=out)
    except (ValueError, KeyError) as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(json.dumps(payload["config"]))
    for line in _sim_table(payload["policies"]):  # type: ignore[arg-type]
        typer.echo(line)


def _print_progress(done: int, total: int, label: str, wall_s: float) -> None:
    """One line per finished run on stderr (stdout keeps the results), so a long grid is never silent."""
    typer.echo(f"[{done}/{total}] {label} simulated in {wall_s:.1f} s", err=True)


#: `sim`'s table: (column, key, scale, format); latencies in ms, throughput in tokens/s.
_SIM_COLUMNS = (
    ("TPOT p50 ms", "tpot_p50", 1e3, ".2f"),
    ("TPOT p99 ms", "tpot_p99", 1e3, ".2f"),
    ("TTFT p50 ms", "ttft_p50", 1e3, ".1f"),
    ("tok/s", "throughput", 1.0, ".0f"),
    ("experts/step", "mean_distinct_experts", 1.0, ".1f"),
    ("prefix hit", "prefix_hit_rate", 1.0, ".3f"),
)


def _sim_table(policies: dict[str, dict[str, float]]) -> list[str]:
    """One line per policy with units in the header and a precision each figure can bear."""
    head = f"{'policy':14s} " + " ".join(f"{name:>13s}" for name, *_ in _SIM_COLUMNS)
    rows = [
        f"{policy:14s} " + " ".join(f"{s[key] * scale:>13{fmt}}" for _, key, scale, fmt in _SIM_COLUMNS)
        for policy, s in policies.items()
    ]
    return [head, *rows]


def _name_weights(value: str | None) -> tuple[tuple[str, float], ...]:
    """``name=weight,name=weight`` as pairs (a bad entry is a usage error)."""
    pairs = []
    for item in split_csv(value) or ():
        name, sep, weight = item.partition("=")
        try:
            pairs.append((name.strip(), float(weight)))
        except ValueError:
            raise typer.BadParameter(f"{item!r} is not name=weight") from None
        if not sep or not name.strip():
            raise typer.BadParameter(f"{item!r} is not name=weight")
    return tuple(pairs)


def sim_dp(
    requests: RequestsOption = None,
    time_scale: TimeScaleOption = 1.0,
    rate: RateOption = None,
    start: Annotated[int, typer.Option("--start", help="First CSV request to replay (another stretch).")] = 0,
    engines: Annotated[int, typer.Option("--engines", min=1, help="DP engines.")] = 2,
    tp: Annotated[int, typer.Option("--tp", min=1, help="GPUs per DP engine (tensor parallel).")] = 2,
    coupled: Annotated[
        bool, typer.Option("--coupled/--independent", help="Experts over all engines, lock-step (vLLM DP+EP).")
    ] = True,
    dispatch: Annotated[
        str,
        typer.Option(
            "--dispatch",
            help="Comma-separated DP profiles: rr, jsq, vllm, vllm-main, gimbal, llm-d, dynamo, sglang-cache, "
            "switchyard, gimbal-exact, switchyard-exact.",
        ),
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
    prefix_caching: Annotated[
        bool, typer.Option(help="vLLM's automatic prefix caching (acts on JSONL traces with hash_ids).")
    ] = True,
    prefix_index: Annotated[
        str,
        typer.Option(
            "--prefix-index",
            help="Where prefix-aware profiles learn what each engine caches: precise (the engines' KV events) "
            "or approximate (what was routed where, with expiry).",
        ),
    ] = "precise",
    borrow_routing: Annotated[
        bool,
        typer.Option(help="Run --model on the routing trace's shape with the model's totals (docs/gimbal-seed.md)."),
    ] = False,
    placement: Annotated[
        str | None,
        typer.Option(
            "--placement",
            help="Comma-separated expert placements over the EP ranks (none, eplb, gimbal; variants and controls: "
            "gimbal-staged, gimbal-uncalibrated, gimbal-load-only, gimbal-queue-blind): each run prices "
            "experts under the layout in force and the all-to-all (keys dispatch+order+placement). "
            "Default: off (the even-spread MoE model).",
        ),
    ] = None,
    ep_ranks_per_node: Annotated[
        int, typer.Option("--ep-ranks-per-node", min=1, help="GPUs per NVLink node (with --placement).")
    ] = 8,
    affinity_control: Annotated[
        str,
        typer.Option(
            "--affinity-control",
            help="Expert-affinity dispatch's control (gimbal-affinity): none, or shuffled (each request's "
            "recorded signature replaced by another request's; docs/expert-affinity.md).",
        ),
    ] = "none",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the summary JSON here.")] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Folder for the figures (TTFT/TPOT CDFs, per-engine shares) and summary.json."),
    ] = None,
    progress: Annotated[bool, typer.Option(help="A line on stderr as each run finishes.")] = True,
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
        dispatch=tuple(split_csv(dispatch) or ()),
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
        prefix_caching=prefix_caching,
        prefix_index=prefix_index,
        borrow_routing=borrow_routing,
        placements=tuple(split_csv(placement) or ()),
        ep_ranks_per_node=ep_ranks_per_node,
        affinity_control=affinity_control,
    )
    try:
        payload = run_sim_dp(opts, json_path=json_out, on_run=_print_progress if progress else None, out_dir=out)
    except (ValueError, KeyError) as exc:
        raise typer.BadParameter(str(exc)) from None
    ms = ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99")
    typer.echo(json.dumps(payload["config"]))
    head = " ".join(f"{k + ' ms':>14s}" for k in ms)
    typer.echo(f"{'dispatch+order':20s} {head} {'tok/s':>10s} {'gap tok/s':>10s} {'prefix hit':>10s}")
    for name, s in payload["runs"].items():  # type: ignore[union-attr]
        cells = " ".join(f"{s[k] * 1e3:14.2f}" for k in ms)
        hit = f"{s['prefix_hit_rate']:10.3f}"
        typer.echo(f"{name:20s} {cells} {s['throughput']:10.0f} {s['prompt_tput_gap']:10.0f} {hit}")


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
            help="Comma-separated sections to run: fig2, fig4, fig11, fig15, fig16, table2, bracket, gimbal "
            "(default: all).",
        ),
    ] = None,
    gimbal_results: Annotated[
        Path | None,
        typer.Option("--gimbal-results", help="Runs of bench/gimbal_seed.py (default: docs/results/gimbal_seed)."),
    ] = None,
) -> None:
    """Regenerate the ELDR experiments as Markdown + PNG (figures 2, 4, 11, 15, 16, table 2, the cost-term bracket)."""
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
        gimbal_results=gimbal_results,
    )
    path = build_report(out or settings.data_dir / "report", opts)
    typer.echo(f"report written to {path}")


FleetName = Annotated[str, typer.Option(help="Engine id prefix of the simulated fleet.")]
TracePath = Annotated[Path | None, typer.Option(help="Routing trace (default: the shipped ESFT trace).")]


def _fleet_config(
    name: str, prefill: int, decode: int, gpus_per_decoder: int, gpu: str, speed: float, **http: object
) -> LiveFleetConfig:
    from switchyard.engine_agents.sim.live.fleet_types import LiveFleetConfig

    return LiveFleetConfig(
        prefill=prefill, decode=decode, gpus_per_decoder=gpus_per_decoder, gpu=gpu, speed=speed, name=name, **http
    )  # type: ignore[arg-type]


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
    requests: Annotated[
        Path | None, typer.Option(help="Request trace: Azure-format CSV or JSONL (hash_ids: prefix caching).")
    ] = None,
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
