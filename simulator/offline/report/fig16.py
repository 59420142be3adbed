"""Fig. 16: the τ sweep of ELDR's band at the middle rate, 8P16D, against round robin."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from switchyard.simulator.offline.plots import save
from switchyard.simulator.offline.report.options import SEED
from switchyard.simulator.offline.report.runner import ReportContext, pct

__all__ = ["build"]


def build(ctx: ReportContext) -> tuple[dict[str, object], list[str]]:
    """The section's results and Markdown; writes `fig16_tau.png`."""
    ctx.log("Fig. 16: τ sweep")
    opts, runner = ctx.opts, ctx.runner
    rate = opts.mid_rate
    rr = runner.run(16, rate, "rr")
    fig16 = []
    for tau in opts.taus:
        s = runner.run(16, rate, "eldr", tau=tau)
        fig16.append(
            {
                "tau": tau,
                "p50_pct": pct(float(s["tpot_p50"]), float(rr["tpot_p50"])),
                "p99_pct": pct(float(s["tpot_p99"]), float(rr["tpot_p99"])),
                "band": float(s["mean_band_size"]),
                "load_cov": float(s["load_cov"]),
            }
        )
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    xs = np.arange(len(fig16))  # τ values are uneven: plot them evenly spaced, labelled
    ax.plot(xs, [r["p50_pct"] for r in fig16], marker="o", label="P50")
    ax.plot(xs, [r["p99_pct"] for r in fig16], marker="o", label="P99")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(xs, [f"{r['tau']:g}" for r in fig16])
    ax.set(xlabel="τ", ylabel="Δ TPOT vs RR (%)", title=f"Fig. 16 analogue: τ sweep at {rate:g} req/s, 8P16D")
    ax.legend()
    save(fig, ctx.out_dir / "fig16_tau.png")
    md = [
        "## Fig. 16 — τ sweep",
        "",
        f"Seed: {SEED['fig16']}.",
        "",
        f"Simulated at {rate:g} req/s, 8P16D (Δ vs RR; band = mean decoders in the band; load CoV = spread of "
        "tokens across decoders):",
        "",
        "| τ | Δ P50 | Δ P99 | band | load CoV |",
        "|---|---|---|---|---|",
        *(
            f"| {r['tau']:g} | {r['p50_pct']:+.1f} % | {r['p99_pct']:+.1f} % | {r['band']:.1f} | {r['load_cov']:.3f} |"
            for r in fig16
        ),
        "",
        "![Fig. 16](fig16_tau.png)",
        "",
    ]
    return {"rate": rate, "rows": fig16}, md
