"""The migration planner: ordered per-layer steps, their rollback, and placement rows (pure, property-tested)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.services.history import layout_from_rows, layout_rows
from switchyard.services.migration.planner import inverse_moves, plan_steps, rollback_steps
from switchyard.solver.placement import PlacementError, contiguous_slots
from switchyard.solver.placement.layouts import current_layout, default_layout, default_layout_like
from switchyard.solver.placement.moves import apply_moves


def test_default_layout_is_contiguous_like_vllm() -> None:
    assert default_layout(2, 6, 2)[1].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert default_layout(1, 5, 2, slots_per_gpu=4)[0].tolist() == [[0, 1, 2, -1], [3, 4, -1, -1]]
    np.testing.assert_array_equal(default_layout(3, 10, 4, 3), contiguous_slots(3, 10, 4, 3))
    np.testing.assert_array_equal(default_layout_like(default_layout(2, 6, 2)[:, ::-1]), default_layout(2, 6, 2))


def test_the_current_layout_is_the_engines_then_the_applied_then_the_default() -> None:
    """One rule for the placement and the migration service: engines' report, applied placement, default."""
    engines, applied = default_layout(2, 4, 2)[:, ::-1].copy(), default_layout(2, 4, 2)[:, :, ::-1].copy()
    built: list[int] = []

    def default() -> np.ndarray:
        built.append(1)
        return default_layout(2, 4, 2)

    assert current_layout(engines, applied, default)[1] == "engines"
    assert current_layout(engines, None, default, shape=(2, 2))[0] is engines
    assert current_layout(None, applied, default)[0] is applied
    assert not built  # the default is only built when needed
    assert current_layout(engines, applied, default, shape=(2, 3))[1] == "database"  # another group size: not theirs
    layout, source = current_layout(engines[:1], None, default, shape=(2, 2))
    assert source == "default" and built == [1]
    np.testing.assert_array_equal(layout, default_layout(2, 4, 2))


def test_rows_round_trip() -> None:
    layout = default_layout(2, 5, 2, slots_per_gpu=3)
    rows = [(r["layer"], r["gpu"], r["slot"], r["expert"]) for r in layout_rows(layout)]
    np.testing.assert_array_equal(layout_from_rows(rows, layout.shape), layout)


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """A current and a target layout of one group: the same experts, rearranged, maybe with spare slots."""
    layers = draw(st.integers(1, 3))
    gpus = draw(st.integers(1, 4))
    slots = draw(st.integers(1, 4))
    experts = draw(st.integers(max(1, gpus * slots - gpus), gpus * slots))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def one() -> np.ndarray:
        layout = np.full((layers, gpus * slots), -1, dtype=np.int32)
        for layer in range(layers):
            layout[layer, rng.permutation(gpus * slots)[:experts]] = np.arange(experts)
        return layout.reshape(layers, gpus, slots)

    return one(), one()


@settings(max_examples=150, deadline=None)
@given(pair=layout_pairs())
def test_steps_reach_the_target_one_layer_at_a_time(pair: tuple[np.ndarray, np.ndarray]) -> None:
    current, target = pair
    steps = plan_steps(current, target)
    state = current
    for step in steps:
        assert step.dtype == np.int32 and len(set(step[:, 0].tolist())) == 1  # one layer per step
        state = apply_moves(state, step, buffer=True)  # checks every move, and that the buffer ends empty
    np.testing.assert_array_equal(state, target)
    assert len({int(s[0, 0]) for s in steps}) == len(steps)  # each layer at most once


@settings(max_examples=150, deadline=None)
@given(pair=layout_pairs(), cut=st.integers(0, 4))
def test_rolling_back_any_prefix_restores_the_base(pair: tuple[np.ndarray, np.ndarray], cut: int) -> None:
    base, target = pair
    applied = plan_steps(base, target)[:cut]
    state = base
    for step in applied:
        state = apply_moves(state, step, buffer=True)
    for inverse in rollback_steps(applied):
        state = apply_moves(state, inverse, buffer=True)
    np.testing.assert_array_equal(state, base)


def test_inverse_moves_turn_copies_into_drops_and_back() -> None:
    moves = np.array([[0, 3, 0, 1, 1, 0], [0, 5, -1, -1, 0, 1], [0, 7, 1, 1, -1, -1]])
    assert inverse_moves(moves).tolist() == [[0, 7, -1, -1, 1, 1], [0, 5, 0, 1, -1, -1], [0, 3, 1, 0, 0, 1]]


def test_a_layout_missing_an_expert_cannot_be_planned() -> None:
    current = default_layout(1, 4, 2)
    target = current.copy()
    target[0, 1, 1] = -1
    with pytest.raises(PlacementError, match="every expert"):
        plan_steps(current, target)
