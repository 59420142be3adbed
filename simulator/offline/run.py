"""`switchyard sim`: one workload through one xPyD fleet under each of several decode policies."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from switchyard.shared.trace_files import TraceFormat
from switchyard.simulator.core.defaults import DECODE_MAX_RUNNING
from switchyard.simulator.core.workload import load_requests
from switchyard.simulator.offline.metrics import SUMMARY_KEYS, summarize, write_csv, write_json
from switchyard.simulator.offline.scenario import prepare
from switchyard.solver.routing import get_policy

__all__ = ["SimOptions", "run_sim"]


@dataclass(frozen=True)
class SimOptions:
    trace: Path
    fmt: TraceFormat = "auto"
    requests: Path | None = None
    time_scale: float = 1.0
    rate: float | None = None
    prefill: int = 8
    decode: int = 16
    policies: tuple[str, ...] = ("rr", "jsq", "eldr")
    num_requests: int = 1000
    seed: int = 0
    gpu: str = "H100"
    gpus: int | None = None
    model: str | None = None
    calib_fraction: float = 0.5
    prefill_fraction: float = 0.5
    max_running: int = DECODE_MAX_RUNNING
    kv_blocks: int | None = None
    prefill_policy: str = "rr"
    progress: bool = True
    prefix_caching: bool = True  # on the prefill engines; acts on traces with hash_ids


def run_sim(opts: SimOptions, json_path: Path | None = None, out_dir: Path | None = None) -> dict[str, object]:
    """Run every policy on the same workload; returns (and writes) {config, policies: {name: summary}}."""
    if opts.requests is None and opts.rate is None:
        raise ValueError("give either --requests TRACE (with --time-scale) or --rate (or both: Poisson, CSV lengths)")
    for name in opts.policies:
        get_policy(name)  # fail before any work on a typo
    sc = prepare(
        opts.trace,
        fmt=opts.fmt,
        model=opts.model,
        gpu=opts.gpu,
        gpus=opts.gpus,
        calib_fraction=opts.calib_fraction,
        prefill_fraction=opts.prefill_fraction,
        seed=opts.seed,
    )
    fleet = sc.fleet(
        opts.prefill,
        opts.decode,
        max_running=opts.max_running,
        kv_blocks=opts.kv_blocks,
        prefill_policy=opts.prefill_policy,
    )
    fleet = dataclasses.replace(fleet, prefix_caching=opts.prefix_caching)
    requests = load_requests(opts.requests) if opts.requests is not None else None
    wl = sc.workload(
        opts.num_requests,
        seed=opts.seed,
        rate=opts.rate,
        requests=requests,
        time_scale=opts.time_scale,
        max_tokens=fleet.decode_kv_blocks * sc.cost.block_size,
    )
    summaries: dict[str, dict[str, object]] = {}
    results = {}
    for name in opts.policies:
        t0 = time.perf_counter()
        res = sc.run(wl, fleet, name, seed=opts.seed, progress=opts.progress)
        summary = summarize(res)
        summary["wall_s"] = time.perf_counter() - t0
        summaries[name] = summary
        results[name] = res
    config = {
        "trace": str(opts.trace),
        "model": sc.model.name,
        "gpu": sc.cost.gpu.name,
        "gpus_per_engine": sc.cost.gpus,
        "fleet": fleet.label,
        "num_requests": opts.num_requests,
        "seed": opts.seed,
        "workload": wl.description,
        "offered_rate": wl.offered_rate,
        "calibration_requests": len(sc.calib),
        "replay_requests": len(sc.replay),
        "kv_blocks_per_decoder": fleet.decode_kv_blocks,
        "max_running": fleet.max_running,
        "prefill_policy": fleet.prefill_policy,
        "prefix_caching": fleet.prefix_caching,
        "prefix_block_tokens": wl.hash_block or None,
        "moe_overhead_us": sc.cost.moe_overhead_s * 1e6,
        "expert_stream_us": sc.cost.b * 1e6,
    }
    payload = {"config": config, "policies": summaries}
    if json_path is not None:
        write_json(json_path, payload)
    if out_dir is not None:
        from switchyard.simulator.offline.plots import plot_runs

        write_json(out_dir / "summary.json", payload)
        write_csv(out_dir / "summary.csv", list(summaries.values()), keys=["policy", "fleet", *SUMMARY_KEYS, "wall_s"])
        plot_runs(results, out_dir, f"{sc.model.name} on {sc.cost.gpu.name}, {fleet.label}, {wl.description}")
    return payload
