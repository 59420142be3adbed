"""Signature quality ρ (the seed's Eq. 1) and the greedy layer mask that maximises it.

ρ = Spearman(cos-dist(s_i, s_j), cos-dist(p_i, p_j)) over pairs of calibration requests, s the prefill
signature and p the decode pattern. Only the *ordering* of pair distances matters (the clustering only
consumes that ordering), so one scalar ranks representations, IDF and layer masks before any router runs.

Pairs: all R(R-1)/2 when that is at most `max_pairs`, otherwise a uniform random subset, whose sampling
error against the all-pairs ρ is estimated from disjoint random groups (`rho_sampling_error`).

The layer search is forward-greedy: start empty, add the layer that maximises ρ, repeat until all layers
are in; the curve ρ(n) has the shape of the seed's Fig. 8 and the mask is its peak. It is cheap because
cosine similarity decomposes over layers: with x_i(l) the row of layer l,
cos_S(i, j) = Σ_{l∈S} x_i(l)·x_j(l) / sqrt(Σ_{l∈S} |x_i(l)|² · Σ_{l∈S} |x_j(l)|²),
so per-layer pair dot products and row norms are computed once and every candidate of a step is scored
together, in one ranking of a [candidates, pairs] array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata, spearmanr

from switchyard.solver.representations import l2_normalise

__all__ = [
    "DecodeTarget",
    "LayerSearch",
    "Pairs",
    "calibration_pairs",
    "decode_target",
    "greedy_layer_search",
    "pair_cosine_distances",
    "pair_dots",
    "rho",
    "rho_along",
    "rho_of_distances",
    "rho_sampling_error",
    "spearman_rho",
]

#: Up to this many requests, pair dot products come from one float32 Gram matrix (R² · 4 bytes).
_GRAM_MAX_REQUESTS = 4096
_CHUNK = 4096


@dataclass(frozen=True, eq=False)
class Pairs:
    """Request index pairs (i < j), sorted, over which ρ is computed; `total` = R(R-1)/2."""

    i: np.ndarray
    j: np.ndarray
    total: int

    @property
    def size(self) -> int:
        return int(self.i.size)

    @property
    def exhaustive(self) -> bool:
        return self.size == self.total


def calibration_pairs(num_requests: int, max_pairs: int | None = None, seed: int = 0) -> Pairs:
    """All pairs, or `max_pairs` of them drawn uniformly without replacement."""
    if num_requests < 3:
        raise ValueError(f"ρ needs at least 3 requests (3 pairs), got {num_requests}")
    i, j = np.triu_indices(num_requests, 1)
    if max_pairs is None or i.size <= max_pairs:
        return Pairs(i, j, int(i.size))
    if max_pairs < 3:
        raise ValueError(f"max_pairs must be at least 3, got {max_pairs}")
    pick = np.sort(np.random.default_rng(seed).choice(i.size, size=max_pairs, replace=False))
    return Pairs(i[pick], j[pick], int(i.size))


def pair_dots(x: np.ndarray, pairs: Pairs) -> np.ndarray:
    """x_i · x_j for every pair of rows of x [R, D] -> [M] float64.

    A float32 Gram matrix (one BLAS call) while it fits, else chunked row gathers: gathering M rows of D
    floats is memory-bound and several times slower than the Gram product at R ≈ 1000.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.shape[0] <= _GRAM_MAX_REQUESTS:
        return (x @ x.T)[pairs.i, pairs.j].astype(np.float64)
    out = np.empty(pairs.size, dtype=np.float64)
    for start in range(0, pairs.size, _CHUNK):
        stop = start + _CHUNK
        out[start:stop] = np.einsum("md,md->m", x[pairs.i[start:stop]], x[pairs.j[start:stop]])
    return out


def pair_cosine_distances(x: np.ndarray, pairs: Pairs) -> np.ndarray:
    """1 − cos(x_i, x_j) for every pair of rows of x [R, ...]; an all-zero row is at distance 1 from all."""
    flat = np.asarray(x, dtype=np.float32).reshape(x.shape[0], -1)
    norms = np.sqrt(np.einsum("rd,rd->r", flat, flat, dtype=np.float64))
    inverse = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    return 1.0 - pair_dots(flat, pairs) * inverse[pairs.i] * inverse[pairs.j]


