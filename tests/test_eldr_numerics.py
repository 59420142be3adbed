"""Representations, ρ and the layer search, K-means: hand-computed values and brute-force references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import spearmanr

from switchyard.solver.kmeans import balanced_assignment, kmeans_plus_plus, spherical_kmeans
from switchyard.solver.representations import features, idf_weights, l2_normalise, signature_vectors
from switchyard.solver.rho import (
    calibration_pairs,
    decode_target,
    greedy_layer_search,
    pair_cosine_distances,
    rho,
    rho_along,
    rho_of_distances,
    rho_sampling_error,
    spearman_rho,
)

# ----- representations -----


def test_idf_matches_the_seed_formula_by_hand() -> None:
    counts = np.array(
        [
            [[2, 0, 1]],
            [[5, 0, 0]],
            [[1, 3, 0]],
        ]
    )  # 3 requests, 1 layer, 3 experts: df = [3, 1, 1]
    np.testing.assert_allclose(idf_weights(counts), [[np.log(4 / 4), np.log(4 / 2), np.log(4 / 2)]])
    np.testing.assert_allclose(features("count_idf", counts, idf_weights(counts))[2], [[0.0, 3 * np.log(2), 0.0]])
    np.testing.assert_array_equal(features("binary", counts)[0], [[1, 0, 1]])
    with pytest.raises(ValueError, match="gate"):
        features("gate_prob", counts)


def test_l2_normalisation_by_hand_and_zero_rows_stay_zero() -> None:
    np.testing.assert_allclose(l2_normalise(np.array([[3.0, 4.0], [0.0, 0.0]])), [[0.6, 0.8], [0.0, 0.0]])
    x = np.array([[[3.0, 0.0], [9.0, 9.0], [0.0, 4.0]]])  # 1 request, 3 layers, 2 experts
    np.testing.assert_allclose(signature_vectors(x, [0, 2]), [[0.6, 0.0, 0.0, 0.8]])


# ----- rho -----


def test_rho_is_one_when_signatures_equal_decode_patterns() -> None:
    rng = np.random.default_rng(0)
    counts = rng.poisson(rng.random((30, 4, 16)) * 5)
    target = decode_target(counts, calibration_pairs(30))
    assert rho(counts, target) == pytest.approx(1.0)
    assert spearman_rho(counts, counts) == pytest.approx(1.0)
    shuffled = counts[np.random.default_rng(1).permutation(30)]
    assert abs(rho(shuffled, target)) < 0.3  # another request's pattern predicts nothing


@pytest.mark.parametrize("tied", [False, True])
def test_fast_spearman_equals_scipy_with_and_without_ties(tied: bool) -> None:
    rng = np.random.default_rng(1)
    sig = rng.integers(0, 3 if tied else 1000, size=(25, 6)).astype(float)
    dec = rng.integers(0, 3 if tied else 1000, size=(25, 6)).astype(float)
    pairs = calibration_pairs(25)
    a, b = pair_cosine_distances(sig, pairs), pair_cosine_distances(dec, pairs)
    assert tied == (len(np.unique(a)) < a.size)
    # The ranking (average ranks for ties) is exact: same distances, same ρ as scipy.
    expected = spearmanr(a, b).statistic
    assert rho_of_distances(a, decode_target(dec, pairs)) == pytest.approx(expected, abs=1e-12)
    # Distances come from a float32 Gram product: within 1e-6 of float64, which can break exact ties of
    # the float64 distances, so ρ agrees with the float64 reference to 1e-3 on heavily tied data.
    unit = l2_normalise(sig)
    np.testing.assert_allclose(a, 1 - np.einsum("md,md->m", unit[pairs.i], unit[pairs.j]), atol=1e-6)
    assert spearman_rho(sig, dec, pairs) == pytest.approx(expected, abs=1e-3 if tied else 1e-9)


def test_pairs_are_unique_ordered_and_subsampled_with_an_error_estimate() -> None:
    everything = calibration_pairs(50)
    assert everything.exhaustive and everything.size == 50 * 49 // 2
    some = calibration_pairs(50, max_pairs=600, seed=3)
    assert some.size == 600 and not some.exhaustive and (some.i < some.j).all()
    assert len(set(zip(some.i.tolist(), some.j.tolist(), strict=True))) == 600
    rng = np.random.default_rng(2)
    dec = rng.poisson(rng.random((50, 8)) * 4)
    sig = dec + rng.poisson(2.0, dec.shape)
    full = rho(sig, decode_target(dec, everything))
    target = decode_target(dec, some)
    distances = pair_cosine_distances(sig, some)
    error = rho_sampling_error(distances, target)
    assert rho_sampling_error(pair_cosine_distances(sig, everything), decode_target(dec, everything)) is None
    assert error is not None and 0 < error < 0.1
    assert abs(rho_of_distances(distances, target) - full) < 4 * error


def _layered(rng: np.random.Generator, informative: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefill counts whose layer `informative` is the decode pattern plus noise; other layers are noise."""
    decode = rng.poisson(rng.random((40, 1, 12)) * 6)
    prefill = rng.poisson(3.0, (40, 5, 12))
    prefill[:, informative] = decode[:, 0] + rng.poisson(0.3, (40, 12))
    return prefill.astype(float), decode


