"""Offline-fit time (budget: 1,000 calibration requests, K = 24, 48 × 128, ≤ 2 s on one core).

Runs `fit_routing_artifact` end to end (counts given; ρ of every representation, greedy layer search over
all layers, balanced K-means) on:
  1. SYNTHETIC 1,000 × 48 × 128 counts resampled from ESFT (no real trace has that shape; see eldr_data.py);
  2. the real ESFT trace cut into 32-token windows (943 requests, 26 × 64);
  3. the real ESFT trace, one request per sequence (213 requests, 26 × 64).
Prints min and median over repeats of wall and process CPU time (one BLAS thread, so CPU time is one
core's time; on a shared machine it is the better estimate, wall time includes waiting for a core).
Usage: python bench/eldr_fit_time.py [--repeats 5] [--decoders 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import _single_core
from eldr_data import esft_counts, synthetic_counts

from switchyard.solver.eldr_fit import FitOptions, fit_routing_artifact
from switchyard.solver.signatures import RequestCounts

OUT = Path(__file__).resolve().parent / "out"


def time_fit(counts: RequestCounts, decoders: int, repeats: int) -> dict:
    seconds, cpu, stages = [], [], []
    for seed in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        _, report = fit_routing_artifact(counts, decoders, FitOptions(seed=seed))
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        stages.append(report["timings"])
    best = min(range(repeats), key=seconds.__getitem__)
    return {
        "requests": counts.num_requests,
        "shape": [counts.num_layers, counts.num_experts],
        "decoders": decoders,
        "min_s": min(seconds),
        "median_s": statistics.median(seconds),
        "cpu_min_s": min(cpu),
        "cpu_median_s": statistics.median(cpu),
        "stages_of_fastest": {k: round(v, 4) for k, v in stages[best].items()},
        "layer_mask_size": len(report["layer_mask"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decoders", type=int, default=24)
    args = parser.parse_args()
    print(_single_core.machine())
    cases = {
        "SYNTHETIC 1000 x 48 x 128 (resampled from ESFT)": synthetic_counts(1000, 48),
        "ESFT windows of 32 tokens (real, 26 x 64)": esft_counts(window=32),
        "ESFT sequences (real, 26 x 64)": esft_counts(),
    }
    results = {}
    for name, counts in cases.items():
        result = time_fit(counts, args.decoders, args.repeats)
        results[name] = result
        print(
            f"{name}: {result['requests']} requests, K = {args.decoders}: "
            f"wall min {result['min_s']:.2f} s, median {result['median_s']:.2f} s; "
            f"CPU min {result['cpu_min_s']:.2f} s, median {result['cpu_median_s']:.2f} s "
            f"(mask {result['layer_mask_size']} layers; stages {result['stages_of_fastest']})"
        )
    OUT.mkdir(exist_ok=True)
    (OUT / "eldr_fit_time.json").write_text(json.dumps({"machine": _single_core.machine(), **results}, indent=1))


if __name__ == "__main__":
    main()
