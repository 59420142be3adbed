"""The router's columnar fleet view: liveness, sequence checks, in-flight compensation, the cached role view."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.services.router.core import COLUMNS, RoleView
from switchyard.services.router.telemetry_view import TelemetryView
from switchyard.shared.schemas import Capacity, Hello, ModelShape, Telemetry
from tests.helpers import telemetry as _telemetry

SHAPE = ModelShape(name="m", num_layers=2, num_experts=8, top_k=2)


def hello(engine_id: str, role: str = "decode") -> Hello:
    return Hello(
        engine_id=engine_id,
        role=role,
        model=SHAPE,
        ep_group="g",
        gpus=["0"],
        capacity=Capacity(max_running=32, kv_blocks=100, block_size=16),
        ts=0.0,
        agent="sim",
    )


def telemetry(engine_id: str, seq: int, running: int = 0, kv: float = 0.1) -> Telemetry:
    return _telemetry(engine_id, seq, num_running=running, kv_usage=kv)


def test_engines_drop_out_when_silent_and_return_when_heard() -> None:
    fleet = TelemetryView(fresh_load_s=1.0)
    for i in range(3):
        fleet.on_hello(hello(f"d{i}"), now=0.0)
        fleet.on_telemetry(telemetry(f"d{i}", 0), now=0.0)
    fleet.on_hello(hello("p0", "prefill"), now=0.0)
    assert fleet.alive("decode", now=0.5).tolist() == [True, True, True, False]
    fleet.on_telemetry(telemetry("d0", 1), now=1.2)
    fleet.on_telemetry(telemetry("d2", 1), now=1.2)
    assert fleet.alive("decode", now=1.5).tolist() == [True, False, True, False]
    assert fleet.stale_count(now=1.5) == 2  # d1 and p0
    fleet.on_telemetry(telemetry("d1", 2), now=1.6)
    assert fleet.alive("decode", now=1.7).tolist() == [True, True, True, False]


def test_telemetry_before_hello_is_not_a_candidate() -> None:
    fleet = TelemetryView()
    fleet.on_telemetry(telemetry("d9", 0), now=0.0)
    assert not fleet.alive("decode", now=0.0).any()
    fleet.on_hello(hello("d9"), now=0.1)
    assert fleet.alive("decode", now=0.1).tolist() == [True]


def test_sequence_gaps_reorders_and_restarts() -> None:
    fleet = TelemetryView()
    fleet.on_hello(hello("d0"), 0.0)
    fleet.on_telemetry(telemetry("d0", 10, running=5), 0.0)
    fleet.on_telemetry(telemetry("d0", 13, running=6), 0.1)
    assert fleet.counters.telemetry_gaps == 1
    fleet.on_telemetry(telemetry("d0", 12, running=99), 0.2)  # late and older: ignored
    assert fleet.counters.telemetry_out_of_order == 1 and fleet.num_running[0] == 6
    fleet.on_decision("d0", 100, now=0.25)
    fleet.on_telemetry(telemetry("d0", 0, running=0), 0.3)  # restarted engine
    assert fleet.counters.engine_restarts == 1 and fleet.num_running[0] == 0 and fleet.inflight[0] == 0


def test_inflight_compensation_until_telemetry_catches_up() -> None:
    fleet = TelemetryView(inflight_grace_s=0.05)
    for i in range(2):
        fleet.on_hello(hello(f"d{i}"), 0.0)
        fleet.on_telemetry(telemetry(f"d{i}", 0, running=4), 0.0)
    for k in range(3):
        fleet.on_decision("d0", 200, now=1.0 + k * 0.01)
    np.testing.assert_array_equal(fleet.load(), [7, 4])
    assert fleet.inflight_tokens[0] == 600
    fleet.on_telemetry(telemetry("d0", 1, running=5), now=1.065)  # reflects decisions made before 1.015
    assert fleet.inflight[0] == 1 and fleet.inflight_tokens[0] == 200
    fleet.on_telemetry(telemetry("d0", 2, running=7), now=1.5)
    np.testing.assert_array_equal(fleet.load(), [7, 4])


def test_columns_grow_past_initial_capacity() -> None:
    fleet = TelemetryView(capacity=2)
    for i in range(9):
        fleet.on_hello(hello(f"d{i}"), 0.0)
        fleet.on_telemetry(telemetry(f"d{i}", 0, running=i), 0.0)
    assert len(fleet) == 9
    np.testing.assert_array_equal(fleet.load(), np.arange(9))
    assert fleet.alive("decode", 0.0).all()


_ENGINES = ["d0", "d1", "d2", "p0"]
_events = st.one_of(
    st.tuples(st.just("tick"), st.just(""), st.sampled_from([0.0, 0.01, 0.3, 0.7, 1.0, 1.5, -0.2, -1.0])),
    st.tuples(st.just("hello"), st.sampled_from(_ENGINES), st.sampled_from(["decode", "decode", "prefill"])),
    st.tuples(st.just("telemetry"), st.sampled_from(_ENGINES), st.sampled_from([1, 1, 1, 5, -1, -100])),
    st.tuples(st.just("route"), st.just(""), st.integers(0, 7)),
    st.tuples(st.just("shared"), st.sampled_from([*_ENGINES, "unknown"]), st.just(0)),
    st.tuples(st.just("forget"), st.just(""), st.just(0)),
    st.tuples(st.just("look"), st.just(""), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(_events, min_size=10, max_size=80), running=st.lists(st.integers(0, 9), min_size=80, max_size=80)
)
def test_role_view_kept_in_step_equals_a_fresh_read(events: list[tuple], running: list[int]) -> None:
    """The router's cached decode view (re-read only on data changes, liveness re-checked only when an engine
    may have expired, its own decisions applied in place, to its load and to every gathered column) always
    shows what reading the fleet afresh shows."""
    fleet = TelemetryView(fresh_load_s=1.0, inflight_grace_s=0.05, capacity=2)
    view = RoleView(fleet, "decode")
    now, seq = 10.0, dict.fromkeys(_ENGINES, 0)
    names = tuple(COLUMNS)

    def look() -> None:
        view.rebuild()
        snap = view.refresh(now, 1.0)
        view.gather(names)
        fresh = RoleView(fleet, "decode")
        expected = fresh.refresh(now, 1.0)
        fresh.gather(names)
        assert snap.engine_ids == expected.engine_ids
        np.testing.assert_array_equal(snap.load, expected.load)
        np.testing.assert_array_equal(snap.kv_usage, expected.kv_usage)
        np.testing.assert_array_equal(snap.alive, expected.alive)
        assert view.any_alive == bool(expected.alive.any())
        for name in names:
            np.testing.assert_array_equal(snap.columns[name], expected.columns[name], err_msg=name)

    for n, (kind, engine, x) in enumerate(events):
        if kind == "tick":
            now += x
        elif kind == "hello":
            fleet.on_hello(hello(engine, x), now)
        elif kind == "telemetry":
            seq[engine] = max(seq[engine] + x, 0)  # forward, gaps, reordering, restarts
            fleet.on_telemetry(telemetry(engine, seq[engine], running=running[n], kv=running[n] / 10), now)
        elif kind == "route":  # what RouterCore.route_decode does around its policy
            view.rebuild()
            snap = view.refresh(now, 1.0)
            view.gather(names)
            live = np.flatnonzero(snap.alive)
            if len(live):
                row = int(view.rows[live[x % len(live)]])
                fleet.on_decision_row(row, 100 + x, now)
                view.record_decision(row, 100 + x)
        elif kind == "shared":  # another replica's decision
            row = fleet.on_decision(engine, 50, now)
            if row >= 0:
                view.record_decision(row, 50)
        elif kind == "forget":
            fleet.forget(now, 2.0)
        else:
            look()
    look()


def test_gathered_columns_follow_decisions_in_place_and_are_re_read_after_a_report() -> None:
    fleet = TelemetryView(fresh_load_s=1.0, inflight_grace_s=0.05)
    for engine_id in ("a", "b"):
        fleet.on_hello(hello(engine_id, "dp"), 0.0)
    view = RoleView(fleet, "dp")
    names = ("inflight_tokens", "remaining_prefill", "waiting")
    view.gather(names)
    before = dict(view.snap.columns)
    row = fleet.index["b"]
    fleet.on_decision_row(row, 300, 0.1)
    view.record_decision(row, 300)
    view.gather(names)
    assert all(view.snap.columns[name] is before[name] for name in names)  # no re-read...
    assert view.snap.columns["inflight_tokens"].tolist() == [0.0, 300.0]  # ...the decision applied in place
    assert view.snap.columns["waiting"].tolist() == [0.0, 1.0]
    fleet.on_telemetry(telemetry("b", 1), 0.2)
    view.gather(names)
    assert view.snap.columns["inflight_tokens"] is not before["inflight_tokens"]  # a report: re-read


def test_role_view_liveness_at_the_deadline_and_when_the_clock_goes_back() -> None:
    fleet = TelemetryView(fresh_load_s=1.0)
    fleet.on_hello(hello("d0"), 10.0)
    view = RoleView(fleet, "decode")
    view.rebuild()
    assert view.refresh(10.9995, 1.0).alive.tolist() == [True]
    assert view.refresh(11.0005, 1.0).alive.tolist() == [False] and not view.any_alive
    assert view.refresh(10.5, 1.0).alive.tolist() == [True] and view.any_alive  # a caller's clock went back
    assert view.refresh(10.5, 0.1).alive.tolist() == [False]  # another staleness limit


def test_forgetting_silent_engines_compacts_rows_and_keeps_the_rest() -> None:
    fleet = TelemetryView(capacity=2)
    for i in range(4):
        fleet.on_hello(hello(f"d{i}"), 0.0)
        fleet.on_telemetry(telemetry(f"d{i}", 0, running=10 + i), 0.0 if i % 2 else 5.0)
    assert fleet.forget(now=6.0, silent_for_s=3.0) == ["d1", "d3"]
    assert fleet.engine_ids == ["d0", "d2"] and fleet.index == {"d0": 0, "d2": 1}
    np.testing.assert_array_equal(fleet.load(), [10, 12])
    assert fleet.alive("decode", now=6.0).tolist() == [True, True]
    assert fleet.num_running[2] == 0 and fleet.last_seen[2] == -np.inf  # freed rows are blank again
    fleet.on_hello(hello("d1"), 6.5)  # a forgotten engine comes back with a new row
    assert fleet.index["d1"] == 2 and fleet.role[2] >= 0


def test_a_forged_sequence_jump_does_not_silence_the_engine() -> None:
    """Finding 1: one telemetry message with seq + 300 made the router drop the engine's real ones for 30 s."""
    fleet = TelemetryView()
    fleet.on_hello(hello("d0"), now=0.0)
    fleet.on_telemetry(telemetry("d0", 1000, running=1), now=0.0)
    fleet.on_telemetry(telemetry("d0", 1300, running=50), now=0.01)  # forged
    fleet.on_telemetry(telemetry("d0", 1001, running=2), now=0.1)  # the engine's own next report
    assert fleet.num_running[fleet.index["d0"]] == 2
    fleet.on_telemetry(telemetry("d0", 1002, running=3), now=0.2)
    assert fleet.num_running[fleet.index["d0"]] == 3


def test_sequence_numbers_beyond_int64_are_refused_at_the_door() -> None:
    """Finding 8: seq >= 2**63 raised OverflowError inside the router's handler; now the schema refuses it."""
    import pytest

    from switchyard.shared.codec import decode, encode
    from switchyard.shared.errors import WireError

    fleet = TelemetryView()
    fleet.on_telemetry(telemetry("d0", 2**63 - 1), now=0.0)  # the largest one fits the int64 column
    assert fleet.last_seq[fleet.index["d0"]] == 2**63 - 1
    data = encode(telemetry("d0", 5)).replace(b"\x05", b"\xcf\x80\x00\x00\x00\x00\x00\x00\x00", 1)
    with pytest.raises(WireError, match="seq"):
        decode(data, Telemetry)