def spearman_rho(signatures: np.ndarray, decode: np.ndarray, pairs: Pairs | None = None) -> float:
    """Eq. 1 by the book, in float64 with scipy's Spearman: the reference the fast paths are tested against."""
    pairs = pairs or calibration_pairs(signatures.shape[0])

    def distances(x: np.ndarray) -> np.ndarray:
        unit = l2_normalise(np.asarray(x, dtype=np.float64).reshape(x.shape[0], -1))
        return 1.0 - np.einsum("md,md->m", unit[pairs.i], unit[pairs.j])

    return float(spearmanr(distances(signatures), distances(decode)).statistic)


@dataclass(frozen=True, eq=False)
class DecodeTarget:
    """The decode side of ρ, computed once: pair distances of decode patterns and their centred ranks."""

    pairs: Pairs
    distances: np.ndarray
    centred_ranks: np.ndarray
    norm: float


def decode_target(decode: np.ndarray, pairs: Pairs) -> DecodeTarget:
    """Decode patterns [R, ...] (flattened per request) -> the ρ target over `pairs`."""
    distances = pair_cosine_distances(decode, pairs)
    ranks = rankdata(distances)
    centred = ranks - ranks.mean()
    return DecodeTarget(pairs, distances, centred, float(np.linalg.norm(centred)))


def _spearman_rows(values: np.ndarray, target: DecodeTarget) -> np.ndarray:
    """Spearman of every row of values [C, M] with the target; NaN where a row is constant.

    Spearman is the Pearson correlation of average ranks. The target's ranks are centred, so
    Σ (r − r̄) t = Σ r t, summed in sorted order without scattering ranks back. Tied values get the average
    of their positions (run boundaries found on the sorted rows, all rows at once); without ties the ranks
    are 1..M in sorted order and the sum is one matrix-vector product.
    """
    rows, m = values.shape
    order = np.argsort(values, axis=1)
    ordered = np.take_along_axis(values, order, axis=1)
    target_sorted = target.centred_ranks[order]
    ties = ordered[:, 1:] == ordered[:, :-1]
    mean_rank = (m + 1) / 2.0
    if not ties.any():
        covariance = target_sorted @ np.arange(1.0, m + 1.0)
        spread = np.full(rows, np.sqrt(m * (m * m - 1) / 12.0))
    else:  # runs never cross rows: every row's first position starts a run
        starts_run = np.ones((rows, m), dtype=bool)
        np.logical_not(ties, out=starts_run[:, 1:])
        first = np.flatnonzero(starts_run)
        length = np.diff(np.append(first, starts_run.size))
        ranks = np.repeat(first % m + (length + 1) / 2.0, length).reshape(rows, m)
        covariance = np.einsum("cm,cm->c", ranks, target_sorted)
        spread = np.sqrt(np.maximum(np.einsum("cm,cm->c", ranks, ranks) - m * mean_rank**2, 0.0))
    spread *= target.norm
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(spread > 1e-9, covariance / spread, np.nan)


def rho_of_distances(distances: np.ndarray, target: DecodeTarget) -> float:
    """ρ of precomputed signature pair distances [M] against the decode target."""
    return float(_spearman_rows(distances[None, :], target)[0])


def rho(signatures: np.ndarray, target: DecodeTarget) -> float:
    """ρ of signatures [R, ...] (normalised or not: cosine ignores scale) against the decode target."""
    return rho_of_distances(pair_cosine_distances(signatures, target.pairs), target)


def rho_sampling_error(distances: np.ndarray, target: DecodeTarget, groups: int = 8, seed: int = 0) -> float | None:
    """Standard error of a subsampled ρ against the all-pairs ρ; None when every pair was used.

    The sampled pairs are split into `groups` disjoint random subsets; the spread of their ρ, scaled by
    1/sqrt(groups), estimates the error of ρ over all M sampled pairs.
    """
    if target.pairs.exhaustive:
        return None
    parts = np.array_split(np.random.default_rng(seed).permutation(distances.size), groups)
    values = np.array([spearmanr(distances[p], target.distances[p]).statistic for p in parts])
    return float(values.std(ddof=1) / np.sqrt(groups))


