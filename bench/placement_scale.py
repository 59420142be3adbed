"""Placement quality at scale (issue #26, item 5): the placement loops running over a stream of real routing
windows at EP 8, 16 and 32, each placement's expert load per rank and all-to-all volume per token.

    .venv/bin/python bench/placement_scale.py            # both traces, 3 seeds (a few minutes on one core)
    .venv/bin/python bench/placement_scale.py --quick    # one seed, the ESFT trace only

Placements (simulator/core/placement_loop.py, on their own defaults): `none` (vLLM's contiguous layout, never
moved: the control), `eplb` (vLLM's EPLB: a fresh load-only layout from the last 1000 steps every 3000 steps),
`gimbal` (the placement service's loop: decayed window, start/period/drift triggers, the online greedy with
the calibrated weights, source-aware), `gimbal-load-only` (the same loop without the source counts: the control
that isolates what locality costs in balance) and `gimbal-uncalibrated` (the seed's weights).

Traces:
- `esft`: the shipped per-token DeepSeek-V2-Lite trace (26 MoE layers, 64 experts, top-6; 33,279 tokens of
  213 sequences in 4 task labels). DP+EP with tp 1: one DP engine per EP rank. Each sequence is served by one
  engine: `task` assignment (engine s serves task s mod 4, the sequences of a task dealt round-robin over its
  engines: a domain-affine dispatcher) or `random` (each sequence to an engine drawn uniformly). The stream:
  3 passes over the trace, each in a fresh seeded order of sequences, run 64 at a time (a sequence emits one
  token per step; the next in order starts when one ends), cut into windows of 1,024 tokens (~100 windows).
- `v3`: the shipped SGLang DeepSeek-V3 expert counts (58 MoE layers, 256 experts, top-8), aggregate only: each
  of the 12 workload files is one window (scaled to the same total), 8 passes in seeded orders. No per-token
  data and no sources: only the load columns, and Gimbal runs load-only (its source term has nothing to read).

Time: a window is 1 s of 100 steps of 10 ms (an assumption, so that the loops' own defaults, in seconds for
Gimbal and in steps for EPLB, both apply: 1 s is the vLLM agent's expert-load report interval); every step is
observed with the window's mean per-step load; the loop is asked to replan at each window's end, and a move is
applied at once (no migration time: this measures placement quality, not migration cost). Each window is scored
under the layout in force when it starts, i.e. placed from earlier windows only. The first `WARMUP` windows
are not scored (EPLB's first rearrangement comes after 750 steps).

Metrics, per placement: max/mean expert selections per rank (per layer and window; mean and p99 over them),
dispatch sends per token per layer (`solver.placement.traffic.a2a_sends`: token-rank sends inside the node
(NVLink) and to other nodes (network), and token-node sends to other nodes, DeepEP's RDMA), plans that moved
and expert copies moved. Writes docs/results/placement_scale/{runs.json,report.md}.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import _single_core  # before numpy: one BLAS thread; and the machine line
import numpy as np

from switchyard.data import SHIPPED_DIR
from switchyard.shared.streams import stream
from switchyard.simulator.core.ep import EpTopology
from switchyard.simulator.core.placements import make_placement
from switchyard.solver.placement.problem import hosts_from_slots
from switchyard.solver.placement.traffic import a2a_sends, rank_loads

ROOT = Path(__file__).resolve().parent.parent
ESFT = SHIPPED_DIR / "routing" / "esft_deepseek_v2_lite" / "esft_routing_compact.npz"
SGLANG = SHIPPED_DIR / "expert_load" / "sglang_deepseek_v3"
OUT = ROOT / "docs" / "results" / "placement_scale"

SEEDS = (0, 1, 2)
EP_SIZES = (8, 16, 32)
RANKS_PER_NODE = 8
#: A token over NVLink as a fraction of one over the network: the DP simulation's link figures (`EpTopology`).
NVLINK_COST = EpTopology.network_bytes_per_s / EpTopology.nvlink_bytes_per_s
PLACEMENTS = ("none", "eplb", "gimbal", "gimbal-load-only", "gimbal-uncalibrated")
STEPS_PER_WINDOW = 100  # 1 s windows of 10 ms steps
WINDOW_TOKENS = 1024
CONCURRENT = 64  # sequences running at once across the fleet (each emits one token per step)
PASSES = 3
V3_PASSES = 8  # 12 files a pass: 96 windows, about as many as the ESFT stream's 97
WARMUP = 10
#: Expert groups (DeepSeek's group-limited routing) from the models' config.json on Hugging Face:
#: deepseek-ai/DeepSeek-V2-Lite `n_group` 1, deepseek-ai/DeepSeek-V3 `n_group` 8. EPLB's hierarchical policy
#: needs the groups to divide over the nodes.
NUM_GROUPS = {"esft": 1, "v3": 8}
V3_SELECTIONS_PER_WINDOW = 8192 * 8  # each file scaled to 8,192 tokens x top-8 per layer


def esft_windows(seed: int, num_engines: int, assign: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(experts [n, L, k], source engine [n])] per window of the ESFT stream (see the module docstring)."""
    with np.load(ESFT, allow_pickle=False) as data:
        experts, task, seq = data["experts"].astype(np.int64), data["task"].astype(np.int64), data["seq"]
    sequence = task * (int(seq.max()) + 1) + seq  # a global id per sequence
    ids, first = np.unique(sequence, return_index=True)
    seq_task = task[first]
    if assign == "task":
        engine_of = np.empty(len(ids), dtype=np.int64)
        for t in range(4):
            mine = np.flatnonzero(seq_task == t)
            engines = np.arange(t, num_engines, 4) if num_engines >= 4 else np.array([t % num_engines])
            engine_of[mine] = engines[np.arange(len(mine)) % len(engines)]
    elif assign == "random":
        engine_of = stream(seed, "placement_scale.assign").integers(0, num_engines, len(ids))
    else:
        raise ValueError(f"unknown assignment {assign!r} (task or random)")
    token_index = np.searchsorted(ids, sequence)
    by_sequence = np.argsort(token_index, kind="stable")  # tokens of each sequence, in trace (position) order
    bounds = np.searchsorted(token_index[by_sequence], np.arange(len(ids) + 1))
    order_rng = stream(seed, "placement_scale.order")
    slots = [(0, c) for c in range(CONCURRENT)]  # (step the slot frees up, slot): the fleet's running sequences
    steps, rows = [], []
    for _ in range(PASSES):
        for s in order_rng.permutation(len(ids)):
            free, slot = heapq.heappop(slots)
            tokens = by_sequence[bounds[s] : bounds[s + 1]]
            rows.append(tokens)
            steps.append(free + np.arange(len(tokens)) + slot / CONCURRENT)  # one token per step, slots in order
            heapq.heappush(slots, (free + len(tokens), slot))
    rows_all = np.concatenate(rows)[np.argsort(np.concatenate(steps), kind="stable")]
    return [
        (experts[chunk], engine_of[token_index[chunk]])
        for chunk in np.array_split(rows_all, max(len(rows_all) // WINDOW_TOKENS, 1))
    ]


def v3_windows(seed: int) -> list[np.ndarray]:
    """[counts [L, E]] per window of the SGLang stream: every file once per pass, in seeded orders."""
    files = sorted(SGLANG.glob("*.json"))
    counts = []
    for path in files:
        matrix = np.asarray(json.loads(path.read_text())["logical_count"], dtype=np.float64)
        matrix = matrix[matrix.sum(axis=1) > 0]  # the dense layers 0-2 record nothing
        counts.append(matrix / matrix.sum(axis=1, keepdims=True) * V3_SELECTIONS_PER_WINDOW)
    order_rng = stream(seed, "placement_scale.order")
    return [counts[i] for _ in range(V3_PASSES) for i in order_rng.permutation(len(counts))]


def source_load(experts: np.ndarray, source: np.ndarray, num_sources: int, num_experts: int) -> np.ndarray:
    """[L, S, E] selections by source engine of tokens `experts` [n, L, k] from engines `source` [n]."""
    num_layers = experts.shape[1]
    layer = np.broadcast_to(np.arange(num_layers)[None, :, None], experts.shape)
    index = (layer * num_sources + source[:, None, None]) * num_experts + experts
    return (
        np.bincount(index.ravel(), minlength=num_layers * num_sources * num_experts)
        .reshape(num_layers, num_sources, num_experts)
        .astype(np.float64)
    )


def run(trace: str, seed: int, num_gpus: int, placement: str, assign: str = "-") -> dict:
    """One placement over one stream; the row runs.json keeps."""
    started = time.process_time()
    if trace == "esft":
        windows = esft_windows(seed, num_gpus, assign)
        num_layers, num_experts = windows[0][0].shape[1], 64
        loads = [source_load(e, s, num_gpus, num_experts) for e, s in windows]
    else:
        counts = v3_windows(seed)
        num_layers, num_experts = counts[0].shape
        loads = [np.repeat(c[:, None, :] / num_gpus, num_gpus, axis=1) for c in counts]  # no sources: spread
    options: dict = {}
    if placement == "eplb":
        options = {"num_groups": NUM_GROUPS[trace], "ranks_per_node": RANKS_PER_NODE}
    elif placement in ("gimbal", "gimbal-uncalibrated") and trace == "v3":
        options = {"source_aware": False}
    elif placement.startswith("gimbal"):  # the links priced as the DP simulation prices them
        options = {"ranks_per_node": RANKS_PER_NODE, "nvlink_cost": NVLINK_COST}
    control = make_placement(placement, num_layers, num_experts, num_gpus, 1, **options)
    ratios, sends, moved, copies = [], defaultdict(list), 0, 0
    for w, load in enumerate(loads):
        layout = control.layout()
        if w >= WARMUP:
            per_rank = rank_loads(load.sum(axis=1), layout)
            ratios.append(per_rank.max(axis=1) / per_rank.mean(axis=1))
            if trace == "esft":
                for key, value in (
                    a2a_sends(windows[w][0], layout, windows[w][1], RANKS_PER_NODE).per_token_layer().items()
                ):
                    sends[key].append(value)
        step_load = load / STEPS_PER_WINDOW
        for i in range(STEPS_PER_WINDOW):
            control.observe(w + (i + 0.5) / STEPS_PER_WINDOW, step_load)
        new = control.replan(w + 1.0)
        if new is not None:
            before, after = hosts_from_slots(layout, num_experts), hosts_from_slots(new, num_experts)
            moved, copies = moved + 1, copies + int((after & ~before).sum())
            control.applied(w + 1.0, new)
    ratio = np.concatenate(ratios)
    row = {
        "trace": trace,
        "assign": assign,
        "ep": num_gpus,
        "placement": placement,
        "seed": seed,
        "windows": len(loads),
        "scored_windows": len(loads) - WARMUP,
        "max_mean": float(ratio.mean()),
        "max_mean_p99": float(np.percentile(ratio, 99)),
        "plans_moved": moved,
        "copies_moved": copies,
        "cpu_s": round(time.process_time() - started, 2),
    }
    row.update({f"sends_{k}": float(np.mean(v)) for k, v in sends.items()})
    return row


def _fmt(values: list[float], digits: int = 3) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def report(rows: list[dict], command: str, machine: str) -> str:
    lines = [
        "# Placement quality at scale (issue #26, item 5)",
        "",
        f"Command: `{command}`. Machine: {machine}. Seeds: {sorted({r['seed'] for r in rows})} (each: the stream's",
        "order of sequences / files and, for `random`, the sequence-to-engine draw). Figures: mean over seeds",
        "(min–max over seeds in brackets). How it is run: `bench/placement_scale.py`'s docstring and",
        "docs/placement-loop.md.",
        "",
    ]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["trace"], row["assign"], row["ep"], row["placement"])].append(row)
    for trace, assign in sorted({(r["trace"], r["assign"]) for r in rows}):
        esft = trace == "esft"
        title = f"ESFT DeepSeek-V2-Lite, `{assign}` assignment" if esft else "SGLang DeepSeek-V3 counts (load only)"
        lines += [f"## {title}", ""]
        header = "| EP | placement | max/mean load (mean) | max/mean p99 |"
        rule = "|---|---|---|---|"
        if esft:
            header += " NVLink sends/token/layer | network sends/token/layer | network node sends/token/layer |"
            rule += "---|---|---|"
        header += " plans moved | copies moved |"
        rule += "---|---|"
        lines += [header, rule]
        for ep in EP_SIZES:
            for placement in PLACEMENTS:
                runs = groups.get((trace, assign, ep, placement))
                if not runs:
                    continue
                cells = [
                    str(ep),
                    placement,
                    _fmt([r["max_mean"] for r in runs]),
                    _fmt([r["max_mean_p99"] for r in runs]),
                ]
                if esft:
                    cells += [_fmt([r[f"sends_{k}"] for r in runs]) for k in ("nvlink", "network", "network_nodes")]
                cells += [_fmt([r["plans_moved"] for r in runs], 1), _fmt([r["copies_moved"] for r in runs], 0)]
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, the ESFT trace only")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    seeds = SEEDS[:1] if args.quick else SEEDS
    cases = [("esft", a) for a in ("task", "random")] + ([] if args.quick else [("v3", "-")])
    rows = []
    for trace, assign in cases:
        for ep in EP_SIZES:
            for placement in PLACEMENTS:
                for seed in seeds:
                    row = run(trace, seed, ep, placement, assign)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    command = "python bench/placement_scale.py" + (" --quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runs.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "report.md").write_text(report(rows, command, _single_core.machine()) + "\n")
    print(report(rows, command, _single_core.machine()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
