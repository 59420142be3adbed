"""The greedy placement: capacity, replicas, exact marginal scores, and what each weight does."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.solver.placement import (
    GreedyParams,
    PlacementError,
    PlacementProblem,
    Weights,
    check_slot_map,
    contiguous_slots,
    gpu_loads,
    greedy,
    greedy_hosts,
    hosts_from_slots,
    locality_distance,
    objective,
    objective_of_hosts,
    replica_counts,
)
from tests.placement_cases import random_problem


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    experts=st.integers(2, 14),
    gpus=st.integers(1, 5),
    spare=st.integers(0, 2),
    redundant_share=st.floats(0, 1),
    alpha=st.sampled_from([0.0, 1.0, 10.0]),
    gamma=st.sampled_from([0.0, 1.0, 10.0]),
)
def test_greedy_fills_every_gpu_within_capacity_with_the_chosen_copies(
    seed, experts, gpus, spare, redundant_share, alpha, gamma
) -> None:
    rng = np.random.default_rng(seed)
    redundant = int(redundant_share * experts * (gpus - 1))
    problem = random_problem(rng, experts=experts, gpus=gpus, spare_slots=spare, redundant=redundant, migration=0.1)
    slot_map = greedy(problem, GreedyParams(alpha, 1.0, gamma))
    check_slot_map(slot_map, problem.num_layers, experts, gpus)  # every expert present, never twice on a GPU
    hosts = hosts_from_slots(slot_map, experts)
    assert (hosts.sum(axis=1) <= problem.slots_per_gpu).all()
    assert (hosts.sum(axis=2) == replica_counts(problem.load, redundant, gpus)).all()


def test_the_score_is_the_exact_marginal_of_the_objective() -> None:
    """With α = β = γ = 1, the last copy goes where the completed placement costs least (brute force)."""
    rng = np.random.default_rng(11)
    for _ in range(20):
        problem = random_problem(rng, layers=1, experts=6, gpus=3, sources=3, spare_slots=1, migration=0.05)
        hosts = greedy_hosts(problem, GreedyParams(1.0, 1.0, 1.0))
        last = int(np.argmin(problem.load[0]))  # the greedy places the lightest expert last
        costs = {}
        for gpu in range(3):
            trial = hosts.copy()
            trial[0, last] = False
            trial[0, last, gpu] = True
            if trial[0].sum(axis=0)[gpu] <= problem.slots_per_gpu:
                costs[gpu] = objective_of_hosts(problem, trial).total
        chosen = int(np.flatnonzero(hosts[0, last])[0])
        assert costs[chosen] == pytest.approx(min(costs.values()))


def test_the_greedy_is_a_myopic_descent_on_tiny_instances() -> None:
    """Never better than the optimum, and close to it (brute force over all assignments).

    Measured on these ten instances: 7 optimal, mean ratio 1.0816, worst 1.668. The bounds sit just above
    those, so a greedy a few per cent worse (one more suboptimal case, +1 % on the mean, +0.5 % on the
    worst) fails here.
    """
    rng = np.random.default_rng(2)
    ratios = []
    for _ in range(10):
        problem = random_problem(rng, layers=1, experts=6, gpus=2, sources=2, migration=0.02)
        best = np.inf
        for assign in itertools.product(range(2), repeat=6):
            if np.bincount(assign, minlength=2).max() > problem.slots_per_gpu:
                continue
            hosts = np.zeros(problem.shape, dtype=int)
            hosts[0, np.arange(6), assign] = 1
            best = min(best, objective_of_hosts(problem, hosts).total)
        found = objective(problem, greedy(problem, GreedyParams(1.0, 1.0, 1.0))).total
        assert found >= best - 1e-9
        ratios.append(found / best)
    ratios_ = np.array(ratios)
    assert (ratios_ <= 1 + 1e-9).sum() >= 7, np.round(ratios_, 4)
    assert ratios_.mean() <= 1.09, np.round(ratios_, 4)
    assert ratios_.max() <= 1.67, np.round(ratios_, 4)


def test_communication_weight_keeps_traffic_local_when_sources_specialise() -> None:
    # Two DP sources, each sending all its tokens to its own half of the experts; GPU pairs per source.
    experts, gpus = 16, 4
    counts = np.zeros((3, 2, experts))
    counts[:, 0, : experts // 2] = np.random.default_rng(0).uniform(1, 2, (3, experts // 2))
    counts[:, 1, experts // 2 :] = np.random.default_rng(1).uniform(1, 2, (3, experts // 2))
    distance = locality_distance(np.arange(2), np.arange(gpus) // 2)
    problem = PlacementProblem.from_counts(counts, gpus, 4, distance=distance, weights=Weights(load=1.0))
    load_only = objective(problem, greedy(problem, GreedyParams(0.0, 1.0, 0.0)))
    aware = objective(problem, greedy(problem, GreedyParams(1.0, 1.0, 0.0)))
    assert aware.comm.sum() == pytest.approx(0.0)  # every expert on its source's GPUs
    assert load_only.comm.sum() > 0.5


def test_migration_weight_keeps_a_balanced_current_placement() -> None:
    rng = np.random.default_rng(4)
    load = rng.uniform(0.9, 1.1, (2, 16))
    current = contiguous_slots(2, 16, 4, 4)
    problem = PlacementProblem(
        load=load,
        num_gpus=4,
        slots_per_gpu=4,
        current=current,
        migration_cost=1.0,
        weights=Weights(load=1.0, comm=1.0, mig=1.0),
    )
    kept = greedy(problem, GreedyParams(0.0, 1.0, 10.0))
    assert (kept == current).all()  # the stayers keep their slots too
    moved = greedy(problem, GreedyParams(0.0, 1.0, 0.0))
    assert objective(problem, moved).mig.sum() > 0


def test_replicas_split_the_hottest_experts_and_lower_the_peak() -> None:
    load = np.array([[12.0, 1, 1, 1, 1, 1, 1, 1]])
    plain = PlacementProblem(load=load, num_gpus=4, slots_per_gpu=3)
    replicated = PlacementProblem(load=load, num_gpus=4, slots_per_gpu=3, redundant_slots=3)
    assert replica_counts(load, 3, 4)[0, 0] == 4
    peak = gpu_loads(plain, hosts_from_slots(greedy(plain), 8)).max()
    peak_replicated = gpu_loads(replicated, hosts_from_slots(greedy(replicated), 8)).max()
    assert peak == pytest.approx(12.0) and peak_replicated == pytest.approx(5.0)


def test_replica_counts_minimise_the_largest_per_copy_load() -> None:
    rng = np.random.default_rng(9)
    load = rng.gamma(0.5, 1.0, (1, 5))
    copies = replica_counts(load, 4, 4)
    best = min((load / np.array(c)).max() for c in itertools.product(range(1, 5), repeat=5) if sum(c) == 9)
    assert (load / copies).max() == pytest.approx(best)


def test_the_weights_of_the_problem_scale_the_greedy_terms() -> None:
    """Greedy params multiply the problem's weights: doubling both leaves the placement unchanged."""
    rng = np.random.default_rng(8)
    base = random_problem(rng, layers=3, experts=16, gpus=4, sources=2, migration=0.03)
    doubled = replace(base, weights=Weights({name: 2 * w for name, w in base.weights.items()}))
    assert (greedy(base) == greedy(doubled)).all()


def test_bad_parameters_and_replicas_are_refused() -> None:
    problem = random_problem(np.random.default_rng(0))
    with pytest.raises(PlacementError, match="comm"):  # alpha multiplies the comm term
        GreedyParams(alpha=-1.0)
    with pytest.raises(PlacementError, match="hot"):
        GreedyParams(hot=float("nan"))
    with pytest.raises(PlacementError, match="not a term name"):
        GreedyParams.from_map({"Hot GPU": 1.0})
    assert GreedyParams.from_map({"alpha": 1.0, "beta": 0.5, "gamma": 2.0}) == GreedyParams(1.0, 0.5, 2.0)
    with pytest.raises(PlacementError, match="replica counts"):
        greedy(problem, replicas=np.full(problem.load.shape, 9))
    with pytest.raises(PlacementError, match="same number"):
        replicas = np.ones(problem.load.shape, dtype=int)
        replicas[0, 0] = 2
        greedy(problem, replicas=replicas)
