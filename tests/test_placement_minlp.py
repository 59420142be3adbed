"""The MINLP: optimal on instances small enough to enumerate, never worse than its hint, honest gap."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from switchyard.services.placement.recalibrate import per_layer_limit
from switchyard.solver.placement import (
    GreedyParams,
    MinlpCancelled,
    MinlpOptions,
    PlacementError,
    PlacementProblem,
    Weights,
    greedy_hosts,
    objective,
    objective_of_hosts,
    place,
    solve_minlp,
)
from switchyard.solver.placement.replication import replica_counts
from tests.placement_cases import random_problem

EXACT = MinlpOptions(time_limit_s=10.0, parallel_layers=1, relative_gap=0.0)


def brute_force(problem: PlacementProblem, copies: np.ndarray) -> float:
    """The optimum of a one-layer problem by enumerating every host set of every expert."""
    num_experts, num_gpus = problem.num_experts, problem.num_gpus
    choices = [list(itertools.combinations(range(num_gpus), int(c))) for c in copies[0]]
    best = np.inf
    for pick in itertools.product(*choices):
        hosts = np.zeros((1, num_experts, num_gpus), dtype=int)
        for expert, gpus in enumerate(pick):
            hosts[0, expert, list(gpus)] = 1
        if hosts[0].sum(axis=0).max() <= problem.slots_per_gpu:
            best = min(best, objective_of_hosts(problem, hosts).total)
    return best


@pytest.mark.parametrize(
    "case",
    [
        {"experts": 6, "gpus": 3, "sources": 3, "migration": 0.05},  # all three terms
        {"experts": 7, "gpus": 2, "sources": 2, "migration": 0.0, "spare_slots": 1},  # free slots
        {"experts": 6, "gpus": 3, "sources": 1, "migration": 0.0},  # interchangeable GPUs: symmetry breaking
        {"experts": 5, "gpus": 3, "sources": 2, "migration": 0.02, "redundant": 2, "spare_slots": 1},  # replicas
        {"experts": 6, "gpus": 3, "sources": 2, "migration": 0.0, "weights": Weights(load=1.0, comm=1.0, mig=1.0)},
    ],
)
def test_the_minlp_is_optimal_on_tiny_instances(case: dict) -> None:
    rng = np.random.default_rng(len(str(case)))
    for _ in range(3):
        problem = random_problem(rng, layers=1, **case)
        result = solve_minlp(problem, EXACT)
        copies = replica_counts(problem.load, problem.redundant_slots, problem.num_gpus)
        assert result.status == ("OPTIMAL",)
        # loads are floats here, so the model is exact only up to its quantisation (1/65536 of a layer)
        assert objective(problem, result.slot_map).total == pytest.approx(brute_force(problem, copies), rel=1e-3)


def test_integer_loads_are_solved_exactly() -> None:
    rng = np.random.default_rng(7)
    load = rng.integers(0, 50, (1, 7)).astype(float)
    problem = PlacementProblem(load=load, num_gpus=3, slots_per_gpu=3, weights=Weights(load=1.0, comm=1.0, mig=1.0))
    result = solve_minlp(problem, EXACT)
    best = brute_force(problem, np.ones((1, 7), dtype=int))
    assert objective(problem, result.slot_map).total == pytest.approx(best, abs=1e-9)
    assert result.objective[0] == pytest.approx(best, abs=1e-6) and result.gap == pytest.approx(0.0, abs=1e-6)


def test_a_time_limited_solve_is_never_worse_than_the_online_placement_it_starts_from() -> None:
    problem = random_problem(np.random.default_rng(3), layers=4, experts=32, gpus=4, sources=4, migration=0.01)
    options = MinlpOptions(time_limit_s=0.2, parallel_layers=2)
    result = solve_minlp(problem, options)
    hint = objective(problem, place(problem, options.hint_params))
    found = objective(problem, result.slot_map)
    assert (found.per_layer <= hint.per_layer + 1e-3 * hint.per_layer).all()
    assert 0.0 <= result.gap < 1.0
    assert (result.bound <= result.objective + 1e-9).all()
    assert len(result.status) == 4 and result.layer_seconds.shape == (4,)


def test_layers_solved_in_parallel_give_the_same_optimum_as_one_at_a_time() -> None:
    problem = random_problem(np.random.default_rng(5), layers=3, experts=6, gpus=3, sources=3, migration=0.05)
    serial = solve_minlp(problem, EXACT)
    parallel = solve_minlp(problem, MinlpOptions(time_limit_s=10.0, parallel_layers=3, relative_gap=0.0))
    np.testing.assert_allclose(
        objective(problem, serial.slot_map).per_layer, objective(problem, parallel.slot_map).per_layer, rtol=1e-9
    )


def test_a_given_hint_and_replicas_are_used_and_checked() -> None:
    problem = random_problem(np.random.default_rng(6), layers=1, experts=6, gpus=3, spare_slots=1, redundant=1)
    hint = greedy_hosts(problem, GreedyParams(0.0, 1.0, 0.0))
    result = solve_minlp(problem, EXACT, hint=hint)
    assert result.optimal_layers == 1
    with pytest.raises(PlacementError, match="hint shape"):
        solve_minlp(problem, EXACT, hint=hint[:, :3])
    with pytest.raises(PlacementError, match="time_limit_s"):
        MinlpOptions(time_limit_s=0)


def test_a_cancelled_solve_stops_before_its_next_layer() -> None:
    problem = random_problem(np.random.default_rng(3), layers=3, experts=6, gpus=3, sources=2)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(MinlpCancelled, match="cancelled before layer"):
        solve_minlp(problem, MinlpOptions(time_limit_s=1.0, cancel=cancel))


def test_the_calibration_budget_bounds_the_per_layer_limit() -> None:
    assert per_layer_limit(1.0, 300.0, layer_solves=48, parallel=2) == 1.0  # 24 rounds fit the budget
    assert per_layer_limit(60.0, 300.0, layer_solves=48, parallel=2) == 12.5  # 24 rounds x 12.5 s = 300 s
    assert per_layer_limit(5.0, 10.0, layer_solves=0, parallel=2) == 5.0
