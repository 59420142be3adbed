"""Calibration: the fit recovers known weights, agreement is label-aware, the job reports what it measured."""

from __future__ import annotations

import numpy as np
import pytest

from solver.placement import GreedyParams, MinlpOptions, greedy_hosts, hosts_from_slots, objective_of_hosts
from solver.placement.calibrate import agreement, calibrate, fit_params
from tests.placement_cases import random_problem


@pytest.mark.parametrize("truth", [GreedyParams(1.0, 0.3, 2.0), GreedyParams(1.0, 4.0, 0.25)])
def test_the_fit_recovers_known_weights_from_their_placements(truth: GreedyParams) -> None:
    rng = np.random.default_rng(0)
    problems = [random_problem(rng, layers=12, experts=32, gpus=4, sources=4, migration=0.01) for _ in range(2)]
    references = [greedy_hosts(p, truth) for p in problems]
    fitted, agreed = fit_params(problems, references)
    assert agreed > 0.99
    assert fitted.alpha == truth.alpha
    assert abs(np.log2(fitted.beta / truth.beta)) <= 0.5  # within a factor sqrt(2) of the truth
    assert abs(np.log2(fitted.gamma / truth.gamma)) <= 0.5


def test_agreement_ignores_relabelling_of_interchangeable_gpus_only() -> None:
    rng = np.random.default_rng(1)
    fresh = random_problem(rng, layers=2, experts=12, gpus=4, sources=1, migration=0.0)  # all GPUs alike
    hosts = greedy_hosts(fresh)
    assert agreement(fresh, hosts[:, :, [2, 0, 3, 1]], hosts) == 1.0
    located = random_problem(rng, layers=2, experts=12, gpus=4, sources=2, migration=0.0)  # GPU pairs per source
    hosts = greedy_hosts(located)
    assert agreement(located, hosts[:, :, [1, 0, 3, 2]], hosts) == 1.0  # swap within a source's pair
    assert agreement(located, hosts[:, :, [2, 3, 0, 1]], hosts) < 1.0  # swap the pairs: different comm


def test_calibration_reports_agreement_and_gaps_of_the_fitted_greedy() -> None:
    rng = np.random.default_rng(2)
    problems = [random_problem(rng, layers=3, experts=12, gpus=4, sources=4, migration=0.01) for _ in range(2)]
    result = calibrate(problems, MinlpOptions(time_limit_s=2.0, parallel_layers=2))
    references = []
    for window in result.windows:
        assert window["shape"] == [3, 12, 4]
        assert window["minlp"]["total"] <= window["fitted"]["total"] + 1e-9
        references.append(window["minlp"])
    fitted = [greedy_hosts(p, result.params) for p in problems]
    comm = sum(objective_of_hosts(p, h).comm.sum() for p, h in zip(problems, fitted, strict=True))
    comm_minlp = sum(r["comm"] for r in references)
    assert result.comm_gap == pytest.approx((comm - comm_minlp) / comm_minlp)
    assert 0.0 <= result.agreement <= 1.0 and result.num_windows == 2
    assert result.objective_gap >= -1e-9 and result.minlp_seconds > 0
    for window, problem, reference, hosts in zip(result.windows, problems, result.references, fitted, strict=True):
        assert window["fitted"]["agreement"] == agreement(problem, hosts, hosts_from_slots(reference, 12))
    assert result.details()["windows"] == list(result.windows)
