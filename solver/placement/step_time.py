"""The layout-dependent part of a DP+EP step's time: one formula for the simulator and the placement service.

The DP+EP simulator (`simulator.core.ep`) prices every step it runs with these functions, and the placement
service's publish rule (`solver.placement.payoff`) predicts with them what a new layout would save; both read
the same constants (`StepCost`), so a prediction and the simulation it is checked against cannot disagree on
the physics, only on the load.

Per MoE layer a step waits for its busiest rank twice:

- **expert work** (`expert_seconds`): `max_g (b·U_g + P_g·pair_s)`, with U_g the copies of selected experts on
  rank g (each one weight read from HBM) and P_g the (token, expert) pairs it computes;
- **all-to-all** (`a2a_seconds`): each token goes once to every other rank that hosts one of its experts,
  dispatched and combined (`token_bytes` = hidden × (1 + 2) bytes); a phase lasts the busiest rank's bytes
  (the larger of sent and received) on the slower of its two link classes, NVLink inside a node and the
  network across, which run concurrently.

`expected_step` gives both from expected per-step counts by source (a window's rates × a step's length): a
step selects an expert with probability 1 − exp(−count) (Poisson), and a token of source s reaches rank g with
probability 1 − (1 − mass)^k, k draws from the source's expert mix (the simulator's rule for prefill chunks).
The busiest rank's expert time is the expected maximum over ranks of independent normals with each rank's
Poisson mean and variance (`expected_max`), not the maximum of the means: on a balanced layout the ranks take
turns being the busiest, and a step waits for whichever is (without it the prediction overstates what balancing
saves by half on small batches; `tests/test_placement_payoff.py` checks it against simulated steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr

from switchyard.shared.placement_terms import (
    DEFAULT_RANKS_PER_NODE,
    MIGRATION_NETWORK_BYTES_PER_S,
    MIGRATION_NVLINK_BYTES_PER_S,
)
from switchyard.solver.placement.problem import hosts_from_slots

__all__ = [
    "StepCost",
    "a2a_seconds",
    "expected_max",
    "expected_step",
    "expert_seconds",
    "origin_matrix",
    "rank_tokens",
]


@dataclass(frozen=True)
class StepCost:
    """The constants of the step-time terms that depend on the layout.

    `expert_read_s`: one expert's weights from HBM; `pair_s`: one (token, expert) pair's FLOPs at peak;
    `token_bytes`: one token's dispatch and combine bytes per layer; link bandwidths are the all-to-all kernels'
    achieved figures (DeepEP: 153 GB/s NVLink, 43 GB/s network); `top_k` experts per token.
    """

    expert_read_s: float
    pair_s: float
    token_bytes: float
    top_k: int
    ranks_per_node: int = DEFAULT_RANKS_PER_NODE
    nvlink_bytes_per_s: float = MIGRATION_NVLINK_BYTES_PER_S
    network_bytes_per_s: float = MIGRATION_NETWORK_BYTES_PER_S

    def __post_init__(self) -> None:
        if min(self.expert_read_s, self.pair_s, self.token_bytes) < 0 or self.top_k < 1 or self.ranks_per_node < 1:
            raise ValueError("step-cost constants must be >= 0, top_k and ranks_per_node >= 1")
        if min(self.nvlink_bytes_per_s, self.network_bytes_per_s) <= 0:
            raise ValueError("link bandwidths must be > 0")


def _same_node(num_ranks: int, ranks_per_node: int) -> np.ndarray:
    node = np.arange(num_ranks) // ranks_per_node
    return node[:, None] == node[None, :]


def expert_seconds(cost: StepCost, distinct: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """`[L]` the busiest rank's expert seconds per layer from `distinct[L, G]` and `pairs[L, G]`."""
    return (cost.expert_read_s * distinct + pairs * cost.pair_s).max(axis=1)


