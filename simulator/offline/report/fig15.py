"""Fig. 15: balanced vs vanilla K-means (and τ = 0, Domain, JSQ): mean Δ TPOT vs round robin over the sweep."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from switchyard.simulator.offline.plots import save
from switchyard.simulator.offline.report.options import SEED
from switchyard.simulator.offline.report.runner import ReportContext, pct
from switchyard.simulator.offline.scenario import Scenario

__all__ = ["build"]

POLICIES = ("eldr", "eldr-vanilla", "eldr-tau0", "domain", "jsq")


def build(ctx: ReportContext) -> tuple[dict[str, object], list[str]]:
    """The section's results and Markdown; writes `fig15_balance.png`."""
    ctx.log("Fig. 15")
    opts, runner = ctx.opts, ctx.runner
    fig15 = {}
    for policy in POLICIES:
        delta = {
            key: [pct(float(runner.run(16, r, policy)[key]), float(runner.run(16, r, "rr")[key])) for r in opts.sweep]
            for key in ("tpot_p50", "tpot_p99")
        }
        fig15[policy] = {"p50_pct": float(np.mean(delta["tpot_p50"])), "p99_pct": float(np.mean(delta["tpot_p99"]))}
    sizes_bal = _cluster_sizes(ctx.sc, "balanced", 16)
    sizes_van = _cluster_sizes(ctx.sc, "vanilla", 16)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    names15 = list(fig15)
    x = np.arange(len(names15))
    ax.bar(x - 0.2, [fig15[p]["p50_pct"] for p in names15], 0.4, label="P50")
    ax.bar(x + 0.2, [fig15[p]["p99_pct"] for p in names15], 0.4, label="P99")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(x, names15)
    ax.set(ylabel="mean Δ TPOT vs RR (%)", title=f"Fig. 15 analogue: mean over {len(opts.sweep)} rates, 8P16D")
    ax.legend()
    save(fig, ctx.out_dir / "fig15_balance.png")
    results = {"delta_vs_rr": fig15, "cluster_sizes": {"balanced": sizes_bal, "vanilla": sizes_van}}
    md = [
        "## Fig. 15 — balanced vs vanilla K-means",
        "",
        f"Seed: {SEED['fig15']}.",
        "",
        f"Simulated, mean Δ TPOT vs RR over {', '.join(f'{r:g}' for r in opts.sweep)} req/s at 8P16D:",
        "",
        "| policy | Δ P50 | Δ P99 |",
        "|---|---|---|",
        *(f"| {p} | {v['p50_pct']:+.1f} % | {v['p99_pct']:+.1f} % |" for p, v in fig15.items()),
        "",
        f"Calibration requests per centroid — balanced: {sorted(sizes_bal, reverse=True)}; vanilla: "
        f"{sorted(sizes_van, reverse=True)}.",
        "",
        "![Fig. 15](fig15_balance.png)",
        "",
    ]
    return results, md


def _cluster_sizes(sc: Scenario, fit: str, decoders: int) -> list[int]:
    """Calibration requests nearest to each centroid of the `fit` artifact (what K-means balanced or not)."""
    from switchyard.solver.scoring import SignatureScorer

    artifact, _ = sc.eldr_inputs(fit, decoders)
    sims = SignatureScorer.from_artifact(artifact).similarities_batch(sc.counts.prefill[sc.calib])  # type: ignore[arg-type]
    return np.bincount(sims.argmax(axis=1), minlength=decoders).tolist()