def test_greedy_layer_search_finds_the_informative_layer_and_its_curve_is_exact() -> None:
    rng = np.random.default_rng(4)
    prefill, decode = _layered(rng, informative=3)
    target = decode_target(decode, calibration_pairs(40))
    search = greedy_layer_search(prefill, target)
    assert search.order[0] == 3
    single = [rho(prefill[:, [layer]], target) for layer in range(5)]
    # Step 1 is the brute force over single layers; every later point is the ρ of that prefix of layers
    # (to float32 rounding of the per-layer products, which can reorder near-equal distances).
    assert search.rho[0] == pytest.approx(max(single), abs=1e-4)
    for n in range(1, 6):
        assert search.rho[n - 1] == pytest.approx(rho(signature_vectors(prefill, search.order[:n]), target), abs=1e-4)
    assert search.best_size() == int(np.argmax(search.rho)) + 1
    np.testing.assert_array_equal(search.mask(), np.sort(search.order[: search.best_size()]))
    assert search.best_size(tolerance=1.0) == 1
    np.testing.assert_allclose(rho_along(prefill, target, search.order), search.rho, atol=1e-4)


# ----- K-means -----


def _brute_force(similarity: np.ndarray, capacity: int, min_size: int) -> float:
    n, k = similarity.shape
    best = -np.inf
    for labels in itertools.product(range(k), repeat=n):
        sizes = np.bincount(labels, minlength=k)
        if sizes.max() <= capacity and sizes.min() >= min_size:
            best = max(best, similarity[np.arange(n), labels].sum())
    return best


@pytest.mark.parametrize(("n", "k", "seed"), [(6, 3, 0), (7, 3, 1), (7, 2, 2), (5, 4, 3), (8, 3, 4)])
def test_hungarian_balanced_assignment_equals_brute_force(n: int, k: int, seed: int) -> None:
    similarity = np.random.default_rng(seed).random((n, k))
    capacity = -(-n // k)
    for min_size in (0, 1):
        labels = balanced_assignment(similarity, capacity, min_size)
        sizes = np.bincount(labels, minlength=k)
        assert sizes.max() <= capacity and sizes.min() >= min_size
        assert similarity[np.arange(n), labels].sum() == pytest.approx(_brute_force(similarity, capacity, min_size))


def test_balanced_assignment_rejects_impossible_capacities() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        balanced_assignment(np.zeros((7, 2)), 3)
    with pytest.raises(ValueError, match="min_size"):
        balanced_assignment(np.zeros((3, 2)), 3, min_size=2)


def _skewed(rng: np.random.Generator, sizes: list[int], dim: int = 20) -> tuple[np.ndarray, np.ndarray]:
    centres = rng.random((len(sizes), dim)) ** 6
    truth = np.repeat(np.arange(len(sizes)), sizes)
    return centres[truth] + 0.02 * rng.random((truth.size, dim)), truth


@pytest.mark.parametrize(("n", "k"), [(100, 3), (101, 7), (50, 50), (9, 4), (31, 1), (213, 32)])
def test_balanced_kmeans_never_exceeds_the_cap_and_leaves_no_decoder_empty(n: int, k: int) -> None:
    rng = np.random.default_rng(n + k)
    x, _ = _skewed(rng, [n - n // 4 - n // 8, n // 4, n // 8] if n >= 8 else [n])
    clustering = spherical_kmeans(x, k, restarts=2, seed=1)
    assert clustering.sizes.max() <= -(-n // k)
    assert clustering.sizes.min() >= 1 and clustering.sizes.sum() == n
    np.testing.assert_allclose(np.linalg.norm(clustering.centroids, axis=1), 1.0, rtol=1e-5)


def test_vanilla_follows_dense_regions_and_balanced_caps_them() -> None:
    rng = np.random.default_rng(5)
    x, truth = _skewed(rng, [70, 20, 10])
    vanilla = spherical_kmeans(x, 3, balanced=False, seed=0)
    balanced = spherical_kmeans(x, 3, seed=0)
    # Vanilla recovers the natural clusters (one of 70 points), balanced splits them to at most 34 each.
    assert sorted(vanilla.sizes.tolist()) == [10, 20, 70]
    assert max(np.bincount(vanilla.labels[truth == t]).max() for t in range(3)) == np.bincount(truth).max()
    assert balanced.sizes.max() <= 34
    assert vanilla.objective > balanced.objective  # balance costs some similarity


def test_kmeans_plus_plus_seeds_are_distinct_even_for_duplicate_points() -> None:
    x = l2_normalise(np.ones((6, 3)))
    seeds = kmeans_plus_plus(x, 4, np.random.default_rng(0))
    assert len(set(seeds.tolist())) == 4
    with pytest.raises(ValueError, match="clusters"):
        spherical_kmeans(x, 7)
