"""Schema-valid-looking values that used to get past the door and crash or wedge a handler (issue 15).

Each is now refused by the schema itself, at decode, with a named field: so every consumer (router, placement,
migration, history) is protected at once, and the rejection is counted by the bus like any other.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from switchyard.shared.codec import decode, encode
from switchyard.shared.errors import WireError
from switchyard.shared.schemas import Hello, PlacementPlan, Telemetry
from tests.fleet_helpers import hello, plan


def _with(message: object, **fields: object) -> bytes:
    """The message's wire encoding with some top-level fields replaced (as a hostile publisher would)."""
    raw = msgpack.unpackb(encode(message), raw=False, strict_map_key=False)  # type: ignore[arg-type]
    raw.update(fields)
    return msgpack.packb(raw, use_bin_type=True)


def _telemetry(seq: int) -> Telemetry:
    return Telemetry(
        engine_id="e0",
        seq=seq,
        ts=1.0,
        kv_usage=0.0,
        num_running=0,
        num_waiting=0,
        waiting_prefill_tokens=0,
        remaining_prefill_tokens=0,
        step_time_ema=0.0,
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hello_interval_s", 1e6),  # made a forged hello the group's migrate coordinator for an hour
        ("telemetry_interval_s", 1e6),
        ("ts", 1e308),
    ],
)
def test_hello_bounds(field: str, value: object) -> None:
    data = _with(hello("e0", "g0", ["a"]), **{field: value})
    with pytest.raises(WireError, match=field):
        decode(data, Hello)


def test_hello_interval_up_to_a_minute_is_fine() -> None:
    assert decode(_with(hello("e0", "g0", ["a"]), hello_interval_s=60.0), Hello).hello_interval_s == 60.0


@pytest.mark.parametrize("seq", [2**63, 2**64 - 1])
def test_telemetry_seq_beyond_int64(seq: int) -> None:
    with pytest.raises(WireError, match="seq"):
        decode(_with(_telemetry(0), seq=seq), Telemetry)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("plan_id", "g0\x00v1"),  # psycopg DataError: redelivered forever
        ("plan_id", "g0\nv1"),
        ("created_at", 1e308),  # OverflowError converting to a datetime
        ("created_at", 4e11),  # past year 9999
        ("version", 2**31),  # an INTEGER column
        ("base_version", 2**40),
    ],
)
def test_plan_fields_bounded_to_what_storage_accepts(field: str, value: object) -> None:
    good = plan("g0", 1, np.zeros((2, 2, 2), np.int32))
    with pytest.raises(WireError, match=field):
        decode(_with(good, **{field: value}), PlacementPlan)
    assert decode(encode(good), PlacementPlan).plan_id == "g0-v1"


@pytest.mark.parametrize("shape", [(4, 0), (0, 8), (2048, 4000)])
def test_expert_load_shapes_without_experts_or_far_beyond_a_model_are_refused(shape: tuple[int, int]) -> None:
    """`[L, 0]` divided by zero in placement every tick; `[2048, 4000]` windows were the memory bomb."""
    from switchyard.shared.schemas import ExpertLoad

    good = ExpertLoad(
        engine_id="e0", ep_group="g0", seq=0, window_start=0.0, window_end=1.0, expert_counts=np.ones((4, 8), np.uint32)
    )
    bad = good.model_copy(update={"expert_counts": np.zeros(shape, np.uint8)})
    with pytest.raises(WireError, match="expert_counts"):
        decode(encode(bad), ExpertLoad)
    assert decode(encode(good), ExpertLoad).expert_counts.shape == (4, 8)
