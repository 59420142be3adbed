"""Gimbal dispatch and SJF-with-aging ordering."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from solver.routing.dispatch import GimbalParams, kv_penalty, pick_dp_engine, pressure_scores, queue_order

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
