"""Fig. 11: TPOT (median, p99) and median TTFT vs request rate, every decode policy, 8P16D."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter

from switchyard.simulator.offline.plots import save
from switchyard.simulator.offline.report.options import LOAD_BALANCERS, SEED
from switchyard.simulator.offline.report.runner import ReportContext, Runner, best_lb, pct
from switchyard.solver.routing import DECODE_POLICIES

__all__ = ["build"]


def build(ctx: ReportContext) -> tuple[list[dict[str, Any]], list[str]]:
    """The section's results and Markdown; writes `fig11_rate_sweep.png`."""
    ctx.log("Fig. 11: rate sweep at 8P16D")
    opts, runner = ctx.opts, ctx.runner
    for rate in opts.sweep:
        for policy in opts.policies:
            runner.run(16, rate, policy)
            ctx.log(f"  rate {rate:g} {policy}")
    _plot(ctx)
    fig11 = [_row(runner, rate) for rate in opts.sweep]
    return fig11, _markdown(ctx, fig11)


def _plot(ctx: ReportContext) -> None:
    opts, runner = ctx.opts, ctx.runner
    metrics = [("tpot_p50", "median TPOT (ms)"), ("tpot_p99", "p99 TPOT (ms)"), ("ttft_p50", "median TTFT (ms)")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for policy in opts.policies:
            ys = [float(runner.run(16, r, policy)[key]) * 1e3 for r in opts.sweep]
            style = "-" if DECODE_POLICIES[policy].needs & {"similarity", "label"} else "--"
            studied = policy == "eldr"  # the policy under study, drawn over the others
            ax.plot(
                opts.sweep,
                ys,
                style,
                marker="o",
                ms=4 if studied else 3,
                lw=2.5 if studied else 1.0,
                zorder=3 if studied else 2,
                label=policy,
            )
        ax.set(xlabel="request rate (req/s)", title=title, xscale="log")
        # One plain label per swept rate: the log axis's own minor labels (2x10^2, 3x10^2, ...) overlap.
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(list(opts.sweep), [f"{r:g}" for r in opts.sweep])
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Fig. 11 analogue: {ctx.model} on {ctx.gpu}, 8P16D, ESFT routing, Azure conv arrivals", fontsize=9)
    save(fig, ctx.out_dir / "fig11_rate_sweep.png")


def _row(runner: Runner, rate: float) -> dict[str, Any]:
    """ELDR and Domain against the best load balancer at one rate."""
    eldr = runner.run(16, rate, "eldr")
    best50, v50 = best_lb(runner, 16, rate, "tpot_p50")
    best99, v99 = best_lb(runner, 16, rate, "tpot_p99")
    dom = runner.run(16, rate, "domain")
    return {
        "rate": rate,
        "offered_rate": float(eldr["offered_rate"]),
        "eldr_vs_best_p50_pct": pct(float(eldr["tpot_p50"]), v50),
        "best_p50": best50,
        "eldr_vs_best_p99_pct": pct(float(eldr["tpot_p99"]), v99),
        "best_p99": best99,
        "domain_vs_best_p50_pct": pct(float(dom["tpot_p50"]), v50),
        "eldr_distinct": float(eldr["token_distinct_experts"]),
        "best_distinct": float(runner.run(16, rate, best50)["token_distinct_experts"]),
        "mean_batch": float(eldr["mean_batch"]),
    }


def _markdown(ctx: ReportContext, fig11: list[dict[str, Any]]) -> list[str]:
    opts, runner = ctx.opts, ctx.runner
    p50s = [r["eldr_vs_best_p50_pct"] for r in fig11]
    p99s = [r["eldr_vs_best_p99_pct"] for r in fig11]
    return [
        "## Fig. 11 — TPOT (median, p99) and median TTFT vs rate, every policy, 8P16D",
        "",
        f"Seed: {SEED['fig11']}.",
        "",
        "Rates: the seed's 20–100 req/s would leave this simulated fleet nearly idle (DeepSeek-V2-Lite has 2.4 B "
        "active parameters against Qwen3-30B-A3B's 3.3 B, and the physics runs at datasheet bandwidth with no "
        "CPU overhead), so the sweep spans this fleet's own range, from decode batches of a few requests to "
        "near prefill saturation; `mean batch` below shows where each rate sits.",
        "",
        f"Simulated: ELDR median TPOT **{min(p50s):+.1f} … {max(p50s):+.1f} %** vs the best of "
        f"{', '.join(LOAD_BALANCERS)} at each rate; p99 {min(p99s):+.1f} … {max(p99s):+.1f} %.",
        "",
        "| target rate | offered | mean batch | ELDR Δ P50 vs best LB | ELDR Δ P99 vs best LB | Domain Δ P50 "
        "| distinct experts/token ELDR vs best LB |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['rate']:g} | {r['offered_rate']:.1f} | {r['mean_batch']:.1f} | "
            f"{r['eldr_vs_best_p50_pct']:+.1f} % "
            f"({r['best_p50']}) | {r['eldr_vs_best_p99_pct']:+.1f} % ({r['best_p99']}) | "
            f"{r['domain_vs_best_p50_pct']:+.1f} % | {r['eldr_distinct']:.1f} vs {r['best_distinct']:.1f} |"
            for r in fig11
        ),
        "",
        "Absolute values (ms) per policy and rate:",
        "",
        "| policy | " + " | ".join(f"{r:g} req/s P50 / P99 / TTFT" for r in opts.sweep) + " |",
        "|---" * (len(opts.sweep) + 1) + "|",
        *(
            f"| {p} | "
            + " | ".join(
                "{:.2f} / {:.2f} / {:.1f}".format(
                    *(float(runner.run(16, r, p)[k]) * 1e3 for k in ("tpot_p50", "tpot_p99", "ttft_p50"))
                )
                for r in opts.sweep
            )
            + " |"
            for p in opts.policies
        ),
        "",
        "![Fig. 11](fig11_rate_sweep.png)",
        "",
    ]
