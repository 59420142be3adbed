"""Table 2: ELDR's median-TPOT gain over the best load balancer as the decoder pool grows (8P8D, 8P16D, …)."""

from __future__ import annotations

from switchyard.simulator.offline.report.options import LOAD_BALANCERS, SEED
from switchyard.simulator.offline.report.runner import ReportContext, best_lb, pct

__all__ = ["build"]


def build(ctx: ReportContext) -> tuple[list[dict[str, object]], list[str]]:
    """The section's results and Markdown (no figure)."""
    ctx.log("Table 2: decoder pool size")
    opts, runner = ctx.opts, ctx.runner
    table2 = []
    per_decoder = opts.mid_rate / 16
    for d in opts.decoders:
        r = per_decoder * d
        eldr = runner.run(d, r, "eldr")
        best, v = best_lb(runner, d, r, "tpot_p50")
        table2.append(
            {
                "fleet": f"8P{d}D",
                "rate": r,
                "eldr_gain_pct": -pct(float(eldr["tpot_p50"]), v),
                "best_lb": best,
                "eldr_tpot_p50_ms": float(eldr["tpot_p50"]) * 1e3,
                "best_tpot_p50_ms": v * 1e3,
            }
        )
        ctx.log(f"  8P{d}D done")
    md = [
        "## Table 2 — decoder pool size",
        "",
        f"Seed: {SEED['table2']}.",
        "",
        f"Simulated at a constant {per_decoder:g} req/s per decoder (median TPOT reduction of ELDR vs the best of "
        f"{', '.join(LOAD_BALANCERS)}):",
        "",
        "| fleet | rate | ELDR P50 (ms) | best LB P50 (ms) | ELDR gain |",
        "|---|---|---|---|---|",
        *(
            f"| {t['fleet']} | {t['rate']:g} | {t['eldr_tpot_p50_ms']:.2f} | {t['best_tpot_p50_ms']:.2f} "
            f"({t['best_lb']}) | **{t['eldr_gain_pct']:.1f} %** |"
            for t in table2
        ),
        "",
    ]
    return table2, md
