"""The offline fit end to end: on the real ESFT trace, on constructed calibration sets, and its errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from switchyard.shared.artifact_hash import artifact_content_hash
from switchyard.shared.codec import decode, encode
from switchyard.shared.schemas import RoutingArtifact
from switchyard.shared.trace_files import load_trace
from switchyard.solver.eldr_fit import FitError, FitOptions, fit_routing_artifact
from switchyard.solver.signatures import RequestCounts
from tests.eldr_helpers import ESFT_DIR


@pytest.fixture(scope="module")
def esft_fit() -> tuple[RoutingArtifact, dict]:
    return fit_routing_artifact(load_trace(ESFT_DIR), 8, FitOptions(compare_vanilla=True), created_at=1.0)


def test_esft_fit_produces_a_valid_artifact_and_a_complete_report(esft_fit: tuple[RoutingArtifact, dict]) -> None:
    artifact, report = esft_fit
    assert decode(encode(artifact), RoutingArtifact).content_hash == artifact.content_hash
    assert artifact_content_hash(artifact) == artifact.content_hash
    assert (artifact.model.num_layers, artifact.model.num_experts, artifact.model.top_k) == (26, 64, 6)
    assert artifact.centroids.shape == (8, len(artifact.layer_mask) * 64)
    np.testing.assert_allclose(np.linalg.norm(artifact.centroids, axis=1), 1.0, rtol=1e-5)
    assert set(report["rho"]) == {"count", "count_idf", "binary", "gate_prob"}
    assert report["representation"] == max(("count", "count_idf", "binary"), key=report["rho"].get)
    assert len(report["rho_by_num_layers"]) == 26 and len(report["rho_by_num_layers_holdout"]) == 26
    assert report["rho_selected"] == pytest.approx(max(report["rho_by_num_layers"]), abs=1e-4)
    assert artifact.rho == pytest.approx(report["rho_selected"])
    assert max(report["cluster_sizes"]) <= report["capacity"] == -(-213 // 8)
    assert sum(report["cluster_sizes"]) == sum(report["cluster_sizes_vanilla"]) == 213
    assert np.array(report["label_mix"]["per_cluster"]).sum() == 213
    assert report["num_search"] + report["num_holdout"] == 213
    json.dumps(report, allow_nan=False)  # the CLI prints it as strict JSON


def _counts(rng: np.random.Generator, requests: int = 60, layers: int = 4, experts: int = 10) -> RequestCounts:
    """Three domains with distinct expert preferences; decode follows prefill's domain."""
    domain = rng.integers(0, 3, requests)
    preference = rng.random((3, layers, experts)) ** 3
    rate = preference[domain] * 8
    return RequestCounts(
        prefill=rng.poisson(rate), decode=rng.poisson(rate), top_k=1, label=domain, label_names=("a", "b", "c")
    )


def test_fit_is_deterministic_and_the_hash_tracks_routing_content() -> None:
    counts = _counts(np.random.default_rng(0))
    a1, r1 = fit_routing_artifact(counts, 3, created_at=5.0)
    a2, _ = fit_routing_artifact(counts, 3, created_at=6.0)
    assert a1.content_hash == a2.content_hash  # time does not change what routing depends on
    np.testing.assert_array_equal(a1.centroids, a2.centroids)
    a3, _ = fit_routing_artifact(counts, 3, FitOptions(tau=0.2), created_at=5.0)
    assert a3.content_hash != a1.content_hash
    assert r1["rho"]["count"] > 0.3 and "gate_prob" not in r1["rho"]


def test_rho_is_one_when_prefill_equals_decode() -> None:
    counts = _counts(np.random.default_rng(1))
    same = RequestCounts(prefill=counts.prefill, decode=counts.prefill, top_k=1)
    _, report = fit_routing_artifact(same, 3, FitOptions(representation="count", layer_mask=(0, 1, 2, 3)))
    assert report["rho"]["count"] == pytest.approx(1.0)
    assert report["rho_selected"] == pytest.approx(1.0)


def test_options_are_honoured() -> None:
    counts = _counts(np.random.default_rng(2))
    artifact, report = fit_routing_artifact(
        counts, 4, FitOptions(representation="binary", layer_mask=(3, 1), holdout_fraction=0.0, max_pairs=100)
    )
    assert artifact.representation == "binary" and artifact.layer_mask == [1, 3]
    np.testing.assert_array_equal(artifact.idf, np.ones((2, 10)))  # binary applies no IDF
    assert report["rho_by_num_layers"] is None and report["num_holdout"] == 0
    assert report["pairs"]["search"] == 100 and report["rho_sampling_error"]["binary"] is not None
    idf_artifact, _ = fit_routing_artifact(counts, 4, FitOptions(representation="count_idf"))
    assert not np.allclose(idf_artifact.idf, 1.0)


def test_requests_without_prefill_or_decode_are_dropped_and_counted() -> None:
    counts = _counts(np.random.default_rng(3))
    decode = counts.decode.copy()
    decode[:5] = 0
    _, report = fit_routing_artifact(RequestCounts(prefill=counts.prefill, decode=decode, top_k=1), 3)
    assert report["dropped_requests"] == 5 and report["num_requests"] == 55


@pytest.mark.parametrize(
    ("decoders", "options", "message"),
    [
        (61, FitOptions(), "usable calibration requests"),
        (0, FitOptions(), "at least one decoder"),
        (3, FitOptions(layer_mask=(0, 4)), "layer mask"),
        (3, FitOptions(layer_mask=(1, 1)), "layer mask"),
        (3, FitOptions(tau=3.0), "tau"),
        (3, FitOptions(representation="gate_prob"), "representation"),  # type: ignore[arg-type]
        (3, FitOptions(holdout_fraction=1.0), "holdout"),
    ],
)
def test_bad_fits_are_refused_with_a_reason(decoders: int, options: FitOptions, message: str) -> None:
    with pytest.raises(FitError, match=message):
        fit_routing_artifact(_counts(np.random.default_rng(4)), decoders, options)


def test_identical_signatures_give_an_error_not_a_nan_artifact() -> None:
    ones = np.ones((10, 2, 4), dtype=np.int64)
    with pytest.raises(FitError, match="undefined"):
        fit_routing_artifact(RequestCounts(prefill=ones, decode=ones, top_k=1), 2)
