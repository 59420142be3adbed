"""The placement loop in a simulated DP+EP fleet: the service's triggers, Gimbal's coordinated moves, EPLB beside it,
one migration at a time; and the traffic counts the placement-at-scale bench reports."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import pytest

from switchyard.services.placement.service import PlacementService
from switchyard.services.placement.settings import PlacementSettings
from switchyard.shared.settings import SwitchyardSettings
from switchyard.simulator.core.placement_control import PlacementControl
from switchyard.simulator.core.placement_loop import PLACEMENT_CONTROLS, STAGED_BYTES, EplbLoop, GimbalLoop
from switchyard.simulator.core.placements import make_placement
from switchyard.solver.placement import SEED_PARAMS
from switchyard.solver.placement.layouts import default_layout
from switchyard.solver.placement.policy import TriggerRule, trigger
from switchyard.solver.placement.traffic import a2a_sends, rank_loads, remote_share
from switchyard.solver.placement.window import DecayedLoad

LAYERS, EXPERTS, GPUS = 2, 16, 4  # tp 1: four DP engines, engine s owns GPU s


def _imbalance(counts: np.ndarray, layout: np.ndarray) -> float:
    """Max/mean rank load, mean over layers."""
    loads = rank_loads(counts, layout)
    return float((loads.max(axis=1) / loads.mean(axis=1)).mean())


def _uniform(per_expert: float = 10.0) -> np.ndarray:
    """[L, S, E]: every engine sends the same tokens to every expert."""
    return np.full((LAYERS, GPUS, EXPERTS), per_expert)


def _hot_on_engine_zero(hot: float = 60.0) -> np.ndarray:
    """[L, S, E]: experts 0..3 (GPU 0 of the contiguous layout, engine 0's GPU) turn hot, from every engine."""
    load = _uniform()
    load[:, :, :4] = hot
    return load


# ----- triggers: the service's rule, one function -----

DIST_A = np.array([[0.5, 0.5, 0.0, 0.0]])
DIST_B = np.array([[0.0, 0.5, 0.5, 0.0]])  # total variation 0.5 from A


@pytest.mark.parametrize(
    ("elapsed", "before", "expected"),
    [
        (None, None, "start"),
        (100.0, DIST_A, "period"),  # past period_s (30 s), whatever the drift
        (10.0, DIST_A, None),  # no drift, inside the period
        (10.0, DIST_B, "drift 0.500"),  # drifted, past min_interval_s (5 s)
        (1.0, DIST_B, None),  # drifted, but too soon after the last run
    ],
)
def test_the_service_triggers_by_the_solver_rule(tmp_path: Path, elapsed, before, expected) -> None:
    config = PlacementSettings()
    service = PlacementService(SwitchyardSettings(data_dir=tmp_path), config)
    window = DecayedLoad(config.half_life_s)
    window.add_counts(np.array([[5.0, 5.0, 0.0, 0.0]]), None, 0.0, 1.0)
    service.windows["g"] = window
    now = time.monotonic()
    last = None if elapsed is None else (now - elapsed, before)
    if last is not None:
        service._last_run["g"] = last
    rule = TriggerRule(config.period_s, config.drift_threshold, config.min_interval_s)
    assert rule == TriggerRule()  # the loop's defaults are the service's
    assert trigger(rule, now, last, window.distribution()) == expected
    assert service._trigger("g") == expected


def test_the_gimbal_loop_triggers_on_start_drift_and_period() -> None:
    loop = GimbalLoop(LAYERS, EXPERTS, GPUS)
    assert loop.replan(0.0) is None and not loop.plans  # no load window yet: nothing to plan (as the service)
    loop.observe(0.5, _uniform())
    assert loop.replan(1.0) is None  # the first report window closed at 1 s: planned, nothing worth moving
    assert [(p.at, p.trigger, p.moved) for p in loop.plans] == [(1.0, "start", False)]
    for t in range(1, 5):  # the same distribution (t = 1..3), then a drift (t = 4) too soon after the start
        loop.observe(t + 0.5, _uniform() if t < 4 else _hot_on_engine_zero(hot=2000.0))
        assert loop.replan(t + 1.0) is None
    assert len(loop.plans) == 1
    loop.observe(5.5, _hot_on_engine_zero(hot=2000.0))
    new = loop.replan(6.0)  # 5 s after the start: the drift counts now
    assert loop.plans[-1].trigger.startswith("drift") and loop.plans[-1].moved and new is not None
    loop.applied(6.5, new)
    loop.observe(7.5, _hot_on_engine_zero(hot=2000.0))
    assert loop.replan(35.9) is None and len(loop.plans) == 2  # no drift since, inside the 30 s period
    loop.replan(36.0)
    assert (loop.plans[-1].at, loop.plans[-1].trigger) == (36.0, "period")


# ----- the coordinated loop moves work away from hot ranks -----


def test_hot_experts_on_one_engines_gpu_are_moved_away() -> None:
    loop = GimbalLoop(LAYERS, EXPERTS, GPUS)
    before = loop.layout().copy()
    hot = _hot_on_engine_zero()
    loop.observe(0.5, hot)
    new = loop.replan(1.0)
    assert new is not None and loop.plans[-1].moved
    loop.applied(1.5, new)
    counts = hot.sum(axis=1)
    assert _imbalance(counts, before) > 2.0  # GPU 0 holds all four hot experts
    assert _imbalance(counts, loop.layout()) < 1.1
    hot_gpus = {g for layer in loop.layout() for g, slots in enumerate(layer) if set(slots.tolist()) & {0, 1, 2, 3}}
    assert hot_gpus == set(range(GPUS))  # one hot expert per rank


def _skewed_sources(engine_zero: float) -> np.ndarray:
    """[L, S, E]: engine s sends only to experts of contiguous block s (local under the default layout), 10
    tokens per expert (engine 0: `engine_zero`), the block's first expert three times as much."""
    load = np.zeros((LAYERS, GPUS, EXPERTS))
    block = EXPERTS // GPUS
    for s in range(GPUS):
        load[:, s, s * block : (s + 1) * block] = engine_zero if s == 0 else 10.0
        load[:, s, s * block] *= 3
    return load


def _run_once(loop: GimbalLoop | EplbLoop, load: np.ndarray) -> np.ndarray:
    loop.observe(0.5, load)
    new = loop.replan(1.0)
    if new is not None:
        loop.applied(1.5, new)
    return loop.layout()


def test_eplb_balances_load_but_ignores_sources_and_gimbal_keeps_traffic_local() -> None:
    skewed = _skewed_sources(engine_zero=30.0)  # engine 0 sends three times as much: balance and locality disagree
    counts = skewed.sum(axis=1)
    contiguous = default_layout(LAYERS, EXPERTS, GPUS)
    eplb = _run_once(EplbLoop(LAYERS, EXPERTS, GPUS, window_size=4, step_interval=4), skewed)
    gimbal = _run_once(GimbalLoop(LAYERS, EXPERTS, GPUS), skewed)
    blind = _run_once(GimbalLoop(LAYERS, EXPERTS, GPUS, source_aware=False), skewed)  # the control: no sources
    assert _imbalance(counts, eplb) < 0.7 * _imbalance(counts, contiguous)  # EPLB balances (2.0 -> 1.33) ...
    assert remote_share(skewed, eplb) > remote_share(skewed, contiguous) == 0.0  # ... and ignores sources
    assert _imbalance(counts, gimbal) <= 1.01 * _imbalance(counts, eplb)  # gimbal: the same balance ...
    assert remote_share(skewed, gimbal) < 0.8 * remote_share(skewed, eplb)  # ... with less remote traffic
    assert remote_share(skewed, blind) > remote_share(skewed, gimbal)  # and it is the source counts that do it


def test_from_a_source_blind_layout_only_the_source_aware_loop_brings_traffic_home() -> None:
    even = _skewed_sources(engine_zero=10.0)  # every engine sends as much: contiguous is balanced and local
    eplb = _run_once(EplbLoop(LAYERS, EXPERTS, GPUS, window_size=4, step_interval=4), even)
    assert remote_share(even, eplb) > 0.3  # EPLB scatters the blocks however it packs them
    aware = _run_once(GimbalLoop(LAYERS, EXPERTS, GPUS, layout=eplb), even)
    blind = _run_once(GimbalLoop(LAYERS, EXPERTS, GPUS, layout=eplb, source_aware=False), even)
    assert remote_share(even, aware) == 0.0 and aware.tolist() != eplb.tolist()
    assert np.array_equal(blind, eplb)  # already balanced: a load-only loop has no reason to move


# ----- one migration at a time -----


@pytest.mark.parametrize("name", ["gimbal", "eplb"])
def test_no_replan_while_a_migration_is_in_flight(name: str) -> None:
    options = {"window_size": 2, "step_interval": 2} if name == "eplb" else {}
    loop = make_placement(name, LAYERS, EXPERTS, GPUS, 1, **options)
    hot = _hot_on_engine_zero()
    loop.observe(0.5, hot)
    loop.observe(0.6, hot)
    new = loop.replan(1.0)
    assert new is not None
    for t in range(2, 80):  # drift, periods and EPLB intervals all pass: still nothing until applied
        loop.observe(t + 0.5, np.roll(hot, 4 * t, axis=2))
        assert loop.replan(t + 1.0) is None
    loop.applied(81.0, new)
    assert np.array_equal(loop.layout(), new)
    again = _uniform()
    for layer in range(LAYERS):  # now the experts the new layout put on rank 0 turn very hot
        again[layer, :, new[layer, 0]] = 1e5
    loop.observe(81.5, again)
    loop.observe(81.6, again)
    assert loop.replan(82.0) is not None  # free again, and rank 0 is hot


def test_eplb_rearranges_on_vllms_step_counter() -> None:
    """vLLM starts its counter at 3/4 of the interval, then rearranges every `step_interval` steps."""
    loop = EplbLoop(LAYERS, EXPERTS, GPUS, window_size=4, step_interval=8)
    hot = _hot_on_engine_zero()
    due = []
    for step in range(1, 19):
        loop.observe(step * 0.01, np.roll(hot, 4 * (step // 8), axis=2))
        new = loop.replan(step * 0.01)
        if new is not None:
            due.append(step)
            loop.applied(step * 0.01, new)
    assert due[0] == 2 and all(b - a == 8 for a, b in itertools.pairwise(due))


def test_eplb_is_hierarchical_only_when_expert_groups_divide_over_nodes() -> None:
    assert not EplbLoop(1, 64, 8).hierarchical  # one node: global
    assert not EplbLoop(1, 64, 16, num_groups=1).hierarchical  # DeepSeek-V2-Lite: one group, two nodes
    assert EplbLoop(1, 256, 32, num_groups=8).hierarchical  # DeepSeek-V3: 8 groups over 4 nodes


# ----- the registry and bad input -----


def test_the_registry_builds_every_control() -> None:
    assert set(PLACEMENT_CONTROLS) >= {"none", "eplb", "gimbal", "gimbal-uncalibrated", "gimbal-load-only"}
    for name, factory in PLACEMENT_CONTROLS.items():
        control: PlacementControl = factory(LAYERS, EXPERTS, GPUS, 2)
        assert control.name == name
        assert control.layout().shape == (LAYERS, GPUS, EXPERTS // GPUS)
    assert make_placement("gimbal-uncalibrated", LAYERS, EXPERTS, GPUS).params == SEED_PARAMS  # type: ignore[attr-defined]
    assert not make_placement("gimbal-load-only", LAYERS, EXPERTS, GPUS).source_aware  # type: ignore[attr-defined]
    assert make_placement("gimbal-staged", LAYERS, EXPERTS, GPUS).policy.stage_bytes == STAGED_BYTES  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown placement 'best'"):
        make_placement("best", LAYERS, EXPERTS, GPUS)
    with pytest.raises(ValueError, match="tp"):
        GimbalLoop(LAYERS, EXPERTS, GPUS, tp=3)
    with pytest.raises(ValueError, match=r"\[L, S, E\]"):
        GimbalLoop(LAYERS, EXPERTS, GPUS, tp=2).observe(0.0, _uniform())  # 4 sources, but tp 2 makes 2 engines


# ----- the traffic counts -----


def test_a2a_sends_of_a_hand_computed_token() -> None:
    """Ranks 0..3 on node 0, 4..7 on node 1 (ranks_per_node 4); expert e on rank e (one slot each)."""
    layout = default_layout(1, 8, 8)
    token = np.array([[[0, 1, 2, 5, 6, 7]]])  # experts on ranks 0, 1, 2 (node 0) and 5, 6, 7 (node 1)
    sends = a2a_sends(token, layout, np.array([0]), ranks_per_node=4)
    assert (sends.nvlink.tolist(), sends.network.tolist(), sends.network_nodes.tolist()) == ([2], [3], [1])
    twice = a2a_sends(np.array([[[1, 1, 4]]]), layout, np.array([1]), ranks_per_node=4)  # own rank, one remote
    assert (twice.nvlink.tolist(), twice.network.tolist()) == ([0], [1])
    replicated = np.array([[[0, 1], [2, 1]]])  # expert 1 on both ranks (ranks_per_node 1: each its own node)
    near = a2a_sends(np.array([[[1]], [[1]]]), replicated, np.array([0, 1]), ranks_per_node=1)
    assert near.network.tolist() == [0]  # each token uses its own rank's copy
    with pytest.raises(ValueError, match="source ranks"):
        a2a_sends(token, layout, np.array([8]))


def test_distance_prices_nvlink_below_the_network() -> None:
    """With the nodes given, a remote GPU on the source's own node costs the NVLink fraction, across nodes 1."""
    from switchyard.solver.placement.policy import distance_matrix

    d = distance_matrix(4, [0, 0, 1, 1, 2, 2, 3, 3], gpu_nodes=[0, 0, 0, 0, 1, 1, 1, 1], same_node_cost=0.25)
    assert d[0].tolist() == [0, 0, 0.25, 0.25, 1, 1, 1, 1]
    assert d[3].tolist() == [1, 1, 1, 1, 0.25, 0.25, 0, 0]
    assert distance_matrix(2, [0, 1]).tolist() == [[0, 1], [1, 0]]  # the service's prices: unchanged
    loop = GimbalLoop(2, 8, 8, 2, ranks_per_node=4, nvlink_cost=0.25)
    assert loop.distance[1].tolist() == [0.25, 0.25, 0, 0, 1, 1, 1, 1]
