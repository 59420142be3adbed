"""Calibration: the fit recovers known weights, agreement is label-aware, the job reports what it measured."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.solver.placement import GreedyParams, MinlpOptions, greedy_hosts, hosts_from_slots, objective_of_hosts
from switchyard.solver.placement import calibrate as calibrate_module
from switchyard.solver.placement.calibrate import agreement, calibrate, fit_params, keep_layout_hosts
from switchyard.solver.placement.refine import place
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


def test_calibration_reports_agreement_and_gaps_of_the_online_placement_and_the_greedy() -> None:
    rng = np.random.default_rng(2)
    problems = [random_problem(rng, layers=3, experts=12, gpus=4, sources=4, migration=0.01) for _ in range(2)]
    result = calibrate(problems, MinlpOptions(time_limit_s=2.0, parallel_layers=2))
    assert result.num_windows == 2 and len(result.references) == 2 and result.minlp_seconds > 0
    references = [hosts_from_slots(r, 12) for r in result.references]
    copies = [r.sum(axis=2) for r in references]
    online = [hosts_from_slots(place(p, result.params, c), 12) for p, c in zip(problems, copies, strict=True)]
    greedy = [greedy_hosts(p, result.params, c) for p, c in zip(problems, copies, strict=True)]
    for summary, placements in ((vars(result), online), (result.greedy, greedy)):
        cases = list(zip(problems, placements, references, strict=True))
        matched = sum(agreement(p, h, r) * r.sum() for p, h, r in cases)
        assert summary["agreement"] == pytest.approx(matched / sum(r.sum() for r in references))
        comm = sum(objective_of_hosts(p, h).comm.sum() for p, h, _ in cases)
        comm_minlp = sum(objective_of_hosts(p, r).comm.sum() for p, _, r in cases)
        assert summary["comm_gap"] == pytest.approx(comm / comm_minlp - 1)
    for window in result.windows:
        assert window["shape"] == [3, 12, 4]
        # the main reference starts from the current layout, so it is never worse than keeping it
        keep = objective_of_hosts(problems[0], keep_layout_hosts(problems[0])).total
        assert result.windows[0]["minlp"]["total"] <= keep + 1e-9
    assert result.details()["windows"] == list(result.windows)


def test_every_method_is_judged_against_a_reference_that_did_not_start_from_it(monkeypatch) -> None:
    """The references start from keep-layout and EPLB, never from `place`/greedy; keep-layout is judged
    against the EPLB-started one. Keep-layout agrees on no moved copy and costs more than `place`."""
    rng = np.random.default_rng(3)
    problems = [random_problem(rng, layers=3, experts=12, gpus=4, sources=4, migration=0.01) for _ in range(2)]
    hints: list[np.ndarray] = []
    real = calibrate_module.solve_minlp

    def spy(problem, options, *, replicas=None, hint=None):  # type: ignore[no-untyped-def]
        assert hint is not None, "an unhinted solve would start from place()"
        hints.append(np.asarray(hint) > 0)
        return real(problem, options, replicas=replicas, hint=hint)

    monkeypatch.setattr(calibrate_module, "solve_minlp", spy)
    result = calibrate(problems, MinlpOptions(time_limit_s=1.0, parallel_layers=2))
    assert len(hints) == 4
    for p, hint in zip(problems, hints[:2], strict=True):
        np.testing.assert_array_equal(hint, keep_layout_hosts(p) > 0)
        assert not np.array_equal(hint, hosts_from_slots(place(p, result.params), 12) > 0)
    assert set(result.methods) == {"greedy", "place", "keep_layout", "eplb"}
    for m in result.methods.values():
        assert {"objective_gap", "agreement", "agreement_moved", "comm_gap", "reference"} <= set(m)
        assert 0.0 <= m["agreement"] <= 1.0
    keep = result.methods["keep_layout"]
    assert "eplb" in keep["reference"] and "keep_layout" in result.methods["place"]["reference"]
    assert keep["agreement_moved"] == 0.0, "keeping the layout moves nothing the reference moves"
    assert keep["objective_gap"] > result.methods["place"]["objective_gap"]
    assert 0.0 < result.reference_agreement["agreement"] <= 1.0
