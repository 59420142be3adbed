"""Gimbal dispatch and SJF-with-aging ordering."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from switchyard.solver.routing.dispatch import (
    GimbalParams,
    kv_first_applies,
    kv_penalty,
    pick_dp_engine,
    pick_jsq,
    pick_round_robin,
    pick_vllm,
    pick_vllm_main,
    pressure_scores,
    queue_order,
)

P = GimbalParams()


def _pick(kv, rem, wait, comp=None, moe=None, alive=None) -> int:
    n = len(kv)
    f = lambda x, d: np.asarray(x if x is not None else [d] * n, dtype=float)  # noqa: E731
    return pick_dp_engine(
        np.asarray(alive if alive is not None else [True] * n),
        f(kv, 0),
        f(rem, 0),
        f(wait, 0),
        f(comp, 0),
        f(moe, 1),
        P,
    )


def test_lowest_pressure_wins_when_kv_is_roomy() -> None:
    assert _pick(kv=[0.2, 0.2, 0.2], rem=[500, 100, 300], wait=[0, 0, 0]) == 1
    assert _pick(kv=[0.2, 0.2, 0.2], rem=[100, 100, 100], wait=[900, 0, 50]) == 1


def test_in_flight_compensation_steers_away_from_just_chosen_engine() -> None:
    assert _pick(kv=[0.1, 0.1], rem=[0, 0], wait=[0, 0], comp=[4000, 0]) == 1


def test_kv_first_rule_when_caches_are_full_and_uneven() -> None:
    # engine 0 has the least prefill work, but caches are >90% somewhere with a >10% spread: lowest KV wins
    assert _pick(kv=[0.70, 0.95, 0.80], rem=[0, 10, 10], wait=[0, 0, 0]) == 0
    assert _pick(kv=[0.93, 0.95, 0.80], rem=[0, 10, 10], wait=[0, 0, 0]) == 2
    # full but even caches: back to pressure scores
    assert _pick(kv=[0.95, 0.95, 0.95], rem=[10, 500, 0], wait=[0, 0, 0]) == 2


def test_expert_pressure_breaks_ties() -> None:
    assert _pick(kv=[0.3, 0.3], rem=[100, 100], wait=[0, 0], moe=[3.0, 1.2]) == 1


def test_dead_engines_are_never_chosen() -> None:
    assert _pick(kv=[0.0, 0.9], rem=[0, 9000], wait=[0, 0], alive=[False, True]) == 1
    assert _pick(kv=[0.0, 0.0], rem=[0, 0], wait=[0, 0], alive=[False, False]) == -1


def test_kv_penalty_is_monotone_and_finite() -> None:
    kv = np.linspace(0, 1, 101)
    penalty = kv_penalty(kv, P)
    assert np.all(np.diff(penalty) > 0) and np.isfinite(penalty).all()
    assert penalty[50] == pytest.approx(P.kv_cost_tokens)


@given(
    hnp.arrays(np.float64, 6, elements=st.floats(0, 1)),
    hnp.arrays(np.float64, 6, elements=st.floats(0, 1e6)),
    hnp.arrays(np.bool_, 6),
)
def test_choice_is_always_a_live_minimum(kv: np.ndarray, rem: np.ndarray, alive: np.ndarray) -> None:
    zeros, ones = np.zeros(6), np.ones(6)
    choice = pick_dp_engine(alive, kv, rem, zeros, zeros, ones, P)
    if not alive.any():
        assert choice == -1
        return
    assert alive[choice]
    live = kv[alive]
    if not (live.max() > P.kv_high and live.max() - live.min() > P.kv_spread):
        scores = pressure_scores(kv, rem, zeros, zeros, ones, P)
        assert scores[choice] == scores[alive].min()
    else:
        assert kv[choice] == live.min()


def test_queue_order_is_shortest_first_with_aging() -> None:
    tokens = np.array([900, 50, 400, 50, 2000])
    waited = np.array([1.0, 0.5, 6.0, 0.2, 9.0])
    # aged (waited > 5 s): idx 4 (9 s) then idx 2 (6 s); then SJF: 50 (idx 1), 50 (idx 3, later), 900
    assert queue_order(tokens, waited, P).tolist() == [4, 2, 1, 3, 0]


def test_queue_order_is_a_permutation() -> None:
    rng = np.random.default_rng(0)
    tokens, waited = rng.integers(1, 4000, 200), rng.uniform(0, 10, 200)
    order = queue_order(tokens, waited, P)
    assert sorted(order.tolist()) == list(range(200))
    fresh = order[~(waited[order] > P.age_threshold_s)]
    assert np.all(np.diff(tokens[fresh]) >= 0)


def test_kv_first_applies_only_above_the_threshold_with_a_spread() -> None:
    alive = np.array([True, True, True])
    assert kv_first_applies(alive, np.array([0.91, 0.75, 0.85]), P)
    assert not kv_first_applies(alive, np.array([0.89, 0.10, 0.50]), P), "no cache above 90 %"
    assert not kv_first_applies(alive, np.array([0.95, 0.93, 0.91]), P), "spread within 10 %"
    # a dead engine's empty cache does not create a spread
    assert not kv_first_applies(np.array([True, True, False]), np.array([0.95, 0.93, 0.0]), P)


def test_round_robin_cycles_over_live_engines() -> None:
    alive = np.array([True, False, True, True])
    picks, prev = [], -1
    for _ in range(6):
        prev = pick_round_robin(alive, prev)
        picks.append(prev)
    assert picks == [0, 2, 3, 0, 2, 3]
    assert pick_round_robin(np.zeros(3, dtype=bool), 0) == -1


def test_jsq_picks_fewest_outstanding_lowest_index_on_ties() -> None:
    assert pick_jsq(np.ones(4, dtype=bool), np.array([3, 1, 1, 2])) == 1
    assert pick_jsq(np.array([True, False, True, True]), np.array([3, 0, 5, 2])) == 3


def test_vllm_weighs_waiting_four_times_running_and_scans_from_start() -> None:
    alive = np.ones(3, dtype=bool)
    # scores 4*1+0 = 4, 0*4+5 = 5, 4*0+4 = 4: first minimum from index 0 is engine 0, from 1 it is engine 2
    waiting, running = np.array([1, 0, 0]), np.array([0, 5, 4])
    assert pick_vllm(alive, waiting, running, start=0) == 0
    assert pick_vllm(alive, waiting, running, start=1) == 2
    assert pick_vllm(np.array([False, True, True]), waiting, running, start=0) == 2


def test_vllm_main_uses_inflight_floor_and_kv_pressure_on_waiting() -> None:
    alive = np.ones(2, dtype=bool)
    # equal snapshots, but the client knows 5 requests of its own are still on engine 0
    assert pick_vllm_main(alive, np.zeros(2), np.zeros(2), np.zeros(2), np.array([5, 0])) == 1
    # same waiting + running; engine 0's queue sits on a 95 % full cache: 2 + 2*6*0.45 = 7.4 > 4
    w, r = np.array([2, 0]), np.array([0, 4])
    assert pick_vllm_main(alive, w, r, np.array([0.95, 0.2]), np.zeros(2)) == 1
    assert pick_vllm_main(alive, w, r, np.array([0.4, 0.2]), np.zeros(2)) == 0  # no penalty below 50 %


@given(
    hnp.arrays(np.float64, 5, elements=st.floats(0, 1e4)),
    hnp.arrays(np.float64, 5, elements=st.floats(0, 1e4)),
    hnp.arrays(np.bool_, 5),
    st.integers(-1, 9),
)
def test_every_baseline_returns_a_live_engine(
    waiting: np.ndarray, running: np.ndarray, alive: np.ndarray, start: int
) -> None:
    picks = [
        pick_round_robin(alive, start),
        pick_jsq(alive, running),
        pick_vllm(alive, waiting, running, start % 5),
        pick_vllm_main(alive, waiting, running, waiting / 1e4, running, start % 5),
    ]
    for choice in picks:
        assert (choice == -1) == (not alive.any())
        if choice >= 0:
            assert alive[choice]
    if alive.any():
        scores = 4 * waiting + running
        assert scores[picks[2]] == scores[alive].min()
        assert running[picks[1]] == running[alive].min()
