"""Serving metrics of a simulation: TTFT, TPOT, throughput, distinct experts per step, per-engine load.

Definitions (as the ELDR seed and vLLM's benchmark use them):
- TTFT: arrival → first output token (prefill, KV transfer, decode queueing and first decode step).
- TPOT: per request, (last token − first token) / (output tokens − 1); requests with one output token
  have none. Median and p99 are over requests.
- throughput: output tokens per second over the run (first arrival → last finish).
- mean distinct experts: per decode step, the mean over MoE layers of the distinct experts its batch loads,
  averaged over steps; also per token (steps weighted by batch), the figure a request experiences.
- prefix hit rate: prompt tokens the prefill engines found in their prefix caches over prompt tokens looked
  up (0 on traces without `hash_ids`); `prefix_hit_request_mean`: the mean of each request's own ratio.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from switchyard.simulator.offline.xpyd import SimResult

__all__ = ["SUMMARY_KEYS", "summarize", "write_csv", "write_json"]

#: Keys of `summarize` that the CLI contract promises, in CSV column order.
SUMMARY_KEYS = (
    "tpot_p50",
    "tpot_p99",
    "tpot_mean",
    "ttft_p50",
    "ttft_p99",
    "throughput",
    "mean_distinct_experts",
    "token_distinct_experts",
    "mean_batch",
    "load_cov",
    "preemptions",
    "requests",
    "offered_rate",
)


def percentile(x: np.ndarray, q: float) -> float:
    """`np.percentile`, NaN for no data (a policy that finished nothing)."""
    return float(np.percentile(x, q)) if len(x) else float("nan")


def summarize(res: SimResult) -> dict[str, object]:
    """The headline numbers of one run (seconds for times, tokens/s for throughput)."""
    out_tokens = res.workload.output
    ttft = res.first_token - res.arrival
    multi = out_tokens > 1
    tpot = (res.finish[multi] - res.first_token[multi]) / (out_tokens[multi] - 1)
    span = float(np.nanmax(res.finish) - res.arrival.min())
    w = res.step_batch.astype(np.float64)
    tokens_per_engine = res.engine_tokens.astype(np.float64)
    busy = res.engine_busy / span if span > 0 else res.engine_busy * 0
    return {
        "policy": res.policy,
        "fleet": res.fleet.label,
        "requests": int(res.workload.size),
        "offered_rate": res.workload.offered_rate,
        "tpot_p50": percentile(tpot, 50),
        "tpot_p99": percentile(tpot, 99),
        "tpot_mean": float(tpot.mean()) if len(tpot) else float("nan"),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "throughput": float(res.tokens.sum() / span) if span > 0 else float("nan"),
        "mean_distinct_experts": float(res.step_distinct.mean()) if len(w) else float("nan"),
        "token_distinct_experts": float((res.step_distinct * w).sum() / w.sum()) if len(w) else float("nan"),
        "mean_batch": float(w.mean()) if len(w) else float("nan"),
        "load_cov": float(tokens_per_engine.std() / tokens_per_engine.mean()) if tokens_per_engine.sum() else 0.0,
        "preemptions": int(res.engine_preemptions.sum()),
        "makespan_s": span,
        "fallbacks": dict(res.fallbacks),
        "mean_band_size": float(res.band_size.mean()),
        "prefix_hit_rate": res.prefix_hit_rate,
        "prefix_hit_request_mean": float((res.prefix_hit / res.workload.prompt).mean()) if len(res.prefix_hit) else 0.0,
        "prefill_prefix_hit_rate": [
            round(float(h / q), 4) if q else 0.0
            for h, q in zip(res.prefill_prefix_hit_tokens, res.prefill_prefix_query_tokens, strict=True)
        ],
        "per_engine": {
            "tokens": res.engine_tokens.tolist(),
            "busy_fraction": [round(float(b), 4) for b in busy],
            "preemptions": res.engine_preemptions.tolist(),
            "max_kv_blocks_used": res.max_kv_blocks_used.tolist(),
        },
    }


def write_json(path: str | Path, payload: object) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")


def write_csv(path: str | Path, rows: Sequence[dict[str, object]], keys: Sequence[str] | None = None) -> None:
    """One row per summary (scalar columns only)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if keys is None:
        keys = [k for k in rows[0] if not isinstance(rows[0][k], dict | list)] if rows else []
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(keys), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in keys})


def _jsonable(obj: object) -> object:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
