"""The step-time publish rule's pure parts: the step model agrees with the simulator's steps, a move pays only
when its saving over the horizon beats its migration, staging moves the hottest experts first within a bound."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.shared.streams import stream
from switchyard.simulator.core.ep import EpTopology, busiest, placed, rank_work, step_cost, step_traffic
from switchyard.simulator.core.physics import CostModel, get_gpu, get_model
from switchyard.solver.placement import DEFAULT_PARAMS
from switchyard.solver.placement.layouts import default_layout
from switchyard.solver.placement.payoff import (
    MigrationPrice,
    StepContext,
    migration_bytes,
    migration_seconds,
    predict,
    saving_per_step,
)
from switchyard.solver.placement.policy import Policy, TriggerRule, decide, trigger
from switchyard.solver.placement.problem import hosts_from_slots
from switchyard.solver.placement.stages import stage
from switchyard.solver.placement.step_time import origin_matrix

LAYERS, EXPERTS, GPUS, TOP_K = 4, 16, 4, 2


def _skewed(rng: np.random.Generator) -> np.ndarray:
    """`[L, E]` per-expert probabilities with the hot experts on GPU 0 of the contiguous layout."""
    p = rng.uniform(0.5, 1.5, size=(LAYERS, EXPERTS))
    p[:, : EXPERTS // GPUS] *= 6.0
    return p / p.sum(axis=1, keepdims=True)


def _simulated_step(cost: CostModel, topo: EpTopology, layout: np.ndarray, sel: np.ndarray, src: np.ndarray) -> float:
    pl = placed(layout, EXPERTS)
    traffic = step_traffic(topo, pl, sel, src, np.zeros((0, LAYERS, EXPERTS)), np.zeros(0), np.zeros(0), TOP_K)
    moe_s, _, _ = busiest(cost, *rank_work(traffic.load.sum(axis=1), pl))
    return moe_s + traffic.a2a_s


def test_the_predicted_saving_is_what_the_simulator_measures_on_the_same_load() -> None:
    """One step model for both: the prediction from expected counts matches the mean over simulated steps of
    tokens drawn from the same mix, within sampling noise and the Poisson approximation."""
    rng = stream(0, "test.payoff.tokens")
    spec = get_model("deepseek-v2-lite").with_(moe_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K)
    cost = CostModel(spec, get_gpu("H100"), gpus=1)
    topo = EpTopology(ranks=GPUS, hidden=spec.hidden, tp=1, ranks_per_node=2)  # two nodes: both links priced
    p = _skewed(rng)
    current = default_layout(LAYERS, EXPERTS, GPUS)
    new = current.copy()
    for k in range(1, GPUS):  # deal GPU 0's hot experts over the four GPUs, one swap each
        new[:, 0, k], new[:, k, 0] = current[:, k, 0], current[:, 0, k]
    batch, steps = 64, 300
    saved = []
    for _ in range(steps):
        sel = np.zeros((batch, LAYERS, EXPERTS), dtype=np.float32)
        for layer in range(LAYERS):
            for b in range(batch):
                sel[b, layer, rng.choice(EXPERTS, TOP_K, replace=False, p=p[layer])] = 1.0
        src = rng.integers(0, GPUS, size=batch)
        saved.append(_simulated_step(cost, topo, current, sel, src) - _simulated_step(cost, topo, new, sel, src))
    counts = np.zeros((LAYERS, GPUS, EXPERTS))
    for s in range(GPUS):
        counts[:, s, :] = p * TOP_K * batch / GPUS  # expected pairs per step from each source
    ctx = StepContext(step_cost(cost, topo), MigrationPrice(spec.expert_bytes), 0.01, 30.0, 0.01)
    predicted = saving_per_step(counts, origin_matrix(GPUS, list(range(GPUS))), current, new, ctx)
    measured = float(np.mean(saved))
    assert measured > 0 and predicted == pytest.approx(measured, rel=0.15)


def _context(horizon_s: float = 30.0, first: bool = False, margin: float = 0.25) -> StepContext:
    spec = get_model("deepseek-v2-lite")
    cost = CostModel(spec, get_gpu("H100"), gpus=1)
    topo = EpTopology(ranks=2, hidden=spec.hidden)
    return StepContext(step_cost(cost, topo), MigrationPrice(spec.expert_bytes), 0.02, horizon_s, 1.0, first, margin)


def _hot(load: float = 50_000.0) -> np.ndarray:
    counts = np.full((2, 8), load / 100)
    counts[:, :4] = load  # experts 0..3 on GPU 0 of the contiguous layout
    return counts


def test_doing_nothing_predicts_nothing_and_never_pays() -> None:
    current = default_layout(2, 8, 2)
    payoff = predict(_hot()[:, None, :], np.full((1, 2), 0.5), current, current, _context())
    assert (payoff.saving_per_step_s, payoff.duration_s, payoff.gain_s, payoff.cost_s) == (0.0, 0.0, 0.0, 0.0)
    assert not payoff.pays


def test_a_move_pays_only_when_its_saving_over_the_horizon_beats_its_migration() -> None:
    current = default_layout(2, 8, 2)
    long = decide(_hot(), None, None, current, DEFAULT_PARAMS, Policy(), None, _context(30.0))
    assert long.publish and long.payoff is not None and long.payoff.saving_per_step_s > 0
    assert long.payoff.gain_s == pytest.approx(
        long.payoff.saving_per_step_s * (30.0 - long.payoff.duration_s) / long.payoff.step_s
    )
    assert long.payoff.cost_s == pytest.approx(long.payoff.duration_s * (1 - 1 / 2.0))
    short = decide(_hot(), None, None, current, DEFAULT_PARAMS, Policy(), None, _context(long.payoff.duration_s))
    assert not short.publish and short.screened and "does not pay" in short.reason  # the old rule published it
    first = decide(_hot(), None, None, current, DEFAULT_PARAMS, Policy(), None, _context(30.0, first=True))
    assert first.payoff.duration_s == pytest.approx(long.payoff.duration_s + 0.36)  # type: ignore[union-attr]
    picky = decide(_hot(), None, None, current, DEFAULT_PARAMS, Policy(), None, _context(30.0, margin=1e6))
    assert not picky.publish and picky.payoff.net_s > 0  # type: ignore[union-attr]


def test_a_swap_inside_a_gpu_moves_no_bytes() -> None:
    current = default_layout(1, 4, 2)
    shuffled = current[:, :, ::-1].copy()
    price = MigrationPrice(expert_bytes=1e6)
    assert not migration_bytes(current, shuffled, price).any()
    assert migration_seconds(current, shuffled, price, first=True) == 0.0


def test_a_stage_moves_the_hottest_experts_first_within_its_bytes() -> None:
    layers, experts, gpus = 3, 16, 4
    current = default_layout(layers, experts, gpus)
    target = np.roll(current, 1, axis=1)  # every expert moves: 4 cycles per layer
    heat = np.arange(layers * experts, dtype=np.float64).reshape(layers, experts)  # layer 2, expert 15 hottest
    price = MigrationPrice(expert_bytes=1.0)
    assert np.array_equal(stage(current, target, heat, price, None), target)
    staged, plans = current, 0
    while not np.array_equal(staged, target):
        nxt = stage(staged, target, heat, price, 4.0)
        assert migration_bytes(staged, nxt, price)[1].sum(axis=0).max() <= 4.0
        for layer in nxt:  # every expert keeps exactly one copy at every stage
            assert sorted(layer.ravel().tolist()) == list(range(experts))
        if plans == 0:
            moved = hosts_from_slots(nxt, experts) != hosts_from_slots(current, experts)
            assert moved[2].any() and not moved[0].any()  # the hottest layer first
        staged, plans = nxt, plans + 1
    assert 1 < plans <= layers * gpus


def test_staging_needs_a_continue_trigger_and_decide_reports_a_prefix() -> None:
    rule = TriggerRule(period_s=30.0, drift_threshold=0.1, min_interval_s=5.0)
    dist = np.full((1, 2), 0.5)
    assert trigger(rule, 3.0, (0.0, dist), dist, unfinished=True) is None
    assert trigger(rule, 6.0, (0.0, dist), dist, unfinished=True) == "continue"
    assert trigger(rule, 6.0, (0.0, dist), dist) is None
    current = default_layout(2, 8, 2)
    spec = get_model("deepseek-v2-lite")
    one_expert = Policy(stage_bytes=spec.expert_bytes)
    decision = decide(_hot(), None, None, current, DEFAULT_PARAMS, one_expert, None, _context(300.0))
    full = decide(_hot(), None, None, current, DEFAULT_PARAMS, Policy(), None, _context(300.0))
    assert decision.partial and not full.partial
    assert decision.payoff.duration_s < full.payoff.duration_s  # type: ignore[union-attr]
