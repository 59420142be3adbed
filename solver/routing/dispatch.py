"""Gimbal data-parallel dispatch and queue ordering, as pure functions over per-engine arrays.

Dispatch (seed 003, Algorithm 1): when KV caches are nearly full somewhere and unevenly used, KV is the
binding constraint, so send the request to the engine with the most free KV. Otherwise pick the engine with
the lowest pressure score

    score_i = remaining_prefill_i + waiting_prefill_i + comp_i + P_kv(kv_i) + P_moe(moe_i)

whose terms are all in prefill tokens, so they add up meaningfully: work already running, work queued,
work dispatched since the engine last reported (in-flight compensation), and penalties that turn KV usage
and MoE expert pressure into token-equivalents.

The seed does not publish P_kv and P_moe. We use P_kv(kv) = c_kv * kv / max(1 - kv, floor), which is nearly
linear while the cache is roomy and explodes as it fills (preemption, then recomputation, is what a full
cache costs), and P_moe(moe) = c_moe * max(moe - 1, 0), where moe is the engine's hottest-expert load over
the mean (1 = perfectly balanced experts).

Ordering (Algorithm 2): shortest prefill first, except that requests waiting longer than the aging
threshold are promoted ahead of everything, oldest first, so long prompts cannot starve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GimbalParams:
    kv_high: float = 0.90
    """KV usage above which the KV-first rule may trigger."""
    kv_spread: float = 0.10
    """...when the max-min KV usage gap across engines exceeds this."""
    kv_cost_tokens: float = 2048.0
    """c_kv: token-equivalent cost of a half-full KV cache (P_kv(0.5) = c_kv)."""
    kv_floor: float = 0.02
    """Lower bound on free KV in P_kv's denominator, so a full cache costs a large but finite amount."""
    moe_cost_tokens: float = 1024.0
    """c_moe: token-equivalent cost per unit of expert imbalance above 1."""
    age_threshold_s: float = 5.0
    """Requests waiting longer than this are served before shorter ones (the seed's θ_age)."""


def kv_penalty(kv_usage: np.ndarray, params: GimbalParams) -> np.ndarray:
    kv = np.clip(kv_usage, 0.0, 1.0)
    return params.kv_cost_tokens * kv / np.maximum(1.0 - kv, params.kv_floor)


def moe_penalty(expert_pressure: np.ndarray, params: GimbalParams) -> np.ndarray:
    return params.moe_cost_tokens * np.maximum(expert_pressure - 1.0, 0.0)


def pressure_scores(
    kv_usage: np.ndarray,
    remaining_prefill: np.ndarray,
    waiting_prefill: np.ndarray,
    comp_tokens: np.ndarray,
    expert_pressure: np.ndarray,
    params: GimbalParams,
) -> np.ndarray:
    """Per-engine pressure in prefill-token units (lower is better)."""
    return (
        remaining_prefill
        + waiting_prefill
        + comp_tokens
        + kv_penalty(kv_usage, params)
        + moe_penalty(expert_pressure, params)
    )


def pick_dp_engine(
    alive: np.ndarray,
    kv_usage: np.ndarray,
    remaining_prefill: np.ndarray,
    waiting_prefill: np.ndarray,
    comp_tokens: np.ndarray,
    expert_pressure: np.ndarray,
    params: GimbalParams,
) -> int:
    """Index of the engine that should take the next request; -1 when no engine is alive."""
    if not alive.any():
        return -1
    live_kv = kv_usage[alive]
    if live_kv.max() > params.kv_high and live_kv.max() - live_kv.min() > params.kv_spread:
        return int(np.argmin(np.where(alive, kv_usage, np.inf)))
    scores = pressure_scores(kv_usage, remaining_prefill, waiting_prefill, comp_tokens, expert_pressure, params)
    return int(np.argmin(np.where(alive, scores, np.inf)))


def queue_order(prefill_tokens: np.ndarray, waited_s: np.ndarray, params: GimbalParams) -> np.ndarray:
    """Service order of a queue: aged requests first (longest wait first), then shortest prefill first.

    Ties keep queue (arrival) order, so the result is deterministic.
    """
    aged = waited_s > params.age_threshold_s
    # lexsort sorts by the last key first: aged group, then within it wait (desc) or size (asc), then position.
    position = np.arange(len(prefill_tokens))
    within = np.where(aged, -waited_s, prefill_tokens.astype(np.float64))
    return np.lexsort((position, within, ~aged))
