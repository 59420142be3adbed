"""Moves: the diff of two slot maps, executed in order, reaches the target without breaking an invariant."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.shared.schemas import MOVE_COLUMNS, PlacementPlan
from switchyard.solver.placement import PlacementProblem, contiguous_slots, greedy, hosts_from_slots
from switchyard.solver.placement.moves import MoveError, apply_moves, plan_moves
from tests.placement_cases import random_current


def random_layout(rng: np.random.Generator, layers: int, experts: int, gpus: int, slots: int, copies: int):
    """A random valid slot map with `copies` extra replicas (placed by the greedy on random loads)."""
    problem = PlacementProblem(
        load=rng.gamma(0.5, 1.0, (layers, experts)), num_gpus=gpus, slots_per_gpu=slots, redundant_slots=copies
    )
    layout = greedy(problem)[:, rng.permutation(gpus)]
    return np.take_along_axis(layout, np.argsort(rng.random(layout.shape), axis=2), axis=2)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    experts=st.integers(1, 10),
    gpus=st.integers(1, 4),
    spare=st.integers(0, 2),
    copies_now=st.integers(0, 3),
    copies_then=st.integers(0, 3),
)
def test_the_moves_reach_the_target_one_safe_step_at_a_time(seed, experts, gpus, spare, copies_now, copies_then):
    rng = np.random.default_rng(seed)
    slots = -(-experts // gpus) + spare
    room = min(gpus * slots - experts, experts * (gpus - 1))
    current = random_layout(rng, 2, experts, gpus, slots, min(copies_now, room))
    target = random_layout(rng, 2, experts, gpus, slots, min(copies_then, room))
    full = (current >= 0).all() or (target >= 0).all()
    moves = plan_moves(current, target, buffer=full)
    assert moves.shape[1] == len(MOVE_COLUMNS) and moves.dtype == np.int64
    # apply_moves checks every step: destination empty, source holds the expert, a copy always survives
    assert (apply_moves(current, moves, buffer=full) == target).all()


def test_no_moves_between_equal_placements() -> None:
    layout = contiguous_slots(3, 8, 2, 4)
    assert plan_moves(layout, layout).shape == (0, 6)


def test_one_move_per_expert_that_changes_gpu_when_a_slot_is_free() -> None:
    rng = np.random.default_rng(1)
    current = random_current(rng, 4, 12, 4, 4)  # 16 slots, 12 experts: free slots everywhere
    target = random_current(rng, 4, 12, 4, 4)
    changed = (hosts_from_slots(current, 12) != hosts_from_slots(target, 12)).any(axis=2).sum()
    moves = plan_moves(current, target)
    # every changed expert moves once, plus at most one parking move per cycle, and none is a copy or drop
    assert changed <= len(moves) <= changed + 4 * 4
    assert (moves[:, 2] >= 0).all() and (moves[:, 4] >= 0).all()


def test_a_swap_in_a_full_layer_needs_a_scratch_slot() -> None:
    current = np.array([[[0, 1], [2, 3]]])
    target = np.array([[[0, 2], [1, 3]]])
    with pytest.raises(MoveError, match="buffer=True"):
        plan_moves(current, target)
    moves = plan_moves(current, target, buffer=True)
    assert len(moves) == 3 and (moves[:, [3, 5]] == 2).any()  # one hop through scratch slot 2
    assert (apply_moves(current, moves, buffer=True) == target).all()


def test_replicas_are_added_from_a_live_copy_and_dropped_only_while_another_lives() -> None:
    current = np.array([[[0, 1, -1], [2, 3, -1]]])
    target = np.array([[[0, 1, 3], [2, -1, -1]]])  # expert 3 moves; then add a replica of 0 below
    moves = plan_moves(current, target)
    assert (apply_moves(current, moves) == target).all()
    replicated = np.array([[[0, 1, 3], [2, 0, -1]]])
    add = plan_moves(target, replicated)
    assert add.tolist() == [[0, 0, -1, -1, 1, 1]]
    drop = plan_moves(replicated, target)
    assert drop.tolist() == [[0, 0, 1, 1, -1, -1]]


@pytest.mark.parametrize(
    ("move", "message"),
    [
        ([0, 0, 0, 0, 1, 1], "not empty"),  # would overwrite expert 3
        ([0, 1, 0, 0, 1, 2], "does not hold it"),
        ([0, 0, 0, 0, -1, -1], "last copy"),
        ([0, 4, -1, -1, 1, 2], "no live copy"),
        ([0, 0, 0, 0, 5, 0], "does not exist"),
        ([3, 0, 0, 0, 1, 2], "no such layer"),
    ],
)
def test_unsafe_moves_are_refused_with_the_reason(move: list[int], message: str) -> None:
    current = np.array([[[0, 1, -1], [2, 3, -1]]])
    with pytest.raises(MoveError, match=message):
        apply_moves(current, np.array([move]))


def test_moves_travel_in_a_placement_plan() -> None:
    rng = np.random.default_rng(2)
    current, target = random_current(rng, 2, 8, 2, 5), random_current(rng, 2, 8, 2, 5)
    plan = PlacementPlan(
        plan_id="p1",
        version=1,
        engine_group="g",
        created_at=0.0,
        source="greedy",
        gpus=["0", "1"],
        placement=target,
        moves=plan_moves(current, target),
        objective={"load": 0.0, "comm": 0.0, "mig": 0.0, "total": 0.0},
        params={"alpha": 1.0, "beta": 1.0, "gamma": 1.0},
    )
    assert (apply_moves(current, plan.moves) == plan.placement).all()


def test_mismatched_slot_maps_are_refused() -> None:
    with pytest.raises(MoveError, match="shape"):
        plan_moves(np.zeros((1, 2, 2), dtype=int), np.zeros((1, 2, 3), dtype=int))
    with pytest.raises(MoveError, match="every expert"):
        plan_moves(np.array([[[0, 1], [2, 3]]]), np.array([[[0, 1], [2, -1]]]))
