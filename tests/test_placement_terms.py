"""Placement objective terms: one linear builder for every solver, term maps, one owner of the defaults, and
the worked example of docs/architecture.md ("How to add a placement objective term") run as it stands."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

from switchyard.services.placement.settings import PlacementSettings
from switchyard.shared import placement_terms
from switchyard.shared.codec import decode, encode
from switchyard.shared.schemas import ObjectiveTerms, PlacementParams, PlacementPlan
from switchyard.solver.placement import (
    GreedyParams,
    MinlpOptions,
    PlacementError,
    PlacementProblem,
    Weights,
    gpu_loads,
    greedy_hosts,
    hosts_from_slots,
    objective,
    objective_of_hosts,
    solve_minlp,
)
from switchyard.solver.placement.policy import Policy
from switchyard.solver.placement.terms import linear_constants, linear_cost, linear_terms
from tests.placement_cases import random_problem

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "placement_hot_gpu.py"


def _example():
    spec = importlib.util.spec_from_file_location("placement_hot_gpu", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_linear_cost_weighs_and_sums_terms_in_order() -> None:
    a, b = np.arange(6.0).reshape(1, 2, 3), np.array([1.0, 0.0, 2.0])[None, None, :]
    cost = linear_cost({"x": a, "y": b}, {"x": 2.0, "y": 0.5})
    assert cost.shape == (1, 2, 3)
    np.testing.assert_array_equal(cost, 2.0 * a + 0.5 * b)
    with pytest.raises(KeyError):  # every term needs a weight
        linear_cost({"x": a}, {})


def test_the_linear_terms_are_the_objective_less_its_load_term() -> None:
    """For any placement with the copy counts fixed, w_load·load + Σ (linear cost)·x + constants is the
    objective: so the greedy, the refinement and the MINLP, which all price moves with `linear_cost`,
    optimise what `objective` reports, extra terms included."""
    rng = np.random.default_rng(3)
    base = random_problem(rng, layers=3, experts=8, gpus=4, spare_slots=1, migration=0.2)
    problem = _example().with_hot_gpus(base, np.array([False, True, False, False]), weight=2.5)
    hosts = greedy_hosts(problem, GreedyParams(0.5, 2.0, 3.0))
    copies = hosts.sum(axis=2)
    terms = linear_terms(problem, copies)
    assert list(terms) == ["comm", "mig", "hot"]
    linear = (linear_cost(terms, problem.weights) * hosts).sum(axis=(1, 2))
    constants = [sum(problem.weights[t] * c for t, c in linear_constants(problem, layer).items()) for layer in range(3)]
    loads = gpu_loads(problem, hosts)
    load = ((loads - loads.mean(axis=1, keepdims=True)) ** 2).sum(axis=1)
    expected = problem.weights.load * load + linear + np.array(constants)
    np.testing.assert_allclose(objective_of_hosts(problem, hosts).per_layer, expected, rtol=1e-12)


def test_weights_and_greedy_params_are_maps_with_defaults() -> None:
    weights = Weights(hot=2.0, load=40.0)
    assert dict(weights) == {"load": 40.0, "comm": 1.0, "mig": 1.0, "hot": 2.0}
    assert Weights()["unlisted"] == placement_terms.DEFAULT_EXTRA_WEIGHT
    assert Weights() == Weights(dict(placement_terms.DEFAULT_WEIGHTS))
    params = GreedyParams.from_map({"alpha": 1.0, "beta": 0.25, "hot": 3.0})
    assert params.as_map() == {"comm": 1.0, "load": 0.25, "mig": 1.0, "hot": 3.0}
    assert params["other"] == 1.0  # a term without a multiplier is priced at its exact marginal
    for bad in ({"load": -1.0}, {"comm": float("nan")}, {"Hot GPU": 1.0}, {"total": 1.0}):
        with pytest.raises(PlacementError):
            Weights(bad)
    with pytest.raises(PlacementError, match="built-in"):
        PlacementProblem(load=np.ones((1, 4)), num_gpus=2, slots_per_gpu=2, extra_terms={"comm": np.zeros(2)})
    with pytest.raises(PlacementError, match="broadcast"):
        PlacementProblem(load=np.ones((1, 4)), num_gpus=2, slots_per_gpu=2, extra_terms={"hot": np.zeros(3)})


def test_every_placement_default_has_one_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    from switchyard.cli import calibrate
    from switchyard.services.api.models import CalibrationTrigger
    from switchyard.shared.schemas import CalibrationRequest

    owner = placement_terms
    config = PlacementSettings(_env_file=None)
    assert config.migration_cost == Policy().migration_cost == owner.DEFAULT_MIGRATION_COST
    assert config.gain_threshold == Policy().gain_threshold == owner.DEFAULT_GAIN_THRESHOLD
    assert config.redundant_slots == Policy().redundant_slots == owner.DEFAULT_REDUNDANT_SLOTS
    assert config.objective_weights() == dict(owner.DEFAULT_WEIGHTS) == dict(Policy().weights) == dict(Weights())
    options = MinlpOptions()
    assert (options.time_limit_s, options.parallel_layers, options.workers_per_layer) == (
        owner.DEFAULT_TIME_LIMIT_S,
        owner.DEFAULT_PARALLEL_LAYERS,
        owner.DEFAULT_WORKERS_PER_LAYER,
    )
    assert CalibrationTrigger().time_limit_s == CalibrationRequest.model_fields["time_limit_s"].default
    assert CalibrationTrigger().time_limit_s == owner.DEFAULT_TIME_LIMIT_S
    cli = inspect.signature(calibrate).parameters
    assert cli["migration_cost"].default == owner.DEFAULT_MIGRATION_COST
    assert cli["objective_tolerance"].default == owner.DEFAULT_OBJECTIVE_TOLERANCE
    assert cli["time_limit"].default == owner.DEFAULT_TIME_LIMIT_S
    assert [cli[f"{t}_weight"].default for t in ("load", "comm", "mig")] == list(owner.DEFAULT_WEIGHTS.values())
    # and nobody writes the numbers out again
    sources = [*(ROOT / "solver" / "placement").glob("*.py"), *(ROOT / "services" / "placement").glob("*.py")]
    sources += [ROOT / "services" / "calibration.py", ROOT / "services" / "api" / "models.py"]
    for path in sources:
        assert not re.search(r"=\s*(0\.005|50\.0|0\.05)\b", path.read_text()), path  # a default written out

    monkeypatch.setenv("SWITCHYARD_PLACEMENT_WEIGHTS", '{"hot": 2, "load": 40}')
    monkeypatch.setenv("SWITCHYARD_PLACEMENT_WEIGHT_MIG", "3")  # the older one-by-one setting still wins
    assert PlacementSettings(_env_file=None).objective_weights() == {"load": 40, "comm": 1.0, "mig": 3.0, "hot": 2}
    monkeypatch.setenv("SWITCHYARD_PLACEMENT_WEIGHTS", '{"Hot GPU": 1}')
    with pytest.raises(ValueError, match="pattern"):
        PlacementSettings(_env_file=None)


def test_the_documented_example_is_the_module_the_tests_run() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## How to add a placement objective term") :]
    assert "docs/examples/placement_hot_gpu.py" in section
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert code == EXAMPLE.read_text()
    assert len(code.splitlines()) <= 60


def test_the_hot_gpu_term_moves_load_off_the_hot_gpu_and_travels_by_name() -> None:
    example = _example()
    rng = np.random.default_rng(7)
    counts = rng.gamma(0.7, 100.0, (4, 16))
    hot = np.array([True, False, False, False])
    cold_map, cold = example.place_avoiding_hot(counts, 4, 4, np.zeros(4, dtype=bool))
    hot_map, terms = example.place_avoiding_hot(counts, 4, 4, hot)
    assert not (hot_map == cold_map).all()  # the term changes the placement
    problem = PlacementProblem.from_counts(counts, 4, 4)
    cold_load = gpu_loads(problem, hosts_from_slots(cold_map, 16))[:, 0]
    hot_load = gpu_loads(problem, hosts_from_slots(hot_map, 16))[:, 0]
    assert (hot_load <= cold_load + 1e-9).all() and hot_load.mean() < 0.95  # mean GPU load is 1
    assert cold["hot"] == 0.0 and 0 < terms["hot"] < 0.95 * 4 and terms["load"] > cold["load"]

    # the MINLP reads the same term (one layer, solved exactly)
    layer = example.with_hot_gpus(PlacementProblem.from_counts(counts[:1], 4, 4), hot)
    exact = solve_minlp(layer, MinlpOptions(time_limit_s=20.0, parallel_layers=1))
    assert exact.optimal_layers == 1
    assert objective(layer, exact.slot_map).total <= objective(layer, hot_map[:1]).total + 1e-9
    assert gpu_loads(layer, hosts_from_slots(exact.slot_map, 16))[0, 0] < 0.95

    # the plan carries the new term by name: no wire change
    plan = PlacementPlan(
        plan_id="p1",
        version=1,
        engine_group="g",
        created_at=1.0,
        source="greedy",
        gpus=["a", "b", "c", "d"],
        placement=hot_map.astype(np.int32),
        moves=np.zeros((0, 6), np.int32),
        objective=ObjectiveTerms.from_flat(terms),
        params=PlacementParams(weights=GreedyParams().as_map()),
    )
    assert decode(encode(plan), PlacementPlan).objective.terms["hot"] == terms["hot"]


def test_extra_terms_tell_gpus_apart() -> None:
    problem = PlacementProblem(load=np.ones((1, 4)), num_gpus=4, slots_per_gpu=1)
    assert problem.interchangeable_gpus() == [[0, 1, 2, 3]]
    hot = _example().with_hot_gpus(problem, np.array([True, False, False, False]))
    assert hot.interchangeable_gpus() == [[1, 2, 3]]
    assert hot.layer(0).extra_terms["hot"].shape == (1, 4, 4)
