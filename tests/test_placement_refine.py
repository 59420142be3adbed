"""Swap refinement and the online placement: never worse, a true 2-swap local optimum, copies kept."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.solver.placement import (
    GreedyParams,
    PlacementProblem,
    check_slot_map,
    greedy,
    hosts_from_slots,
    objective,
    place,
    refine_swaps,
)
from tests.placement_cases import random_problem


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    experts=st.integers(2, 12),
    gpus=st.integers(2, 4),
    spare=st.integers(0, 2),
    redundant=st.integers(0, 3),
)
def test_refinement_never_worsens_a_layer_and_keeps_copies_and_capacity(seed, experts, gpus, spare, redundant):
    rng = np.random.default_rng(seed)
    redundant = min(redundant, experts * (gpus - 1))
    problem = random_problem(
        rng, layers=2, experts=experts, gpus=gpus, spare_slots=spare, redundant=redundant, migration=0.02
    )
    start = greedy(problem, GreedyParams(0.0, 1.0, 0.0))  # load-only: room to improve comm and migration
    refined, _ = refine_swaps(problem, start)
    check_slot_map(refined, 2, experts, gpus)  # still one copy per GPU at most, every expert placed
    assert (hosts_from_slots(refined, experts).sum(axis=2) == hosts_from_slots(start, experts).sum(axis=2)).all()
    assert (objective(problem, refined).per_layer <= objective(problem, start).per_layer + 1e-12).all()


def test_at_convergence_no_single_swap_or_relocation_improves() -> None:
    rng = np.random.default_rng(4)
    for _ in range(5):
        problem = random_problem(rng, layers=1, experts=7, gpus=3, sources=3, spare_slots=1, migration=0.03)
        refined, rounds = refine_swaps(problem, greedy(problem), max_rounds=1000)
        assert rounds < 1000
        best = objective(problem, refined).total
        slots = [(g, s) for g in range(3) for s in range(problem.slots_per_gpu)]
        for (h, s), (g, t) in itertools.combinations(slots, 2):
            if h == g:
                continue
            trial = refined.copy()
            trial[0, h, s], trial[0, g, t] = refined[0, g, t], refined[0, h, s]
            assert objective(problem, trial).total >= best - 1e-9


def test_online_placement_is_no_worse_than_either_refined_start_in_any_layer() -> None:
    problem = random_problem(np.random.default_rng(5), layers=6, experts=24, gpus=4, sources=4, migration=0.01)
    online = place(problem)
    from_greedy = objective(problem, refine_swaps(problem, greedy(problem))[0]).per_layer
    from_current = objective(problem, refine_swaps(problem, problem.current)[0]).per_layer
    found = objective(problem, online).per_layer
    assert (found <= np.minimum(from_greedy, from_current) + 1e-12).all()
    assert (found <= objective(problem, greedy(problem)).per_layer + 1e-12).all()


def test_refinement_pulls_traffic_local_from_a_load_only_layout() -> None:
    experts, gpus = 16, 4
    counts = np.zeros((2, 2, experts))
    counts[:, 0, :8] = 1.0 + np.arange(8) / 16
    counts[:, 1, 8:] = 1.0 + np.arange(8) / 16
    distance = (np.arange(2)[:, None] != np.arange(gpus)[None, :] // 2).astype(float)
    problem = PlacementProblem.from_counts(counts, gpus, 4, distance=distance)
    start = greedy(problem, GreedyParams(0.0, 1.0, 0.0))
    refined, _ = refine_swaps(problem, start)
    assert objective(problem, start).comm.sum() > 1.0
    assert objective(problem, refined).comm.sum() == pytest.approx(0.0)  # both sources' experts at home
