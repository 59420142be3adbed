"""The placement service's pure parts: the decayed window, drift, and the publish/reject decision."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.shared.schemas import ExpertLoad
from switchyard.solver.placement import DEFAULT_PARAMS
from switchyard.solver.placement.layouts import default_layout
from switchyard.solver.placement.policy import Policy, decide, distance_matrix
from switchyard.solver.placement.window import DecayedLoad, drift


def _window(end: float, counts: list[list[int]], sources: np.ndarray | None = None, engine: str = "e0") -> ExpertLoad:
    return ExpertLoad(
        engine_id=engine,
        ep_group="g0",
        seq=0,
        window_start=end - 1.0,
        window_end=end,
        expert_counts=np.array(counts, dtype=np.uint32),
        source_counts=sources,
    )


def test_old_windows_fade_with_the_half_life() -> None:
    window = DecayedLoad(half_life_s=10.0)
    window.add(_window(100.0, [[8, 0]]))
    window.add(_window(110.0, [[0, 8]]))
    assert window.load.tolist() == [[4.0, 8.0]]
    window.add(_window(100.0, [[0, 4]], engine="e1"))  # late: faded by its own age instead
    assert window.load.tolist() == [[4.0, 10.0]]
    assert (window.start, window.end, window.windows, window.engines) == (99.0, 110.0, 3, {"e0", "e1"})
    window.add(_window(111.0, [[1, 1, 1]]))  # another model shape: start afresh
    assert window.load.tolist() == [[1.0, 1.0, 1.0]] and window.windows == 1


def test_source_counts_are_kept_only_while_every_window_has_them() -> None:
    window = DecayedLoad(half_life_s=10.0)
    window.add(_window(1.0, [[2, 1]], np.array([[[2, 0]], [[0, 1]]], dtype=np.uint32).reshape(1, 2, 2)))
    window.add(_window(1.0, [[1, 1]], np.ones((1, 3, 2), dtype=np.uint32)))  # a third source rank appears
    assert window.source_load.shape == (1, 3, 2) and window.source_load.sum() == 9
    window.add(_window(1.0, [[1, 1]]))
    assert window.source_load is None


def test_drift_is_total_variation() -> None:
    a = np.array([[0.5, 0.5, 0.0]])
    assert drift(a, a) == 0.0
    assert drift(a, np.array([[0.0, 0.0, 1.0]])) == 1.0
    assert drift(None, a) == 1.0


def _hot_first_gpu(layers: int = 2, experts: int = 8) -> np.ndarray:
    load = np.ones((layers, experts))
    load[:, : experts // 2] = 10.0  # every hot expert sits on GPU 0 of the contiguous layout
    return load


def test_an_imbalanced_group_gets_a_plan_worth_its_moves() -> None:
    current = default_layout(2, 8, 2)
    decision = decide(_hot_first_gpu(), None, None, current, DEFAULT_PARAMS, Policy())
    assert decision.publish and len(decision.moves) > 0
    assert decision.new["load"] < decision.current["load"]
    assert decision.improvement - decision.cost > decision.threshold
    assert "exceeds the threshold" in decision.reason
    hot = set(range(4))
    for layer in decision.placement:  # hot experts now split across both GPUs
        assert all(len(hot & set(gpu.tolist())) == 2 for gpu in layer)


def test_a_balanced_group_or_an_expensive_migration_is_left_alone() -> None:
    current = default_layout(2, 8, 2)
    balanced = decide(np.ones((2, 8)), None, None, current, DEFAULT_PARAMS, Policy())
    assert not balanced.publish and balanced.improvement == pytest.approx(0.0)  # reshuffles would gain nothing
    costly = decide(_hot_first_gpu(), None, None, current, DEFAULT_PARAMS, Policy(migration_cost=1e6))
    assert not costly.publish and costly.reason == "the greedy keeps the current placement"
    demanding = decide(_hot_first_gpu(), None, None, current, DEFAULT_PARAMS, Policy(gain_threshold=1.5))
    assert not demanding.publish and len(demanding.moves) and "does not exceed" in demanding.reason


def test_source_aware_placement_brings_experts_to_their_traffic() -> None:
    # Rank 0 (GPU 0) sends all its tokens to experts 4..7, which the contiguous layout puts on GPU 1.
    current = default_layout(1, 8, 2)
    source = np.zeros((1, 2, 8))
    source[0, 0, 4:] = 10.0
    source[0, 1, :4] = 10.0
    decision = decide(source.sum(axis=1), source, [0, 1], current, DEFAULT_PARAMS, Policy())
    assert decision.current["comm"] == pytest.approx(2.0)  # all traffic remote (canonical units: G x mean)
    assert decision.publish and decision.new["comm"] < decision.current["comm"]
    assert set(decision.placement[0, 0].tolist()) & {4, 5, 6, 7}  # some of rank 0's experts came to GPU 0
    assert distance_matrix(2, [0, None]).tolist() == [[0.0, 1.0], [1.0, 1.0]]
