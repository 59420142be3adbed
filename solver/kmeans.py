"""Spherical K-means with one centroid per decoder, balanced (the seed's §4.3) or vanilla (its ablation).

Geometry is cosine: points and centroids are unit vectors, similarity is their dot product, a centroid is
its members' normalised mean. Balanced assignment caps every cluster at ⌈N/K⌉ members (and gives each at
least one, so no decoder is left without calibration requests); it is an exact min-cost assignment, solved
with the Hungarian algorithm (`scipy.optimize.linear_sum_assignment`) on an N × (K·cap) cost matrix in
which each centroid's column appears cap times.

Vanilla K-means lets dense regions absorb most points; the seed measures what that does to the tail
(+17.4 % P99 TPOT, Fig. 15), which is why the router uses the balanced variant.

Fitting, per restart: k-means++ seeding (cosine D² sampling), then cheap Lloyd iterations — argmax
assignment for vanilla (to convergence); for balanced, `warmup` iterations of a *priced* assignment,
argmax of similarity minus a per-cluster price raised while the cluster is over capacity (the Lagrange
multipliers of the capacity constraints), which is nearly balanced and costs a few argmaxes. The best
restart then gets exact balanced Lloyd iterations (Hungarian assignment, centroid update) until the
objective gains less than `tol`. Starting the Hungarian phase from nearly balanced centroids matters:
each solve costs ~30-80 ms at N = 1000, K = 24 there, against ~350 ms from unbalanced vanilla centroids,
and 2-4 solves suffice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from switchyard.solver.representations import l2_normalise

__all__ = ["Clustering", "balanced_assignment", "kmeans_plus_plus", "spherical_kmeans"]


@dataclass(frozen=True, eq=False)
class Clustering:
    """centroids [K, D] unit rows; labels [N]; objective = mean cosine similarity to the own centroid."""

    centroids: np.ndarray
    labels: np.ndarray
    objective: float
    iterations: int
    capacity: int | None

    @property
    def sizes(self) -> np.ndarray:
        return np.bincount(self.labels, minlength=self.centroids.shape[0])


def kmeans_plus_plus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of k seed points: the first uniform, each next with probability ∝ its cosine distance to the
    nearest seed so far (on the unit sphere |a − b|² = 2(1 − cos), so this is k-means++'s D² rule)."""
    n = x.shape[0]
    seeds = [int(rng.integers(n))]
    nearest = x @ x[seeds[0]]
    for _ in range(1, k):
        weight = np.clip(1.0 - nearest.astype(np.float64), 0.0, None)  # float64: rng.choice checks Σp = 1
        weight[seeds] = 0.0
        total = weight.sum()
        # If every point coincides with a seed, any unused one will do.
        pool, p = (n, weight / total) if total > 0 else (np.setdiff1d(np.arange(n), seeds), None)
        seed = int(rng.choice(pool, p=p))
        seeds.append(seed)
        np.maximum(nearest, x @ x[seed], out=nearest)
    return np.array(seeds)


def balanced_assignment(similarity: np.ndarray, capacity: int, min_size: int = 0) -> np.ndarray:
    """Labels maximising total similarity [N, K] with between `min_size` and `capacity` points per cluster.

    Exact: the Hungarian algorithm over the cluster columns repeated `capacity` times. The first `min_size`
    copies of every column get a bonus larger than any possible gain elsewhere, so an optimum fills them.
    """
    n, k = similarity.shape
    if capacity * k < n:
        raise ValueError(f"{k} clusters of capacity {capacity} cannot hold {n} points")
    if not 0 <= min_size <= capacity or min_size * k > n:
        raise ValueError(f"min_size {min_size} infeasible for {n} points in {k} clusters of capacity {capacity}")
    cost = np.repeat(-similarity.astype(np.float64), capacity, axis=1)
    if min_size:
        bonus = 1.0 + float(cost.max() - cost.min())
        cost.reshape(n, k, capacity)[:, :, :min_size] -= bonus
    rows, columns = linear_sum_assignment(cost)
    labels = np.empty(n, dtype=np.int64)
    labels[rows] = columns // capacity
    return labels


