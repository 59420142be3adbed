"""Fig. 2: one MoE layer's time vs active experts and batch size, from the physics alone (no serving run)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from switchyard.simulator.core.physics import SEED_FIG2, cost_model
from switchyard.simulator.offline.experiments import moe_layer_grid
from switchyard.simulator.offline.plots import save
from switchyard.simulator.offline.report.options import SEED
from switchyard.simulator.offline.report.runner import ReportContext

__all__ = ["build"]


def build(ctx: ReportContext) -> tuple[dict[str, object], list[str]]:
    """The section's results and Markdown; writes `fig2_moe_time.png`."""
    ctx.log("Fig. 2")
    experts = np.array([8, 16, 32, 64, 128])
    batches = np.array([16, 32, 64, 128, 256])  # ≥ 16 tokens × top-8 can reach every expert count
    seed_cost = cost_model(SEED_FIG2["model"], SEED_FIG2["gpu"])
    grid = moe_layer_grid(seed_cost, experts, batches) * 1e6
    e16, e128 = int(np.flatnonzero(experts == 16)[0]), int(np.flatnonzero(experts == 128)[0])
    b64 = int(np.flatnonzero(batches == SEED_FIG2["batch"])[0])
    ratio = grid[e128, b64] / grid[e16, b64]
    flat = grid[:, -1] / grid[:, 0]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for j, b in enumerate(batches):
        ax1.plot(experts, grid[:, j], marker="o", label=f"batch {b}")
    for i, e in enumerate(experts):
        ax2.plot(batches, grid[i], marker="o", label=f"{e} experts")
    ax1.set(xlabel="active experts", ylabel="MoE layer time (µs)", title="vs active experts")
    ax2.set(xlabel="batch (tokens)", title="vs batch size", xscale="log")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle(f"Fig. 2 analogue: one MoE layer, {SEED_FIG2['model']} on {SEED_FIG2['gpu']}", fontsize=9)
    save(fig, ctx.out_dir / "fig2_moe_time.png")
    results = {"experts": experts.tolist(), "batches": batches.tolist(), "time_us": grid.round(2).tolist()}
    md = [
        "## Fig. 2 — MoE-layer time vs active experts and batch",
        "",
        f"Seed: {SEED['fig2']}.",
        "",
        f"Simulated ({SEED_FIG2['model']}, {SEED_FIG2['gpu']}, the physics' calibration point): 16→128 experts at "
        f"batch 64 = **{ratio:.2f}×**; batch 16→256 at fixed experts = "
        + ", ".join(f"{f:.2f}× ({e} experts)" for e, f in zip(experts, flat, strict=True))
        + ". The 4.7× is the one number the physics is fitted to (`a`); the batch flatness is not fitted: it "
        "follows from the datasheet compute/bandwidth ratio.",
        "",
        "| experts \\ batch | " + " | ".join(str(b) for b in batches) + " |",
        "|---" * (len(batches) + 1) + "|",
        *(f"| {e} | " + " | ".join(f"{v:.0f} µs" for v in row) + " |" for e, row in zip(experts, grid, strict=True)),
        "",
        "![Fig. 2](fig2_moe_time.png)",
        "",
    ]
    return results, md
