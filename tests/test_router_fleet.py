"""The router's columnar fleet view: liveness, sequence checks, in-flight compensation."""

from __future__ import annotations

import numpy as np

from services.router.fleet import Fleet
from shared.schemas import Capacity, Hello, ModelShape, Telemetry

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
    return Telemetry(
        engine_id=engine_id,
        seq=seq,
        ts=0.0,
        kv_usage=kv,
        num_running=running,
        num_waiting=0,
        waiting_prefill_tokens=0,
        remaining_prefill_tokens=0,
        step_time_ema=0.01,
    )


def test_engines_drop_out_when_silent_and_return_when_heard() -> None:
    fleet = Fleet(stale_after_s=1.0)
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
    fleet = Fleet()
    fleet.on_telemetry(telemetry("d9", 0), now=0.0)
    assert not fleet.alive("decode", now=0.0).any()
    fleet.on_hello(hello("d9"), now=0.1)
    assert fleet.alive("decode", now=0.1).tolist() == [True]


def test_sequence_gaps_reorders_and_restarts() -> None:
    fleet = Fleet()
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
    fleet = Fleet(inflight_grace_s=0.05)
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
    fleet = Fleet(capacity=2)
    for i in range(9):
        fleet.on_hello(hello(f"d{i}"), 0.0)
        fleet.on_telemetry(telemetry(f"d{i}", 0, running=i), 0.0)
    assert len(fleet) == 9
    np.testing.assert_array_equal(fleet.load(), np.arange(9))
    assert fleet.alive("decode", 0.0).all()
