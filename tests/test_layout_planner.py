"""Expert layouts, atomic move batches and the migration planner (pure functions, property-tested)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.migration.planner import BufferTooSmall, plan_steps, rollback_steps, states_after
from shared.layout import (
    DST_GPU,
    LAYER,
    LayoutError,
    apply_moves,
    check_layout,
    default_layout,
    diff_moves,
    layout_from_rows,
    layout_rows,
)


def test_default_layout_is_contiguous_like_vllm() -> None:
    layout = default_layout(num_layers=2, num_experts=6, num_gpus=2)
    assert layout.shape == (2, 2, 3)
    assert layout[1].tolist() == [[0, 1, 2], [3, 4, 5]]
    padded = default_layout(1, 5, 2, slots_per_gpu=4)
    assert padded[0].tolist() == [[0, 1, 2, -1], [3, 4, -1, -1]]
    with pytest.raises(LayoutError, match="cannot hold"):
        default_layout(1, 9, 2, slots_per_gpu=4)


def test_check_layout_names_the_missing_expert() -> None:
    layout = default_layout(3, 4, 2)
    layout[2, 1, 1] = 0
    with pytest.raises(LayoutError, match=r"layer 2 does not hold experts \[3\]"):
        check_layout(layout, num_experts=4)


def test_a_swap_is_legal_in_one_batch_and_refused_when_the_source_is_wrong() -> None:
    layout = default_layout(1, 4, 2)
    swap = np.array([[0, 0, 0, 0, 1, 0], [0, 2, 1, 0, 0, 0]])
    assert apply_moves(layout, swap)[0].tolist() == [[2, 1], [0, 3]]
    with pytest.raises(LayoutError, match="source slot holds expert 0, not 3"):
        apply_moves(layout, np.array([[0, 3, 0, 0, 1, 1]]))
    assert layout[0].tolist() == [[0, 1], [2, 3]]  # untouched by the refused batch


def test_rows_round_trip() -> None:
    layout = default_layout(2, 5, 2, slots_per_gpu=3)
    rows = [(r["layer"], r["gpu"], r["slot"], r["expert"]) for r in layout_rows(layout)]
    np.testing.assert_array_equal(layout_from_rows(rows, layout.shape), layout)


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    """A current and a target layout of the same group: permutations of the experts plus replicas."""
    layers = draw(st.integers(1, 3))
    gpus = draw(st.integers(1, 4))
    slots = draw(st.integers(1, 4))
    experts = draw(st.integers(1, gpus * slots))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def one() -> np.ndarray:
        layout = np.full((layers, gpus, slots), -1, dtype=np.int32)
        for layer in range(layers):
            cells = rng.permutation(gpus * slots)
            extra = rng.integers(0, gpus * slots - experts + 1)  # replicas of random experts, then empty slots
            content = np.concatenate([np.arange(experts), rng.integers(0, experts, extra)])
            layout[layer].reshape(-1)[cells[: len(content)]] = content
        return layout

    return one(), one(), experts


@settings(max_examples=150, deadline=None)
@given(pair=layout_pairs(), buffer=st.one_of(st.none(), st.integers(1, 4)))
def test_steps_reach_the_target_and_stay_servable(pair: tuple[np.ndarray, np.ndarray, int], buffer: int | None) -> None:
    current, target, experts = pair
    try:
        steps = plan_steps(current, target, buffer)
    except BufferTooSmall:
        assert buffer is not None and buffer < current.shape[2]
        return
    states = states_after(current, steps)
    np.testing.assert_array_equal(states[-1] if states else current, target)
    for step, state in zip(steps, states, strict=True):
        assert len(set(step[:, LAYER].tolist())) == 1  # one layer per step
        check_layout(state, num_experts=experts)  # every expert still served between steps
        if buffer is not None:
            received = np.bincount(step[step[:, DST_GPU] >= 0, DST_GPU], minlength=current.shape[1])
            assert received.max(initial=0) <= buffer
    assert sum(len(s) for s in steps) == len(diff_moves(current, target))


@settings(max_examples=100, deadline=None)
@given(pair=layout_pairs(), cut=st.integers(0, 12))
def test_rolling_back_any_prefix_restores_the_base(pair: tuple[np.ndarray, np.ndarray, int], cut: int) -> None:
    base, target, _ = pair
    steps = plan_steps(base, target)
    applied = steps[: min(cut, len(steps))]
    state = states_after(base, applied)[-1] if applied else base
    for inverse in rollback_steps(base, applied):
        state = apply_moves(state, inverse)
    np.testing.assert_array_equal(state, base)


def test_a_long_chain_is_split_in_dependency_order() -> None:
    # One GPU, 4 slots: shift every expert one slot left (a chain ending in a free), buffer of 1.
    current = np.array([[[0, 1, 2, 3]]], dtype=np.int32)
    target = np.array([[[1, 2, 3, -1]]], dtype=np.int32)
    steps = plan_steps(current, target, buffer_slots=1)
    assert len(steps) == 3
    np.testing.assert_array_equal(states_after(current, steps)[-1], target)


def test_a_cycle_larger_than_the_buffer_is_a_clear_error() -> None:
    current = np.array([[[0, 1, 2]]], dtype=np.int32)
    target = np.array([[[1, 2, 0]]], dtype=np.int32)
    with pytest.raises(BufferTooSmall, match="needs 3 buffer slots on GPU 0"):
        plan_steps(current, target, buffer_slots=2)
