"""Fig. 4: distinct experts of same-domain vs mixed decode batches, measured on the routing trace."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from switchyard.simulator.core.experts import ReplayBank
from switchyard.simulator.offline.experiments import batch_distinct
from switchyard.simulator.offline.plots import save
from switchyard.simulator.offline.report.options import SEED
from switchyard.simulator.offline.report.runner import ReportContext, pct

__all__ = ["build"]


def build(ctx: ReportContext) -> tuple[dict[int, dict[str, object]], list[str]]:
    """The section's results and Markdown; writes `fig4_same_vs_mixed.png`."""
    ctx.log("Fig. 4")
    opts = ctx.opts
    full_bank = ReplayBank.from_trace(ctx.sc.trace)
    sizes = [4, 8, 12]
    fig4 = {}
    for b in sizes:
        same, mixed, per = batch_distinct(full_bank, b, 600 if opts.quick else 4000, opts.seed)
        fig4[b] = {"same": same, "mixed": mixed, "reduction_pct": -pct(same, mixed), "per_label": per}
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    x = np.arange(len(sizes))
    ax.bar(x - 0.2, [fig4[b]["same"] for b in sizes], 0.4, label="same-domain", color="tab:blue")
    ax.bar(x + 0.2, [fig4[b]["mixed"] for b in sizes], 0.4, label="mixed", color="tab:orange")
    ax.set_xticks(x, [f"batch {b}" for b in sizes])
    ax.set(ylabel="distinct experts per layer", title=f"Fig. 4 analogue: ESFT ({ctx.model}), decode steps")
    ax.legend()
    save(fig, ctx.out_dir / "fig4_same_vs_mixed.png")
    labels = list(fig4[8]["per_label"])
    md = [
        "## Fig. 4 — same-domain vs mixed batches (distinct experts per decode step)",
        "",
        f"Seed: {SEED['fig4']}.",
        "",
        "Measured on the ESFT trace (all sequences, task labels, a random decode token per request; mixed "
        "batches draw requests uniformly, same-domain batches one task with probability = its share):",
        "",
        "| batch | same-domain | mixed | fewer experts |",
        "|---|---|---|---|",
        *(
            f"| {b} | {fig4[b]['same']:.1f} | {fig4[b]['mixed']:.1f} | **{fig4[b]['reduction_pct']:.1f} %** |"
            for b in sizes
        ),
        "",
        "Per task at batch 8 (same-domain vs mixed): "
        + "; ".join(f"{lab} {fig4[8]['per_label'][lab][0]:.1f} vs {fig4[8]['per_label'][lab][1]:.1f}" for lab in labels)
        + ".",
        "",
        "![Fig. 4](fig4_same_vs_mixed.png)",
        "",
    ]
    return fig4, md
