"""Online scoring: similarities against a reference, the τ-band and least-loaded pick, input checks."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.solver.eldr_fit import fit_routing_artifact
from switchyard.solver.representations import features, idf_weights, signature_vectors
from switchyard.solver.scoring import ScoringError, SignatureScorer
from switchyard.solver.signatures import RequestCounts

MASK = [1, 3, 4]


def _scorer(representation: str, rng: np.random.Generator) -> tuple[SignatureScorer, np.ndarray]:
    calibration = rng.poisson(2.0, (30, 6, 8))
    idf = idf_weights(calibration)[MASK] if representation == "count_idf" else np.ones((3, 8))
    centroids = rng.random((5, 24))
    return SignatureScorer(MASK, idf, centroids, num_layers=6, representation=representation), idf


@pytest.mark.parametrize("representation", ["count", "count_idf", "binary"])
def test_similarities_equal_cosine_of_the_fit_time_signature(representation: str) -> None:
    rng = np.random.default_rng(0)
    scorer, idf = _scorer(representation, rng)
    counts = rng.poisson(1.0, (4, 6, 8)).astype(np.uint16)
    full_idf = np.ones((6, 8))
    full_idf[MASK] = idf
    reference = signature_vectors(features(representation, counts, full_idf), MASK) @ (
        scorer._centroids.T  # unit centroids
    )
    for r in range(4):
        np.testing.assert_allclose(scorer.similarities(counts[r]), reference[r], rtol=1e-5, atol=1e-6)
        # the same signature sent as only the masked rows, or in another row order
        np.testing.assert_allclose(scorer.similarities(counts[r][MASK], layers=MASK), reference[r], rtol=1e-5)
        shuffled = [4, 0, 3, 1]
        np.testing.assert_allclose(scorer.similarities(counts[r][shuffled], layers=shuffled), reference[r], rtol=1e-5)
    np.testing.assert_allclose(scorer.similarities_batch(counts), reference, rtol=1e-5, atol=1e-6)


def test_scorer_from_a_fitted_artifact_sends_calibration_requests_to_their_own_cluster() -> None:
    rng = np.random.default_rng(1)
    domain = np.repeat([0, 1, 2], 20)
    rate = (rng.random((3, 4, 12)) ** 4)[domain] * 10
    counts = RequestCounts(prefill=rng.poisson(rate), decode=rng.poisson(rate), top_k=1)
    artifact, report = fit_routing_artifact(counts, 3)
    scorer = SignatureScorer.from_artifact(artifact)
    sims = scorer.similarities_batch(counts.prefill)
    # well-separated equal-size domains: balanced clusters are the domains, and τ = 0 routes home
    clusters = [np.bincount(sims[domain == d].argmax(axis=1), minlength=3).argmax() for d in range(3)]
    assert sorted(clusters) == [0, 1, 2]
    assert report["cluster_sizes"] == [20, 20, 20]


@pytest.mark.parametrize(
    ("counts", "layers", "message"),
    [
        (np.zeros((5, 8), np.uint16), None, "needs 6"),
        (np.zeros((6, 7), np.uint16), None, r"\[layers, 8\]"),
        (np.zeros((3, 8), np.uint16), [1, 3], "2 layers listed"),
        (np.zeros((2, 8), np.uint16), [1, 3], "lacks the artifact's masked layers \\[4\\]"),
        (np.zeros((2, 8), np.uint16), [1, 9], "must lie in"),
        (-np.ones((6, 8), np.int32), None, "non-negative"),
        (np.zeros((6, 8), np.float32), None, "integers"),
    ],
)
def test_bad_signatures_raise_scoring_errors(counts: np.ndarray, layers: list[int] | None, message: str) -> None:
    scorer, _ = _scorer("count", np.random.default_rng(2))
    with pytest.raises(ScoringError, match=message):
        scorer.similarities(counts, layers)


def test_bad_artifacts_are_refused() -> None:
    with pytest.raises(ScoringError, match="gate_prob"):
        SignatureScorer([0], np.ones((1, 2)), np.ones((2, 2)), num_layers=1, representation="gate_prob")
    with pytest.raises(ScoringError, match="layer mask"):
        SignatureScorer([2], np.ones((1, 2)), np.ones((2, 2)), num_layers=2)
    with pytest.raises(ScoringError, match="centroids"):
        SignatureScorer([0], np.ones((1, 2)), np.ones((2, 3)), num_layers=1)
