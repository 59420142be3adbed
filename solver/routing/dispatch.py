"""Gimbal data-parallel dispatch and queue ordering, as pure functions over per-engine arrays.

These are the formulas; the router and the DP simulator (`simulator.offline.dp.Dispatcher`) both
dispatch with their composition as named profiles of the routing framework
(`solver.routing.profiles.dp_profile`: the KV-first rule a filter, each pressure term a weighted scorer, the
argmin a picker). The parts use `GimbalParams`, `kv_penalty`, `moe_penalty` and `kv_first_applies`; the
`pick_*` forms below are kept as the independent reference that tests/test_routing_framework.py checks each
profile against (and bench/bench_routing.py times the profiles against), not as a second dispatch path.

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

Baselines, the same shape (per-engine arrays in, an index out, -1 when no engine is alive):

- `pick_round_robin`: the next live engine after the previous choice.
- `pick_jsq`: fewest outstanding requests (dispatched, not finished), as a proxy counting its own requests sees.
- `pick_vllm`: vLLM V1's internal DP load balancer (`DPLBAsyncMPClient.get_core_engine_for_request` in
  `vllm/v1/engine/core_client.py`, read at commit 364631ab): score = 4·waiting + running from the DP
  coordinator's snapshot, which the coordinator publishes at most every 100 ms while counts change
  (`vllm/v1/engine/coordinator.py`, `min_stats_update_interval_ms = 100`, read at commit 0090ad12); the scan
  starts at the client's index and keeps the first minimum; after each choice the client adds one to its
  local copy of that engine's waiting count, which the next snapshot overwrites.
- `pick_vllm_main`: the newer rule read on vLLM's main branch (commit 00080ee1): score =
  max(in-flight, waiting + running) + 6·waiting·max(0, kv − 0.5), where in-flight is the client's exact
  count of its unfinished requests on the engine; the scan start rotates by one after every choice.
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


def kv_first_applies(alive: np.ndarray, kv_usage: np.ndarray, params: GimbalParams) -> bool:
    """Algorithm 1's KV-first rule: some live cache is nearly full and live caches are unevenly used."""
    if not alive.any():
        return False
    live_kv = kv_usage[alive]
    top = float(live_kv.max())
    return top > params.kv_high and top - float(live_kv.min()) > params.kv_spread


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
    if kv_first_applies(alive, kv_usage, params):
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


DISPATCH_POLICIES: tuple[str, ...] = (
    "rr",
    "jsq",
    "vllm",
    "vllm-main",
    "gimbal",
    "llm-d",
    "dynamo",
    "sglang-cache",
    "switchyard",
    "gimbal-exact",
    "switchyard-exact",
    "gimbal-affinity",
)
"""Names of the data-parallel dispatch rules (`solver.routing.profiles.DP_PROFILES`, `sim-dp --dispatch`)."""

VLLM_WAITING_WEIGHT = 4.0
"""vLLM's DP load balancer weighs a waiting request 4x a running one (core_client.py at commit 364631ab)."""


def _first_min_from(scores: np.ndarray, alive: np.ndarray, start: int) -> int:
    """Index of the first live minimum scanning from `start` (wrapping), as vLLM's loop does; -1 if none."""
    n = len(scores)
    if n == 0 or not alive.any():
        return -1
    scan = (start + np.arange(n)) % n
    masked = np.where(alive[scan], scores[scan], np.inf)
    return int(scan[int(np.argmin(masked))])


def pick_round_robin(alive: np.ndarray, previous: int) -> int:
    """The first live engine after `previous` (pass -1 to start at engine 0)."""
    return _first_min_from(np.zeros(len(alive)), alive, previous + 1)


def pick_jsq(alive: np.ndarray, outstanding: np.ndarray) -> int:
    """Join the shortest queue: fewest outstanding requests; ties go to the lowest index."""
    return _first_min_from(np.asarray(outstanding, dtype=np.float64), alive, 0)


def pick_vllm(alive: np.ndarray, waiting: np.ndarray, running: np.ndarray, start: int = 0) -> int:
    """vLLM's default DP load balancing: argmin of 4·waiting + running, first minimum from `start`.

    `waiting` is the coordinator snapshot plus the client's own increments since (see the module docstring);
    the caller adds one to the chosen engine's waiting count.
    """
    scores = VLLM_WAITING_WEIGHT * np.asarray(waiting, dtype=np.float64) + np.asarray(running, dtype=np.float64)
    return _first_min_from(scores, alive, start)


def pick_vllm_main(
    alive: np.ndarray,
    waiting: np.ndarray,
    running: np.ndarray,
    kv_usage: np.ndarray,
    inflight: np.ndarray,
    start: int = 0,
    client_count: int = 1,
) -> int:
    """vLLM main's DP load balancing: max(clients·in-flight, waiting + running) plus a KV-pressure term on waiting.

    The caller rotates `start` by one after each choice and adds one to the chosen engine's waiting count.
    """
    w = np.asarray(waiting, dtype=np.float64)
    load = np.maximum(client_count * np.asarray(inflight, dtype=np.float64), w + np.asarray(running, dtype=np.float64))
    scores = load + w * 6.0 * np.maximum(0.0, np.asarray(kv_usage, dtype=np.float64) - 0.5)
    return _first_min_from(scores, alive, start)
