"""Routing traces: canonical order, the npz format round trip, ESFT loading, phase and window splits, and
clear errors for every malformed input."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from switchyard.shared.routing_trace import RoutingTrace, TraceError, split_phases, split_windows
from switchyard.shared.trace_files import detect_format, load_esft, load_npz, load_trace, save_npz
from tests.eldr_helpers import ESFT_DIR, random_experts


def _trace(rng: np.random.Generator, lengths: list[int], layers: int = 3, experts: int = 8, k: int = 2) -> RoutingTrace:
    request = np.repeat(np.arange(len(lengths)), lengths)
    return RoutingTrace(
        experts=random_experts(rng, int(sum(lengths)), layers, experts, k), request=request, num_experts=experts
    )


def test_from_arrays_groups_interleaved_requests_and_keeps_their_token_order() -> None:
    experts = np.arange(6 * 1 * 1).reshape(6, 1, 1)
    trace = RoutingTrace.from_arrays(experts, np.array([7, 3, 7, 3, 3, 9]), num_experts=6)
    np.testing.assert_array_equal(trace.request, [0, 0, 0, 1, 1, 2])  # id 3 -> 0, 7 -> 1, 9 -> 2
    np.testing.assert_array_equal(trace.experts[:, 0, 0], [1, 3, 4, 0, 2, 5])
    np.testing.assert_array_equal(trace.positions(), [0, 1, 2, 0, 1, 0])
    assert trace.num_requests == 3


def test_npz_round_trip_keeps_every_field(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    base = _trace(rng, [3, 5, 2])
    trace = RoutingTrace(
        experts=base.experts,
        request=base.request,
        num_experts=8,
        phase=np.array([0, 0, 1, 0, 0, 0, 1, 1, 0, 1], dtype=np.uint8),
        label=np.repeat([1, 0, 1], [3, 5, 2]),
        label_names=("a", "b"),
        weights=rng.random(base.experts.shape).astype(np.float16),
        model_name="tiny",
    )
    save_npz(trace, tmp_path / "t.npz")
    back = load_npz(tmp_path / "t.npz")
    for name in ("experts", "request", "phase", "label", "weights"):
        np.testing.assert_array_equal(getattr(back, name), getattr(trace, name))
    assert (back.num_experts, back.label_names, back.model_name) == (8, ("a", "b"), "tiny")
    assert detect_format(tmp_path / "t.npz") == "npz"
    # A recorded phase is kept: the prefill fraction does not override it.
    np.testing.assert_array_equal(load_trace(tmp_path / "t.npz", prefill_fraction=0.9).phase, trace.phase)


def test_split_phases_matches_hand_computed_boundaries() -> None:
    trace = _trace(np.random.default_rng(2), [1, 2, 5, 10])
    half = split_phases(trace, 0.5).phase
    # floor(n/2) prefill tokens, at least one prefill and (n >= 2) one decode token.
    expected = [0] + [0, 1] + [0, 0, 1, 1, 1] + [0] * 5 + [1] * 5
    np.testing.assert_array_equal(half, expected)
    most = split_phases(trace, 0.95).phase
    np.testing.assert_array_equal(most, [0] + [0, 1] + [0, 0, 0, 0, 1] + [0] * 9 + [1])
    with pytest.raises(TraceError, match="strictly between"):
        split_phases(trace, 1.0)


def test_split_windows_cuts_consecutive_equal_windows_and_keeps_labels() -> None:
    rng = np.random.default_rng(3)
    base = _trace(rng, [10, 2, 7])
    labelled = RoutingTrace(base.experts, base.request, 8, label=np.repeat([2, 0, 1], [10, 2, 7]))
    windows = split_windows(labelled, 3)
    # 10 -> 3 windows (4, 3, 3); 2 -> 1 window; 7 -> 2 windows (4, 3).
    np.testing.assert_array_equal(windows.request_lengths(), [4, 3, 3, 2, 4, 3])
    np.testing.assert_array_equal(windows.request_labels(), [2, 2, 2, 0, 1, 1])
    np.testing.assert_array_equal(windows.experts, labelled.experts)
    with pytest.raises(TraceError, match="phases"):
        split_windows(split_phases(labelled, 0.5), 3)


def test_esft_loads_one_request_per_sequence_with_task_labels() -> None:
    trace = load_esft(ESFT_DIR)
    assert (trace.num_tokens, trace.num_layers, trace.top_k, trace.num_experts) == (33_279, 26, 6, 64)
    assert trace.label_names == ("intent", "law", "summary", "translation")
    np.testing.assert_array_equal(np.bincount(trace.request_labels()), [127, 33, 13, 40])
    assert trace.weights is not None and trace.phase is None
    assert detect_format(ESFT_DIR) == "esft"
    split = load_trace(ESFT_DIR, prefill_fraction=0.25)
    prefill = np.bincount(split.request, weights=split.phase == 0).astype(int)
    np.testing.assert_array_equal(prefill, np.maximum(np.floor(trace.request_lengths() * 0.25), 1))


def _write(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def _valid(**override: object) -> dict[str, object]:
    arrays: dict[str, object] = {
        "experts": np.array([[[0, 1]], [[2, 3]], [[1, 2]]]),
        "request": np.array([0, 0, 1]),
        "num_experts": np.array(4),
    }
    arrays.update(override)
    return {k: v for k, v in arrays.items() if v is not None}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"experts": None}, "missing array"),
        ({"num_experts": None}, "missing array"),
        ({"num_experts": np.array([4, 4])}, "integer scalar"),
        ({"num_experts": np.array(0)}, "positive integer"),
        ({"experts": np.array([[0, 1], [2, 3], [1, 2]])}, "3-D"),
        ({"experts": np.array([[[0.0, 1.0]], [[2.0, 3.0]], [[1.0, 2.0]]])}, "integer expert ids"),
        ({"experts": np.array([[[0, 4]], [[2, 3]], [[1, 2]]])}, r"range \[0, 4\]"),
        ({"experts": np.array([[[0, -1]], [[2, 3]], [[1, 2]]])}, "must lie in"),
        ({"experts": np.array([[[1, 1]], [[2, 3]], [[1, 2]]])}, "same expert twice"),
        ({"num_experts": np.array(1)}, "exceeds num_experts"),
        ({"request": np.array([0, 1])}, "tokens"),
        ({"request": np.array([0, -1, 1])}, "non-negative"),
        ({"phase": np.array([1, 0, 0])}, "decode back to prefill"),
        ({"phase": np.array([0, 2, 0])}, "0 \\(prefill\\) or 1"),
        ({"label": np.array([0, 1, 1])}, "label changes"),
        ({"label": np.array([0, 0, 2]), "label_names": np.array(["x", "y"])}, "has no name"),
        ({"label_names": np.array(["x"])}, "without label"),
        ({"weights": np.ones((3, 1, 3))}, "same shape"),
        ({"weights": -np.ones((3, 1, 2))}, "non-negative"),
        ({"weights": np.full((3, 1, 2), np.nan)}, "finite"),
    ],
)
def test_malformed_npz_traces_are_rejected_with_the_reason(
    tmp_path: Path, override: dict[str, object], message: str
) -> None:
    path = _write(tmp_path / "bad.npz", **_valid(**override))  # type: ignore[arg-type]
    with pytest.raises(TraceError, match=message):
        load_npz(path)


def test_unreadable_files_are_trace_errors(tmp_path: Path) -> None:
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(TraceError, match="not a readable"):
        load_trace(tmp_path / "junk.npz")
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "absent.npz")
    pickled = io.BytesIO()
    np.savez(pickled, **_valid(), label_names=np.array(["x", None], dtype=object))
    (tmp_path / "pickled.npz").write_bytes(pickled.getvalue())
    with pytest.raises(TraceError, match="pickle"):
        load_npz(tmp_path / "pickled.npz")
    with pytest.raises(TraceError, match="holds no"):
        load_trace(tmp_path, fmt="auto")
    with pytest.raises(TraceError, match="missing array"):
        load_esft(_write(tmp_path / "half.npz", task=np.zeros(3, np.int8)))
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(_write(tmp_path / "ok.npz", **_valid()), fmt="csv")  # type: ignore[arg-type]
