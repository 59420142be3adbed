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
from tests.helpers import telemetry


def _with(message: object, **fields: object) -> bytes:
    """The message's wire encoding with some top-level fields replaced (as a hostile publisher would)."""
    raw = msgpack.unpackb(encode(message), raw=False, strict_map_key=False)  # type: ignore[arg-type]
    raw.update(fields)
    return msgpack.packb(raw, use_bin_type=True)


def _telemetry(seq: int) -> Telemetry:
    return telemetry("e0", seq, ts=1.0, kv_usage=0.0, step_time_ema=0.0)


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


@pytest.mark.parametrize(
    "kind",
    [
        "x" * 17,  # the history database's engines.agent column holds 16 characters
        "vllm\x00",  # NUL into a VARCHAR: a psycopg DataError
        "vllm\n[forged log line]",
        "vLLM",  # kinds are compared as written: one spelling each
        "*",
        "",
    ],
)
def test_hello_agent_kind_is_a_bounded_lowercase_name(kind: str) -> None:
    with pytest.raises(WireError, match="agent"):
        decode(_with(hello("e0", "g0", ["a"]), agent=kind), Hello)


def test_a_new_agent_kind_needs_no_wire_change() -> None:
    assert decode(_with(hello("e0", "g0", ["a"]), agent="sglang"), Hello).agent == "sglang"


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


def test_with_a_manifest_an_engine_cannot_claim_another_group_or_rank(tmp_path) -> None:
    """The known hard spot of issue 15: bus permissions prove an engine's id, not its group. A hello from e1
    naming group g0 at rank 0 made it g0's migrate coordinator; with a manifest it is refused and counted."""
    from switchyard.services.fleet_view import UNBOUND_HELLOS, FleetView
    from switchyard.shared.settings import SwitchyardSettings

    manifest = tmp_path / "engines.json"
    manifest.write_text('{"e0": {"ep_group": "g0", "dp_rank": 0}, "e1": {"ep_group": "g1", "dp_rank": 0}}')
    view = FleetView(clock=lambda: 0.0, manifest=SwitchyardSettings(engine_manifest=manifest).engine_manifest_entries())
    before = {r: UNBOUND_HELLOS.labels(r)._value.get() for r in ("unlisted", "wrong_group_or_rank")}
    view.on_hello(hello("e1", "g0", ["x"], dp_rank=0))  # e1 is g1's
    view.on_hello(hello("e0", "g0", ["a"], dp_rank=3))  # e0 is rank 0
    view.on_hello(hello("intruder", "g0", ["y"]))
    assert view.coordinator("g0") is None and view.engines == {}
    view.on_hello(hello("e0", "g0", ["a"], dp_rank=0))
    view.on_hello(hello("e1", "g1", ["b"], dp_rank=0))
    assert (view.coordinator("g0"), view.coordinator("g1")) == ("e0", "e1")
    assert UNBOUND_HELLOS.labels("wrong_group_or_rank")._value.get() == before["wrong_group_or_rank"] + 2
    assert UNBOUND_HELLOS.labels("unlisted")._value.get() == before["unlisted"] + 1
    unbound = FleetView(clock=lambda: 0.0)  # no manifest: every hello believed, as before
    unbound.on_hello(hello("e1", "g0", ["x"], dp_rank=0))
    assert unbound.coordinator("g0") == "e1"


def test_without_a_manifest_a_live_engines_place_is_its_own() -> None:
    """No manifest: an engine's (group, rank) is its own word, but it cannot take a place a live engine holds,
    move a live engine elsewhere, or take a settled coordinator's migrate steps by joining with a lower rank."""
    from switchyard.services.fleet_view import UNBOUND_HELLOS, FleetView

    now = [1000.0]
    view = FleetView(clock=lambda: now[0])
    count = lambda reason: UNBOUND_HELLOS.labels(reason)._value.get()  # noqa: E731
    taken, rebind = count("slot_taken"), count("rebind_while_live")
    view.on_hello(hello("e1", "g0", ["a"], dp_rank=0))
    view.on_hello(hello("e2", "g0", ["b"], dp_rank=1))
    view.on_hello(hello("x", "g9", ["z"], dp_rank=0))
    view.on_hello(hello("d0", "g0", ["evil"], dp_rank=0))  # e1's place, e1 live: refused
    view.on_hello(hello("x", "g0", ["evil"], dp_rank=0))  # x is live in g9: it cannot move
    assert (view.coordinator("g0"), view.coordinator("g9")) == ("e1", "x")
    assert [s.engine_id for s in view.group("g0")] == ["e1", "e2"]
    assert (count("slot_taken"), count("rebind_while_live")) == (taken + 1, rebind + 1)

    now[0] += 10.0  # everyone silent past 3 hello intervals (0.2 s): all stale
    view.on_hello(hello("e2", "g0", ["b"], dp_rank=1))  # e2 back: g0's coordinator, and it settles
    assert view.coordinator("g0") == "e2"
    now[0] += 0.3  # one hello interval later, a lower rank joins (e1's place is free: e1 is stale)
    view.on_hello(hello("e2", "g0", ["b"], dp_rank=1))
    view.on_hello(hello("d0", "g0", ["evil"], dp_rank=0))
    assert [s.engine_id for s in view.group("g0")] == ["d0", "e2"]  # a member, not the coordinator
    assert view.coordinator("g0") == "e2"
    view.on_hello(hello("e1", "g0", ["a"], dp_rank=0))  # the real rank 0 back: d0 holds it while live
    assert count("slot_taken") == taken + 2
    now[0] += 0.7  # e2 goes stale, d0 keeps saying hello: the lowest live rank coordinates again
    view.on_hello(hello("d0", "g0", ["evil"], dp_rank=0))
    assert view.coordinator("g0") == "d0"

    # after a restart every engine answers the announce within milliseconds: the lowest rank coordinates
    fresh = FleetView(clock=lambda: now[0])
    for engine_id, rank in (("r2", 2), ("r1", 1), ("r0", 0)):
        fresh.on_hello(hello(engine_id, "g1", ["a"], dp_rank=rank))
    assert fresh.coordinator("g1") == "r0"
