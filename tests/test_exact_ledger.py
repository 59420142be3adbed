"""The dispatcher's exact ledger: unit behaviour, and over simulated runs it equals the engines' ground truth at
every decision (it never counts a finished request)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from switchyard.simulator.core.workload import load_request_csv
from switchyard.simulator.offline import dp as dp_module
from switchyard.simulator.offline.dp import Dispatcher, DPFleetConfig, simulate_dp
from switchyard.simulator.offline.scenario import Scenario, prepare
from switchyard.solver.routing.dispatch import GimbalParams
from switchyard.solver.routing.exact_ledger import RECENT_TAU_S, ExactLedger, RecentSends
from switchyard.solver.routing.profiles import dp_profile
from tests.conftest import SHIPPED_DATA
from tests.eldr_helpers import ESFT_DIR

AZURE = SHIPPED_DATA / "requests" / "azure_llm_2023"


def test_sent_first_token_finished_move_a_request_through_the_columns() -> None:
    led = ExactLedger(2)
    led.sent("a", 0, 100)
    led.sent("b", 0, 30)
    led.sent("c", 1, 7)
    assert led.pending.tolist() == [2, 1] and led.pending_prefill.tolist() == [130, 7]
    led.first_token("a")
    assert led.pending.tolist() == [1, 1] and led.pending_prefill.tolist() == [30, 7]
    assert led.decoding.tolist() == [1, 0]
    led.first_token("a")  # a repeat changes nothing
    assert led.decoding.tolist() == [1, 0] and led.pending_prefill.tolist() == [30, 7]
    led.finished("a")
    led.finished("c")  # ended before its first token (failed, cancelled): its prefill is no longer owed
    assert led.decoding.tolist() == [0, 0] and led.pending.tolist() == [1, 0]
    assert led.pending_prefill.tolist() == [30, 0] and led.open == 1 and "a" not in led


def test_unknown_and_late_reports_never_drive_counts_negative() -> None:
    led = ExactLedger(1)
    led.sent(1, 0, 10)
    led.finished(1)
    led.finished(1)  # duplicated end
    led.first_token(1)  # a first token arriving after the end
    led.first_token(99)  # never sent
    assert led.unknown == 3
    assert led.pending.tolist() == [0] and led.decoding.tolist() == [0] and led.pending_prefill.tolist() == [0]


def test_bad_input_is_a_clear_error() -> None:
    led = ExactLedger(2)
    led.sent("x", 1, 5)
    with pytest.raises(ValueError, match="already in the ledger"):
        led.sent("x", 0, 5)
    with pytest.raises(ValueError, match="out of range"):
        led.sent("y", 2, 5)
    with pytest.raises(ValueError, match="rows must be"):
        ExactLedger(-1)


def test_clear_resize_compact_keep_rows_and_requests_consistent() -> None:
    led = ExactLedger(3)
    led.sent("a", 0, 10)
    led.sent("b", 1, 20)
    led.sent("c", 2, 30)
    led.first_token("c")
    led.clear(0)  # engine 0 restarted
    assert "a" not in led and led.pending.tolist() == [0, 1, 0]
    led.compact(np.array([2, 1]))  # engine 0 left; 2 and 1 renumbered 0 and 1
    assert led.row_of("c") == 0 and led.row_of("b") == 1
    assert led.decoding.tolist() == [1, 0, 0] and led.pending_prefill.tolist() == [0, 20, 0]
    led.finished("c")
    assert led.decoding.tolist() == [0, 0, 0]
    led.resize(5)
    led.sent("d", 4, 1)
    assert len(led) == 5 and led.pending.tolist() == [0, 1, 0, 0, 1]


def test_recent_sends_decay_with_their_time_constant() -> None:
    rec = RecentSends(3, tau_s=0.02)
    assert rec.at(5.0).tolist() == [0, 0, 0]
    rec.sent(0, 5.0)
    rec.sent(0, 5.0)
    rec.sent(2, 5.01)
    col = rec.at(5.02)
    assert col is rec.column, "decayed in place: a snapshot holding the array sees it"
    assert col[0] == pytest.approx(2 * math.exp(-1)) and col[2] == pytest.approx(math.exp(-0.5)) and col[1] == 0
    rec.sent(1, 5.01)  # stamped before the column's time (another replica's decision): counts as already decayed
    assert rec.column[1] == pytest.approx(math.exp(-0.5))
    assert rec.at(5.0)[0] == pytest.approx(2 * math.exp(-1)), "never decays backwards"
    assert rec.at(6.0).max() < 1e-20, "gone after a second"
    rec.compact(np.array([2]))
    rec.resize(4)
    assert len(rec) == 4 and rec.column[1:].tolist() == [0, 0, 0]
    assert RecentSends(1).tau_s == RECENT_TAU_S
    with pytest.raises(ValueError, match="out of range"):
        rec.sent(4, 7.0)
    with pytest.raises(ValueError, match="tau_s"):
        RecentSends(1, tau_s=0.0)
    with pytest.raises(ValueError, match="rows must be"):
        RecentSends(-1)


def test_gimbal_exact_alternates_consecutive_arrivals_until_their_sends_decay() -> None:
    """Decode load favours engine 0 (one decoding request against two); a send there just now weighs more, so
    the next arrival goes to engine 1, and once that send has decayed, to engine 0 again."""
    d = Dispatcher("gimbal-exact", 2, GimbalParams(), 0.05)
    assert d.tracks_recent and "recent_sends" in d.profile.columns
    for rid in (100, 101):
        d.exact.sent(rid, 1, 50)
        d.exact.first_token(rid)
    assert d.choose(0.0, 400, rid=0) == 0
    d.on_progress([0], [])  # prefilled within the step: no owed prefill anywhere, decode load 1 against 2
    assert d.choose(0.005, 400, rid=1) == 1, "the send 5 ms ago weighs more than one decoding request"
    d.on_progress([1], [])
    assert d.choose(1.0, 400, rid=2) == 0, "a second later both sends are gone: decode load decides"
    assert d.snap.columns["recent_sends"] is d.recent.column
    no_term = Dispatcher("gimbal-exact", 2, GimbalParams(), 0.05, weights={"recent_sends": 0.0})
    assert not no_term.tracks_recent


@pytest.fixture(scope="module")
def esft() -> Scenario:
    return prepare(ESFT_DIR, gpu="H100", gpus=2, seed=0)


@pytest.mark.parametrize("coupled", [True, False], ids=["lock-step", "independent"])
@pytest.mark.parametrize("order", ["fcfs", "sjf-aging"])
def test_exact_ledger_equals_the_engines_at_every_decision(esft: Scenario, order: str, coupled: bool) -> None:
    """Property over a simulated run with preemptions: at every decision the ledger's pending requests, their
    prompt tokens and its decoding requests equal what the engines hold (`dp._check_exact_ledger`, run by
    check=True before each decision); it never holds a finished request."""
    calls = 0
    real = dp_module._check_exact_ledger

    def counted(*args: object) -> None:
        nonlocal calls
        calls += 1
        real(*args)  # type: ignore[arg-type]

    fleet = DPFleetConfig(cost=esft.cost, engines=3, coupled=coupled, kv_blocks=120, max_running=10, token_budget=512)
    wl = esft.workload(
        120, seed=2, requests=load_request_csv(AZURE / "AzureLLMInferenceTrace_conv.csv"), time_scale=300.0
    )
    wl = dataclasses.replace(wl, prompt=np.minimum(wl.prompt, 1200), output=np.minimum(wl.output, 120))
    dp_module._check_exact_ledger = counted
    try:
        res = simulate_dp(wl, esft.bank, fleet, "gimbal-exact", order, seed=2, check=True,
                          prefill_counts=esft.counts.prefill[esft.replay])  # fmt: skip
    finally:
        dp_module._check_exact_ledger = real
    assert calls == wl.size, "checked at every decision"
    assert res.engine_preemptions.sum() > 0, "the small caches must preempt (a decoding request back to waiting)"
    assert np.isfinite(res.finish).all()


def test_the_check_catches_a_ledger_that_keeps_a_finished_request(esft: Scenario) -> None:
    """The property test can fail: a dispatcher that drops the end events is caught at the next decision."""
    fleet = DPFleetConfig(cost=esft.cost, engines=2)
    wl = esft.workload(
        40, seed=1, requests=load_request_csv(AZURE / "AzureLLMInferenceTrace_code.csv"), time_scale=20.0
    )
    original = Dispatcher.on_progress
    Dispatcher.on_progress = lambda self, first, finished: original(self, first, [])  # type: ignore[method-assign]
    try:
        with pytest.raises(AssertionError, match="ledger"):
            simulate_dp(wl, esft.bank, fleet, "gimbal-exact", seed=1, check=True)
    finally:
        Dispatcher.on_progress = original  # type: ignore[method-assign]


def test_profiles_read_the_ledger_and_the_shuffled_control_moves_its_rows() -> None:
    cols = dp_profile("gimbal-exact").columns
    assert {"pending_prefill", "pending", "decoding", "kv_usage", "expert_pressure"} <= cols
    assert not cols & {"remaining_prefill", "waiting_prefill", "inflight_tokens"}, "no telemetry-timed prefill"
    assert "pending_prefill" in dp_profile("switchyard-exact").columns
    assert "recent_sends" in cols and "recent_sends" not in dp_profile("switchyard-exact").columns
    d = Dispatcher("gimbal-exact", 4, GimbalParams(), 0.05, seed=3, ledger_control="shuffled")
    for rid, tokens in enumerate((100, 200, 300, 400)):
        d.exact.sent(rid, rid, tokens)
    d.choose(0.0, 10, rid=9)
    fed = d.snap.columns["pending_prefill"]
    assert sorted(fed.tolist()) == [100, 200, 300, 400] and fed is not d.exact.pending_prefill
    with pytest.raises(ValueError, match="ledger_control"):
        Dispatcher("gimbal-exact", 2, GimbalParams(), 0.05, ledger_control="late")