def _centroids(x: np.ndarray, labels: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """Normalised member means; a cluster without members keeps its previous centroid."""
    k = previous.shape[0]
    members = np.zeros((k, x.shape[0]), dtype=x.dtype)
    members[labels, np.arange(x.shape[0])] = 1.0
    sums = members @ x  # one BLAS product instead of a scatter-add
    empty = np.bincount(labels, minlength=k) == 0
    sums[empty] = previous[empty]
    return l2_normalise(sums)


def _priced_assignment(similarity: np.ndarray, capacity: int, rounds: int = 20) -> np.ndarray:
    """Nearly capacity-respecting labels: argmax of similarity minus per-cluster prices (a warm-up only).

    Prices rise for over-full clusters and fall (not below 0) for under-full ones, with a step shrinking
    as 1/t; an exact balanced assignment is the argmax at optimal prices, so this approaches it.
    """
    by_cluster = np.ascontiguousarray(similarity.T)  # [K, N]: argmax over axis 0 is the fast direction
    k = by_cluster.shape[0]
    price = np.zeros((k, 1), dtype=by_cluster.dtype)
    scale = 0.5 * float(by_cluster.max() - by_cluster.min())
    labels = by_cluster.argmax(axis=0)
    for step in range(1, rounds + 1):
        excess = np.bincount(labels, minlength=k) - capacity
        if (excess <= 0).all():
            break
        price = np.maximum(price + (scale / step) * (excess / capacity)[:, None], 0.0)
        labels = (by_cluster - price).argmax(axis=0)
    return labels


def _lloyd(
    x: np.ndarray, centroids: np.ndarray, assign: Callable[[np.ndarray], np.ndarray], max_iter: int
) -> tuple[np.ndarray, int]:
    """Lloyd iterations with the given assignment until the labels stop changing or `max_iter`.

    An emptied cluster is re-seeded at the worst-served point, so every restart keeps k live centroids.
    """
    n, k = x.shape[0], centroids.shape[0]
    labels = np.full(n, -1)
    for iteration in range(1, max_iter + 1):
        similarity = x @ centroids.T
        new = assign(similarity)
        empty = np.flatnonzero(np.bincount(new, minlength=k) == 0)
        if empty.size:
            worst = np.argsort(similarity[np.arange(n), new])[: empty.size]
            new[worst] = empty
        if (new == labels).all():
            return centroids, iteration
        labels = new
        centroids = _centroids(x, labels, centroids)
    return centroids, max_iter


def _objective(x: np.ndarray, centroids: np.ndarray, labels: np.ndarray) -> float:
    return float(np.einsum("nd,nd->n", x, centroids[labels]).mean())


def spherical_kmeans(
    x: np.ndarray,
    k: int,
    *,
    balanced: bool = True,
    restarts: int = 3,
    max_iter: int = 50,
    warmup: int = 8,
    tol: float = 5e-4,
    seed: int = 0,
) -> Clustering:
    """Cluster rows of x [N, D] (normalised here) into k cosine clusters; see the module docstring."""
    if x.ndim != 2:
        raise ValueError(f"points must be a 2-D array [N, D], got shape {x.shape}")
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"cannot make {k} clusters from {n} points")
    if restarts < 1 or max_iter < 1 or warmup < 1:
        raise ValueError("restarts, max_iter and warmup must be positive")
    x = l2_normalise(np.asarray(x, dtype=np.float32))
    rng = np.random.default_rng(seed)
    capacity = -(-n // k) if balanced else None
    rows = np.arange(n)

    def assign(similarity: np.ndarray) -> np.ndarray:
        return similarity.argmax(axis=1) if capacity is None else _priced_assignment(similarity, capacity)

    best: tuple[float, np.ndarray, int] | None = None
    for _ in range(restarts):
        seeds = x[kmeans_plus_plus(x, k, rng)]
        centroids, iterations = _lloyd(x, seeds, assign, max_iter if capacity is None else warmup)
        similarity = x @ centroids.T
        objective = float(similarity[rows, assign(similarity)].mean())
        if best is None or objective > best[0]:
            best = (objective, centroids, iterations)
    assert best is not None
    _, centroids, iterations = best
    if capacity is None:
        labels = (x @ centroids.T).argmax(axis=1)
    else:  # exact balanced Lloyd from the best restart; the centroids end as their members' mean
        previous = -np.inf
        for _ in range(max_iter):
            similarity = x @ centroids.T
            labels = balanced_assignment(similarity, capacity, min_size=1)
            objective = float(similarity[rows, labels].mean())
            centroids = _centroids(x, labels, centroids)
            iterations += 1
            if objective - previous <= tol * abs(objective):
                break
            previous = objective
    return Clustering(centroids, labels, _objective(x, centroids, labels), iterations, capacity)
