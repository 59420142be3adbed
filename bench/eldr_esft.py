"""ELDR fit evidence on the real ESFT trace (DeepSeek-V2-Lite, 26 layers × 64 experts, top-6, 213 sequences).

Prints, for docs/eldr-fit.md:
  1. ρ of every representation (all layers, all request pairs) at several prefill fractions, and with
     32-token windows (943 requests) — the seed's Fig. 7 claim is count·IDF > gate-prob by > 0.035;
  2. ρ against the number of masked layers along the greedy order (the seed's Fig. 8 shape), in sample
     and on held-out requests;
  3. cluster sizes, balanced vs vanilla K-means, K = 4, 8, 16, 24 (the seed's Fig. 15 mechanism), with
     the task mix of K = 4 clusters;
  4. what the clusters buy, 5-fold cross-validated: distinct experts per layer per decode step in a
     batch of B requests co-located by the artifact (fitted without them, routed by nearest centroid)
     against B random requests — the quantity whose size sets decode time (the seed's Fig. 2 and 4).
Usage: python bench/eldr_esft.py [--batch 8] [--samples 2000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import _single_core
import numpy as np
from eldr_data import ESFT_DIR

from switchyard.shared.routing_trace import RoutingTrace
from switchyard.shared.trace_files import load_trace
from switchyard.solver.eldr_fit import FitOptions, fit_routing_artifact
from switchyard.solver.representations import REPRESENTATIONS, features, idf_weights
from switchyard.solver.rho import calibration_pairs, decode_target, rho
from switchyard.solver.scoring import SignatureScorer
from switchyard.solver.signatures import request_counts

OUT = Path(__file__).resolve().parent / "out"
ALL_PAIRS = 10**9


def rho_table(fractions: list[float]) -> dict:
    table = {}
    for label, fraction, window in [*((f"f={f}", f, None) for f in fractions), ("f=0.5, 32-token windows", 0.5, 32)]:
        counts = request_counts(load_trace(ESFT_DIR, prefill_fraction=fraction, window=window))
        target = decode_target(counts.decode, calibration_pairs(counts.num_requests))
        idf = idf_weights(counts.prefill)
        row = {r: rho(features(r, counts.prefill, idf, counts.prefill_gate), target) for r in REPRESENTATIONS}
        row["requests"], row["pairs"] = counts.num_requests, target.pairs.size
        table[label] = row
    return table


def layer_curves() -> dict:
    trace = load_trace(ESFT_DIR)
    curves = {}
    for representation in ("count", "count_idf"):
        options = FitOptions(representation=representation, max_pairs=ALL_PAIRS)
        _, everything = fit_routing_artifact(trace, 4, FitOptions(**{**options.__dict__, "holdout_fraction": 0.0}))
        _, split = fit_routing_artifact(trace, 4, options)
        curves[representation] = {
            "all_requests": everything["rho_by_num_layers"],
            "order": everything["layer_order"],
            "mask": everything["layer_mask"],
            "search_split": split["rho_by_num_layers"],
            "holdout_split": split["rho_by_num_layers_holdout"],
        }
    return curves


def cluster_sizes(decoder_counts: list[int]) -> dict:
    trace = load_trace(ESFT_DIR)
    sizes = {}
    for k in decoder_counts:
        _, report = fit_routing_artifact(trace, k, FitOptions(compare_vanilla=True))
        sizes[k] = {
            "capacity": report["capacity"],
            "balanced": sorted(report["cluster_sizes"], reverse=True),
            "vanilla": sorted(report["cluster_sizes_vanilla"], reverse=True),
            "band_size_mean": report["band_size_mean"],
            "label_mix": report["label_mix"],
        }
    return sizes


def _distinct_per_step(trace: RoutingTrace, batches: np.ndarray, rng: np.random.Generator) -> float:
    """Mean over batches and layers of the distinct experts selected by one decode token of each member."""
    decode = np.flatnonzero(trace.phase == 1)
    first = np.searchsorted(trace.request[decode], np.arange(trace.num_requests))
    length = np.bincount(trace.request[decode], minlength=trace.num_requests)
    tokens = decode[first[batches] + (rng.random(batches.shape) * length[batches]).astype(np.int64)]
    chosen = trace.experts[tokens]  # [S, B, L, k]
    samples, _, layers, _ = chosen.shape
    hit = np.zeros((samples, layers, trace.num_experts), dtype=bool)
    s = np.arange(samples)[:, None, None, None]
    layer = np.arange(layers)[None, None, :, None]
    hit[s, layer, chosen] = True
    return float(hit.sum(axis=2).mean())


def _sample_batches(groups: list[np.ndarray], batch: int, samples: int, rng: np.random.Generator) -> np.ndarray:
    usable = [g for g in groups if g.size >= batch]
    picks = rng.integers(len(usable), size=samples)
    return np.stack([rng.choice(usable[p], size=batch, replace=False) for p in picks])


def co_location(decoders: int, batch: int, samples: int, folds: int = 5) -> dict:
    """Cross-validated distinct experts per decode step: random vs ELDR-co-located vs same-task batches."""
    trace = load_trace(ESFT_DIR)
    counts = request_counts(trace)
    rng = np.random.default_rng(0)
    fold_of = rng.permutation(counts.num_requests) % folds
    results: dict[str, list[float]] = {"random": [], "eldr_balanced": [], "eldr_vanilla": [], "same_task": []}
    for fold in range(folds):
        held = np.flatnonzero(fold_of == fold)
        train = counts.subset(fold_of != fold)
        groups: dict[str, list[np.ndarray]] = {"random": [held]}
        for name, balanced in (("eldr_balanced", True), ("eldr_vanilla", False)):
            artifact, _ = fit_routing_artifact(train, decoders, FitOptions(balanced=balanced))
            home = SignatureScorer.from_artifact(artifact).similarities_batch(counts.prefill[held]).argmax(axis=1)
            groups[name] = [held[home == d] for d in range(decoders)]
        groups["same_task"] = [held[counts.label[held] == t] for t in range(len(counts.label_names or ()))]
        for name, members in groups.items():
            batches = _sample_batches(members, batch, samples // folds, rng)
            results[name].append(_distinct_per_step(trace, batches, rng))
    mean = {name: float(np.mean(v)) for name, v in results.items()}
    return {
        "decoders": decoders,
        "batch": batch,
        "distinct_experts_per_layer": mean,
        "reduction_vs_random": {n: 1 - v / mean["random"] for n, v in mean.items() if n != "random"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2000)
    args = parser.parse_args()
    print(_single_core.machine())
    report = {
        "rho": rho_table([0.25, 0.5, 0.75]),
        "layers": layer_curves(),
        "clusters": cluster_sizes([4, 8, 16, 24]),
        "co_location": [co_location(k, args.batch, args.samples) for k in (4, 8)],
    }
    print("\n1. ρ by representation (all layers, all pairs)")
    print("| setting | requests | pairs | " + " | ".join(REPRESENTATIONS) + " | count·IDF − gate | count − gate |")
    for label, row in report["rho"].items():
        values = " | ".join(f"{row[r]:.4f}" for r in REPRESENTATIONS)
        print(
            f"| {label} | {row['requests']} | {row['pairs']} | {values} | "
            f"{row['count_idf'] - row['gate_prob']:+.4f} | {row['count'] - row['gate_prob']:+.4f} |"
        )
    print("\n2. ρ against the number of masked layers (greedy order)")
    for representation, c in report["layers"].items():
        print(f"{representation}: order {c['order']}; mask {c['mask']}")
        for key in ("all_requests", "search_split", "holdout_split"):
            print(f"  {key:13s} " + " ".join(f"{v:.3f}" for v in c[key]))
    print("\n3. cluster sizes (sorted), balanced vs vanilla")
    for k, c in report["clusters"].items():
        print(
            f"K={k} cap {c['capacity']}: balanced {c['balanced']}; vanilla {c['vanilla']}; "
            f"mean τ-band {c['band_size_mean']:.2f}"
        )
    mix = report["clusters"][4]["label_mix"]
    print(f"K=4 task mix per balanced cluster {mix['label_names']}: {mix['per_cluster']}")
    print("\n4. distinct experts per layer per decode step (5-fold cross-validated)")
    for c in report["co_location"]:
        cells = ", ".join(
            f"{n} {v:.2f} ({-100 * c['reduction_vs_random'].get(n, 0):+.1f}%)"
            for n, v in c["distinct_experts_per_layer"].items()
        )
        print(f"K={c['decoders']}, batch {c['batch']}: {cells}")
    OUT.mkdir(exist_ok=True)
    (OUT / "eldr_esft.json").write_text(json.dumps({"machine": _single_core.machine(), **report}, indent=1))


if __name__ == "__main__":
    main()