# ----- layer mask -----


def _layer_terms(feature: np.ndarray, pairs: Pairs) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer pair dot products [L, M] (float32) and squared row norms [L, R] of features [R, L, E]."""
    by_layer = np.ascontiguousarray(feature.transpose(1, 0, 2), dtype=np.float32)
    dots = np.stack([pair_dots(rows, pairs).astype(np.float32) for rows in by_layer])
    squares = np.einsum("lre,lre->lr", by_layer, by_layer, dtype=np.float64)
    return dots, squares


def _cosine_distances(dots: np.ndarray, squares: np.ndarray, pairs: Pairs) -> np.ndarray:
    """Pair distances [C, M] (float32) from summed dot products [C, M] and summed squared norms [C, R].

    float32 halves the memory traffic of the [candidates, pairs] arrays, the cost of the layer search.
    """
    inverse = np.zeros(squares.shape, dtype=np.float32)
    np.divide(1.0, np.sqrt(squares), out=inverse, where=squares > 0, casting="unsafe")
    distances = dots.astype(np.float32)  # a copy: the caller's sums stay intact
    distances *= inverse[:, pairs.i]
    distances *= inverse[:, pairs.j]
    return np.subtract(1.0, distances, out=distances)


@dataclass(frozen=True, eq=False)
class LayerSearch:
    """Greedy forward selection: `order[:n]` is the best n-layer mask found, `rho[n - 1]` its ρ."""

    order: np.ndarray
    rho: np.ndarray

    def best_size(self, tolerance: float = 0.0) -> int:
        """The smallest n whose ρ is within `tolerance` of the peak (the seed's N*)."""
        peak = np.nanmax(self.rho)
        return int(np.flatnonzero(self.rho >= peak - tolerance)[0]) + 1

    def mask(self, tolerance: float = 0.0) -> np.ndarray:
        """The chosen layers in model order."""
        return np.sort(self.order[: self.best_size(tolerance)])


def greedy_layer_search(feature: np.ndarray, target: DecodeTarget, max_layers: int | None = None) -> LayerSearch:
    """Add, one at a time, the layer whose addition gives the highest ρ; features [R, L, E]."""
    dots, squares = _layer_terms(feature, target.pairs)
    layers = feature.shape[1]
    steps = layers if max_layers is None else min(max_layers, layers)
    chosen: list[int] = []
    curve: list[float] = []
    remaining = np.ones(layers, dtype=bool)
    dot_sum = np.zeros(dots.shape[1], dtype=np.float32)
    square_sum = np.zeros(squares.shape[1])
    for _ in range(steps):
        candidates = np.flatnonzero(remaining)
        distances = _cosine_distances(dot_sum + dots[candidates], square_sum + squares[candidates], target.pairs)
        scores = np.nan_to_num(_spearman_rows(distances, target), nan=-np.inf)
        best = int(np.argmax(scores))
        layer = int(candidates[best])
        chosen.append(layer)
        curve.append(float(scores[best]) if np.isfinite(scores[best]) else np.nan)
        remaining[layer] = False
        dot_sum += dots[layer]
        square_sum += squares[layer]
    return LayerSearch(np.array(chosen, dtype=np.int64), np.array(curve))


def rho_along(feature: np.ndarray, target: DecodeTarget, order: np.ndarray) -> np.ndarray:
    """ρ of every prefix of a layer order: [len(order)]; e.g. a greedy order replayed on held-out requests."""
    order = np.asarray(order, dtype=np.intp)
    dots, squares = _layer_terms(feature[:, order, :], target.pairs)
    distances = _cosine_distances(np.cumsum(dots, axis=0), np.cumsum(squares, axis=0), target.pairs)
    return _spearman_rows(distances, target)