def expected_max(mean: np.ndarray, var: np.ndarray, points: int = 96) -> np.ndarray:
    """`[L]` E[max_g X_g] for independent X_g ~ N(mean[L, G], var[L, G]): ∫ (1 − Π_g Φ) above the grid's floor."""
    sd = np.sqrt(np.maximum(var, 0.0))
    if not sd.any():
        return mean.max(axis=1)
    lo = (mean - 5 * sd).min(axis=1, keepdims=True)
    hi = (mean + 5 * sd).max(axis=1, keepdims=True)
    x = lo + (hi - lo) * np.linspace(0.0, 1.0, points)[None, :]  # [L, P]
    z = (x[:, None, :] - mean[:, :, None]) / np.where(sd > 0, sd, 1.0)[:, :, None]
    cdf = np.where(sd[:, :, None] > 0, ndtr(z), (x[:, None, :] >= mean[:, :, None]).astype(np.float64))
    below = cdf.prod(axis=1)  # [L, P] P(max <= x)
    return lo[:, 0] + np.trapezoid(1.0 - below, x, axis=1)


def rank_tokens(dest: np.ndarray, origin: np.ndarray) -> np.ndarray:
    """`[L, G, G]` tokens from rank r to rank g, never to itself, from `dest[S, L, G]` (tokens of source s
    reaching rank g) and `origin[S, G]` (the share of source s's tokens dispatched from rank g)."""
    tokens = np.einsum("sr,slg->lrg", origin, dest)
    idx = np.arange(tokens.shape[1])
    tokens[:, idx, idx] = 0.0
    return tokens


def a2a_seconds(cost: StepCost, tokens: np.ndarray) -> tuple[np.ndarray, float, float]:
    """`tokens[L, G, G]` → (`[L]` busy seconds of both phases without latency, NVLink bytes, network bytes)."""
    near = _same_node(tokens.shape[1], cost.ranks_per_node)
    nv = np.where(near, tokens, 0.0)
    net = tokens - nv

    def busiest(m: np.ndarray) -> np.ndarray:  # [L] the busiest rank's tokens (sent or received)
        return np.maximum(m.sum(axis=2), m.sum(axis=1)).max(axis=1)

    busy = np.maximum(busiest(nv) / cost.nvlink_bytes_per_s, busiest(net) / cost.network_bytes_per_s)
    return busy * cost.token_bytes, float(nv.sum() * cost.token_bytes), float(net.sum() * cost.token_bytes)


def origin_matrix(num_sources: int, gpu_ranks: list[int | None]) -> np.ndarray:
    """`[S, G]`: source s dispatches its tokens evenly from the GPUs it owns (`gpu_ranks[g]` = s); a source
    that owns none (unknown owners) dispatches from every GPU evenly."""
    ranks = np.array([-1 if r is None else r for r in gpu_ranks])
    own = (np.arange(num_sources)[:, None] == ranks[None, :]).astype(np.float64)
    own[own.sum(axis=1) == 0] = 1.0
    return own / own.sum(axis=1, keepdims=True)


def expected_step(cost: StepCost, counts: np.ndarray, layout: np.ndarray, origin: np.ndarray) -> tuple[float, float]:
    """(expert seconds, all-to-all seconds) of a step with expected (token, expert) pairs `counts[L, S, E]` under
    slot map `layout[L, G, slots]`, sources dispatched from `origin[S, G]` (see the module docstring)."""
    counts = np.asarray(counts, dtype=np.float64)
    hosts = hosts_from_slots(np.asarray(layout), counts.shape[2]).astype(np.float64)  # [L, E, G]
    share = hosts / np.maximum(hosts.sum(axis=2, keepdims=True), 1.0)
    load = counts.sum(axis=1)  # [L, E]
    hit = 1.0 - np.exp(-load)
    distinct = np.einsum("le,leg->lg", hit, hosts)
    pairs = np.einsum("le,leg->lg", load, share)
    mean = cost.expert_read_s * distinct + cost.pair_s * pairs
    var = cost.expert_read_s**2 * np.einsum("le,leg->lg", hit * (1 - hit), hosts) + cost.pair_s**2 * np.einsum(
        "le,leg->lg", load, share**2
    )
    tokens = counts.sum(axis=2) / cost.top_k  # [L, S]
    mass = np.einsum("lse,leg->slg", counts, share) / np.maximum(tokens.T[:, :, None] * cost.top_k, 1e-12)
    dest = tokens.T[:, :, None] * (1.0 - (1.0 - np.clip(mass, 0.0, 1.0)) ** cost.top_k)
    busy, _, _ = a2a_seconds(cost, rank_tokens(dest, origin))
    return float(expected_max(mean, var).sum()), float(busy.sum())
