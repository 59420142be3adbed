"""A migration priced at the requests waiting when it would run (issue 40: near saturation a migration among the
arrivals cost latency out of proportion to its step time, and the rule published it)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from switchyard.simulator.core.ep import EpTopology, step_cost
from switchyard.simulator.core.physics import CostModel, get_gpu, get_model
from switchyard.simulator.core.placement_loop import PLACEMENT_CONTROLS, GimbalLoop
from switchyard.solver.placement import DEFAULT_PARAMS
from switchyard.solver.placement.layouts import default_layout
from switchyard.solver.placement.payoff import MigrationPrice, StepContext
from switchyard.solver.placement.policy import Policy, TriggerRule, decide, trigger

LAYERS, EXPERTS = 2, 8


def _hot(hot: list[int], load: float = 50_000.0) -> np.ndarray:
    counts = np.full((LAYERS, EXPERTS), load / 100)
    counts[:, hot] = load
    return counts


def _physics() -> tuple[object, MigrationPrice]:
    spec = get_model("deepseek-v2-lite")
    cost = CostModel(spec, get_gpu("H100"), gpus=1)
    return step_cost(cost, EpTopology(ranks=2, hidden=spec.hidden)), MigrationPrice(spec.expert_bytes)


def _context(running: int, waiting: int, horizon_s: float = 30.0) -> StepContext:
    cost, price = _physics()
    return StepContext(cost, price, 0.02, horizon_s, 1.0, False, 0.25, 1.0, running, waiting)  # type: ignore[arg-type]


def _decide(ctx: StepContext):  # type: ignore[no-untyped-def]
    return decide(
        _hot([0, 1, 2, 3]), None, None, default_layout(LAYERS, EXPERTS, 2), DEFAULT_PARAMS, Policy(), None, ctx
    )


def test_nobody_waiting_is_the_rule_before_and_a_queue_multiplies_the_cost() -> None:
    idle, calm = _decide(_context(0, 0)), _decide(_context(64, 0))
    assert idle.payoff is not None and calm.payoff is not None
    assert calm.payoff.queue_factor == idle.payoff.queue_factor == 1.0
    assert calm.payoff.as_dict() == idle.payoff.as_dict() and calm.publish
    queued = _decide(_context(64, 64))
    assert queued.payoff is not None and queued.payoff.queue_factor == pytest.approx(2.0)
    assert queued.payoff.cost_s == pytest.approx(2.0 * calm.payoff.cost_s)
    assert queued.payoff.gain_s == pytest.approx(calm.payoff.gain_s)  # the saving is what it was
    assert queued.payoff.as_dict()["queue_factor"] == pytest.approx(2.0)
    # all waiting, none running (a full KV cache): each waiting request counts as one running would
    assert _context(0, 3).queue_factor == pytest.approx(4.0)
    with pytest.raises(ValueError):
        _context(-1, 0)


def test_a_move_that_pays_only_with_the_queue_drained_is_deferred_not_dropped() -> None:
    calm = _decide(_context(64, 0))
    assert calm.publish and calm.payoff is not None
    # enough requests waiting that the cost outgrows the saving
    factor = 2.0 * calm.payoff.gain_s / calm.payoff.cost_s
    waiting = int(np.ceil((factor - 1.0) * 64))
    busy = _decide(_context(64, waiting))
    assert not busy.publish and busy.screened and busy.deferred
    assert "does not pay" in busy.reason and "deferred" in busy.reason and "requests waiting" in busy.reason
    # the control: a move that would not pay with nobody waiting is not "deferred" (nothing to wait for)
    short = _decide(_context(64, waiting, horizon_s=0.05))
    assert not short.publish and not short.deferred and "deferred" not in short.reason
    assert not calm.deferred and "requests waiting" not in calm.reason


def test_a_deferred_plan_is_asked_again_after_the_minimum_interval() -> None:
    rule = TriggerRule(period_s=30.0, drift_threshold=0.1, min_interval_s=5.0)
    dist = np.full((LAYERS, EXPERTS), 1 / EXPERTS)
    last = (10.0, dist)
    assert trigger(rule, 12.0, last, dist, deferred=True) is None
    assert trigger(rule, 15.0, last, dist, deferred=True) == "deferred"
    assert trigger(rule, 15.0, last, dist) is None  # the control: not deferred, nothing has drifted


def _loop(queue_aware: bool) -> GimbalLoop:
    cost, price = _physics()
    factory = PLACEMENT_CONTROLS["gimbal" if queue_aware else "gimbal-queue-blind"]
    return factory(LAYERS, EXPERTS, 2, 1, step_cost=cost, migration=price)  # type: ignore[return-value]


def _drive(loop: GimbalLoop, until: float, waiting_until: float, start: float = 0.0) -> None:
    """A persistent skew; requests wait (10 per running one) until `waiting_until`."""
    step = 0.02
    for i in range(int(start / step), int(until / step)):
        now = i * step
        per_source = np.stack([_hot([0, 1, 2, 3], 5000.0)] * 2, axis=1)
        loop.observe(now, per_source, running=32, waiting=320 if now < waiting_until else 0)
        if loop.replan(now) is not None:
            assert loop.last_decision is not None
            loop.applied(now, loop.last_decision.placement)


def test_the_simulated_loop_defers_while_requests_wait_and_moves_once_they_drain() -> None:
    """A persistent skew (it pays after the first window): the queue-blind control moves at its first chance
    (the period, 30 s after the start plan at 1 s) among the waiting requests; the loop defers it, and moves at
    the next ask once the queue has drained (the period's plan is deferred while 320 wait; 5 s later, none
    wait: it moves)."""
    blind, aware = _loop(False), _loop(True)
    _drive(blind, 31.5, 32.0)
    _drive(aware, 31.5, 32.0)
    assert [(p.trigger, p.moved) for p in blind.plans] == [("start", False), ("period", True)]
    assert [(p.trigger, p.moved) for p in aware.plans] == [("start", False), ("period", False)]
    assert "deferred" in aware.plans[-1].reason and aware._deferred
    _drive(aware, 35.9, 32.0, start=31.5)
    assert len(aware.plans) == 2  # not asked again before the minimum interval
    _drive(aware, 37.0, 32.0, start=35.9)
    assert [(p.trigger, p.moved) for p in aware.plans][-1] == ("deferred", True)
    # the checks record the prediction it moved on: the queue gone, the factor 1 again
    assert aware.checks and aware.last_decision is not None and aware.last_decision.payoff is not None
    assert aware.last_decision.payoff.queue_factor == 1.0


def test_the_loop_rejects_negative_queue_counts() -> None:
    loop = _loop(True)
    with pytest.raises(ValueError):
        loop.observe(0.0, np.zeros((LAYERS, 2, EXPERTS)), running=-1)
    assert replace(_context(1, 1), waiting=0).queue_factor == 1.0
