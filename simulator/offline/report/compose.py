"""`build_report`: the header, the asked sections in order (one module each), the closing notes and the files."""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from switchyard.simulator.core.workload import load_requests
from switchyard.simulator.offline.metrics import SUMMARY_KEYS
from switchyard.simulator.offline.report.options import SECTIONS, ReportOptions
from switchyard.simulator.offline.report.runner import ReportContext, Runner
from switchyard.simulator.offline.scenario import prepare

__all__ = ["build_report"]

#: A section: what it adds to `results.json` (under its name) and its Markdown.
SectionBuilder = Callable[[ReportContext], tuple[Any, list[str]]]


def _builders() -> dict[str, SectionBuilder]:
    """Each section's `build`, by name. Imported here: the sections load matplotlib, options do not."""
    import matplotlib

    matplotlib.use("Agg")
    from switchyard.simulator.offline.report.bracket import build as bracket
    from switchyard.simulator.offline.report.fig2 import build as fig2
    from switchyard.simulator.offline.report.fig4 import build as fig4
    from switchyard.simulator.offline.report.fig11 import build as fig11
    from switchyard.simulator.offline.report.fig15 import build as fig15
    from switchyard.simulator.offline.report.fig16 import build as fig16
    from switchyard.simulator.offline.report.gimbal_seed import build as gimbal
    from switchyard.simulator.offline.report.table2 import build as table2

    builders: dict[str, SectionBuilder] = {
        "fig2": fig2,
        "fig4": fig4,
        "fig11": fig11,
        "fig15": fig15,
        "fig16": fig16,
        "table2": table2,
        "bracket": bracket,
        "gimbal": gimbal,
    }
    assert tuple(builders) == SECTIONS
    return builders


def build_report(out_dir: Path, opts: ReportOptions) -> Path:
    """Run every asked experiment and write `report.md`, PNGs, `results.json` and `runs.csv` into `out_dir`."""
    builders = _builders()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        if opts.progress:
            print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    sc = prepare(opts.trace, gpu=opts.gpu, seed=opts.seed)
    ctx = ReportContext(opts, sc, Runner(sc, load_requests(opts.requests), opts), out_dir, log)
    results: dict[str, object] = {}
    md = _header(ctx)
    for name in SECTIONS:  # in the report's order, whatever the order asked
        if name in opts.sections:
            results[name], lines = builders[name](ctx)
            md += lines
    results["meta"], lines = _closing(ctx, t_start)
    md += lines
    _write(out_dir, md, results, ctx.runner.rows)
    log(f"done: {out_dir / 'report.md'}")
    return out_dir / "report.md"


def _header(ctx: ReportContext) -> list[str]:
    opts, sc, model = ctx.opts, ctx.sc, ctx.model
    return [
        "# ELDR experiments, simulated" + (" (quick)" if opts.quick else ""),
        "",
        f"Routing: the real ESFT trace of **{model}** ({sc.trace.num_layers} MoE layers × {sc.trace.num_experts} "
        f"experts, top-{sc.trace.top_k}; {sc.counts.num_requests} sequences split per task into "
        f"{len(sc.calib)} calibration (ELDR fit) and {len(sc.replay)} replayed requests, disjoint). "
        f"Arrivals and prompt/output lengths: the first {opts.n} requests of `{Path(opts.requests).name}` "
        f"(Azure LLM inference trace 2023), time compressed to each target rate. Physics: {model} on one "
        f"{ctx.gpu} per engine (`docs/simulator.md`). Seed {opts.seed}. Seed numbers are the ELDR paper's "
        "(Qwen3-30B-A3B, GPT-OSS, Gemma on MI300X); ours are measured on a different model and trace, "
        "so compare directions and rough sizes, not digits.",
        "",
    ]


def _closing(ctx: ReportContext, t_start: float) -> tuple[dict[str, object], list[str]]:
    """`results.json`'s `meta` and the "How this was made" section (`t_start`: when the report began)."""
    opts, runner = ctx.opts, ctx.runner
    balanced_art: Any  # the balanced ELDR artifact at 16 decoders, the report's reference fit
    balanced_art, _ = ctx.sc.eldr_inputs("balanced", 16)
    elapsed = time.perf_counter() - t_start
    meta = {
        "quick": opts.quick,
        "num_requests": opts.n,
        "gpu": ctx.gpu,
        "model": ctx.model,
        "seed": opts.seed,
        "runs": len(runner.rows),
        "elapsed_s": elapsed,
        "eldr_rho": float(balanced_art.rho),
    }
    md = [
        "## How this was made",
        "",
        f"`switchyard report{' --quick' if opts.quick else ''} --gpu {opts.gpu} --seed {opts.seed}"
        + (f" --sections {','.join(opts.sections)}" if opts.sections != SECTIONS else "")
        + (f" --num-requests {opts.num_requests}" if opts.num_requests else "")
        + f"`: {len(runner.rows)} simulations of {opts.n} requests each, {elapsed:.0f} s on one core. "
        f"ELDR artifact: ρ = {float(balanced_art.rho):.3f} on the calibration split "
        f"(representation {balanced_art.representation}, {len(balanced_art.layer_mask)} masked layers). "
        "Every run's summary is in `runs.csv`, every number above in `results.json`.",
        "",
    ]
    return meta, md


def _write(out_dir: Path, md: list[str], results: dict[str, object], rows: list[dict[str, object]]) -> None:
    (out_dir / "report.md").write_text("\n".join(md))
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    keys = ["policy", "fleet", "rate", "decoders", "tau", "step_overhead_ms", "a2a", "expert_share", *SUMMARY_KEYS]
    keys.append("wall_s")
    with (out_dir / "runs.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
