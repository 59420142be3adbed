"""The placement problem: validation, the two forms of a placement, canonical units."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.solver.placement import (
    PlacementError,
    PlacementProblem,
    check_slot_map,
    contiguous_slots,
    greedy,
    hosts_from_slots,
    locality_distance,
    objective,
    slots_from_hosts,
)
from tests.placement_cases import random_current, random_problem


def test_a_valid_problem_stores_read_only_float_arrays() -> None:
    problem = random_problem(np.random.default_rng(0))
    assert problem.load.dtype == np.float64 and not problem.load.flags.writeable
    assert problem.migration_cost.shape == problem.shape
    assert problem.comm_cost().shape == problem.shape


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"load": np.ones(8)}, "2 dimensions"),
        ({"load": -np.ones((2, 8))}, "non-negative"),
        ({"load": np.full((2, 8), np.nan)}, "finite"),
        ({"slots_per_gpu": 1}, "do not fit"),
        ({"num_gpus": 0}, ">= 1"),
        ({"slots_per_gpu": 2.5}, "integer"),
        ({"source_load": np.ones((2, 3, 8))}, "distance"),
        ({"source_load": np.ones((2, 2, 7)), "distance": np.zeros((2, 4))}, "is not [2, S, 8]"),
        ({"source_load": np.ones((2, 2, 8)), "distance": np.zeros((3, 4))}, "[S, G]"),
        ({"migration_cost": np.ones((3, 8, 4))}, "broadcast"),
        ({"migration_cost": -1.0}, "non-negative"),
        ({"redundant_slots": 30}, "redundant"),
    ],
)
def test_malformed_input_raises_a_typed_error_naming_the_problem(changes: dict, message: str) -> None:
    fields = {"load": np.ones((2, 8)), "num_gpus": 4, "slots_per_gpu": 2, **changes}
    with pytest.raises(PlacementError, match=message.replace("[", r"\[").replace("]", r"\]")):
        PlacementProblem(**fields)


def test_a_current_placement_must_hold_every_expert_once_per_gpu() -> None:
    good = contiguous_slots(1, 4, 2, 2)
    PlacementProblem(load=np.ones((1, 4)), num_gpus=2, slots_per_gpu=2, current=good)
    missing = good.copy()
    missing[0, 1, 1] = -1
    with pytest.raises(PlacementError, match="expert 3 has no slot"):
        PlacementProblem(load=np.ones((1, 4)), num_gpus=2, slots_per_gpu=2, current=missing)
    twice = np.array([[[0, 0, 1], [2, 3, -1]]])
    with pytest.raises(PlacementError, match="two slots"):
        check_slot_map(twice, 1, 4, 2)
    with pytest.raises(PlacementError, match="outside"):
        check_slot_map(np.array([[[0, 1], [2, 9]]]), 1, 4, 2)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), experts=st.integers(1, 12), gpus=st.integers(1, 4), spare=st.integers(0, 2))
def test_slots_from_hosts_round_trips_and_keeps_stayers_in_their_slots(seed, experts, gpus, spare) -> None:
    rng = np.random.default_rng(seed)
    slots = -(-experts // gpus) + spare
    current = random_current(rng, 2, experts, gpus, slots)
    target = random_current(rng, 2, experts, gpus, slots)
    hosts = hosts_from_slots(target, experts)
    aligned = slots_from_hosts(hosts, slots, current)
    assert (hosts_from_slots(aligned, experts) == hosts).all()
    stays = (current >= 0) & (
        hosts[np.arange(2)[:, None, None], np.maximum(current, 0), np.arange(gpus)[None, :, None]] > 0
    )
    assert (aligned[stays] == current[stays]).all()


def test_slots_from_hosts_refuses_an_overfull_gpu() -> None:
    hosts = np.zeros((1, 3, 2), dtype=bool)
    hosts[0, :, 0] = True
    with pytest.raises(PlacementError, match="GPU 0 hosts 3 experts in 2 slots"):
        slots_from_hosts(hosts, 2)


def test_canonical_units_make_the_placement_independent_of_window_length() -> None:
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 1000, (3, 2, 16))
    distance = locality_distance(np.arange(2), np.arange(4) // 2)
    short = PlacementProblem.from_counts(counts, 4, 4, distance=distance)
    long = PlacementProblem.from_counts(counts * 37, 4, 4, distance=distance)
    np.testing.assert_allclose(short.load.sum(axis=1), 4.0)  # mean GPU load is 1
    np.testing.assert_allclose(short.load, long.load)
    assert (greedy(short) == greedy(long)).all()


def test_from_counts_needs_a_distance_for_source_counts() -> None:
    with pytest.raises(PlacementError, match="distance"):
        PlacementProblem.from_counts(np.ones((2, 3, 8)), 4, 2)


def test_the_objective_of_the_current_placement_has_no_migration_cost() -> None:
    problem = random_problem(np.random.default_rng(5), migration=0.2)
    assert objective(problem, problem.current).mig.sum() == 0
    other = random_current(np.random.default_rng(6), *problem.shape[:2], problem.num_gpus, problem.slots_per_gpu)
    changed = (hosts_from_slots(other, problem.num_experts) != problem.current_hosts()).sum()
    assert objective(problem, other).mig.sum() == pytest.approx(0.2 * changed)


def test_interchangeable_gpus_are_those_no_term_tells_apart() -> None:
    rng = np.random.default_rng(1)
    fresh = random_problem(rng, gpus=4, sources=2, migration=0.0)
    assert fresh.interchangeable_gpus() == [[0, 1], [2, 3]]
    assert random_problem(rng, gpus=4, sources=2, migration=0.1).interchangeable_gpus() == []
