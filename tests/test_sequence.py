"""One rule for reading telemetry sequence numbers, shared by the router and the other services."""

from __future__ import annotations

import pytest

from switchyard.services.fleet_view import FleetView
from switchyard.shared.schemas import Telemetry
from switchyard.shared.sequence import Seq, classify


@pytest.mark.parametrize(
    ("last", "seq", "event", "missed"),
    [
        (None, 7, Seq.FIRST, 0),
        (-1, 0, Seq.FIRST, 0),
        (4, 5, Seq.NEXT, 0),
        (4, 9, Seq.GAP, 4),
        (100, 98, Seq.LATE, 0),
        (100, 100, Seq.LATE, 0),  # a duplicate is late too
        (100, 3, Seq.RESTART, 0),
        (5000, 3000, Seq.RESTART, 0),
        (5000, 4990, Seq.LATE, 0),
        (1300, 1001, Seq.RESTART, 0),  # after a forged +300: the engine's next real message is taken
        (2**63 - 1, 0, Seq.RESTART, 0),
    ],
)
def test_classify(last: int | None, seq: int, event: Seq, missed: int) -> None:
    assert classify(last, seq) == (event, missed)


def _t(seq: int, running: int) -> Telemetry:
    return Telemetry(
        engine_id="e",
        seq=seq,
        ts=0.0,
        kv_usage=0.0,
        num_running=running,
        num_waiting=0,
        waiting_prefill_tokens=0,
        remaining_prefill_tokens=0,
        step_time_ema=0.0,
    )


def test_fleet_view_drops_late_messages_and_counts_gaps_and_restarts() -> None:
    view = FleetView(clock=lambda: 0.0)
    for seq, running in [(10, 1), (11, 2), (15, 3), (13, 99), (0, 4)]:
        view.on_telemetry(_t(seq, running))
    state = view.engines["e"]
    assert state.telemetry_gaps == 3 and state.restarts == 1
    assert state.telemetry is not None and state.telemetry.num_running == 4  # the late 99 never replaced 3


def test_fleet_view_forgets_engines_silent_for_long() -> None:
    now = [0.0]
    view = FleetView(clock=lambda: now[0], forget_after_s=100.0)
    view.on_telemetry(_t(0, 1))
    now[0] = 500.0
    view.on_telemetry(Telemetry(**{**_t(0, 1).model_dump(), "engine_id": "other"}))
    assert set(view.engines) == {"other"}
