"""Matplotlib figures of simulation runs (Agg backend: files only, no display)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from switchyard.simulator.offline.dp_fleet import DPSimResult
from switchyard.simulator.offline.xpyd import SimResult

__all__ = ["plot_dp_runs", "plot_runs", "save"]

DPI = 90


def save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _tpot(res: SimResult) -> np.ndarray:
    out = res.workload.output
    multi = out > 1
    return (res.finish[multi] - res.first_token[multi]) / (out[multi] - 1)


def plot_runs(results: Mapping[str, SimResult], out_dir: Path, title: str) -> list[Path]:
    """Per-run figures: TPOT and TTFT CDFs per policy, per-engine tokens, distinct experts per step."""
    paths = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, res in results.items():
        for ax, values in ((ax1, _tpot(res) * 1e3), (ax2, (res.first_token - res.arrival) * 1e3)):
            v = np.sort(values)
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
    ax1.set(xlabel="TPOT (ms)", ylabel="fraction of requests", title="TPOT CDF")
    ax2.set(xlabel="TTFT (ms)", title="TTFT CDF", xscale="log")
    ax1.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    paths.append(save(fig, out_dir / "latency_cdf.png"))

    names: Sequence[str] = list(results)
    fig, ax = plt.subplots(figsize=(10, 3.5))
    width = 0.8 / max(len(names), 1)
    engines = 0
    for i, name in enumerate(names):
        tokens = results[name].engine_tokens
        engines = max(engines, len(tokens))
        ax.bar(np.arange(len(tokens)) + i * width, tokens / tokens.mean(), width, label=name)
    ax.axhline(1.0, color="k", lw=0.5)
    # One tick per engine, under its group of bars, named as the simulator names decoders (d000, d001, ...).
    ax.set_xticks(np.arange(engines) + width * (len(names) - 1) / 2, [f"d{e:03d}" for e in range(engines)])
    ax.set(xlabel="decode engine", ylabel="tokens / mean", title="per-engine decode load")
    ax.legend(fontsize=8, ncol=min(len(names), 4))
    paths.append(save(fig, out_dir / "engine_load.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, res in results.items():
        w = res.step_batch.astype(np.float64)
        ax.hist(res.step_distinct, bins=40, weights=w / w.sum(), histtype="step", label=name)
    ax.set(xlabel="distinct experts per layer in a decode step", ylabel="fraction of tokens")
    ax.legend(fontsize=8)
    paths.append(save(fig, out_dir / "distinct_experts.png"))
    return paths


def plot_dp_runs(results: Mapping[str, DPSimResult], out_dir: Path, title: str) -> list[Path]:
    """`sim-dp --out`: TTFT and TPOT CDFs per (dispatch, order) run, and each engine's share of the requests."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, res in results.items():
        done = res.finish > 0
        out = res.tokens
        multi = done & (out > 1)
        tpot = (res.finish[multi] - res.first_token[multi]) / (out[multi] - 1) * 1e3
        ttft = (res.first_token[done] - res.arrival[done]) * 1e3
        for ax, values in ((ax1, ttft), (ax2, tpot)):
            v = np.sort(values)
            ax.plot(v, np.arange(1, len(v) + 1) / max(len(v), 1), label=label)
    ax1.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", xscale="log")
    ax1.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))  # plain numbers on the log axis
    ax1.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax2.set(xlabel="TPOT (ms)", title="TPOT CDF")
    ax1.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    paths = [save(fig, out_dir / "latency_cdf.png")]

    labels = list(results)
    fig, ax = plt.subplots(figsize=(10, 3.5))
    width = 0.8 / max(len(labels), 1)
    engines = 0
    for i, label in enumerate(labels):
        requests = results[label].engine_requests.astype(np.float64)
        engines = max(engines, len(requests))
        ax.bar(np.arange(len(requests)) + i * width, requests / max(requests.mean(), 1e-9), width, label=label)
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xticks(np.arange(engines) + width * (len(labels) - 1) / 2, [f"dp{e}" for e in range(engines)])
    ax.set(xlabel="DP engine", ylabel="requests / mean", title="per-engine share of the requests")
    ax.legend(fontsize=7, ncol=min(len(labels), 4))
    paths.append(save(fig, out_dir / "engine_load.png"))
    return paths
