"""The registry of engine signals (`shared.signals`): an unknown name fails where a part is defined (at import)
or a profile is built; the telemetry schema, the router's telemetry view and gather, the DP simulator and the
profiles all read the registry's names; and routing costs are checked finite before a picker sees them."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from switchyard.services.router import core as router_core
from switchyard.services.router.telemetry_view import _COLUMNS, TelemetryView
from switchyard.shared.schemas import Telemetry
from switchyard.shared.signals import REQUEST_INPUTS, SIGNALS, UnknownSignal, need, telemetry_view_columns
from switchyard.simulator.offline.dp import SIM_COLUMNS, Dispatcher
from switchyard.solver.routing import (
    DECODE_PROFILES,
    DP_PROFILES,
    FleetSnapshot,
    RouteQuery,
    RouterState,
    dp_profile,
    framework,
)
from switchyard.solver.routing.dispatch import GimbalParams
from switchyard.solver.routing.filters import Alive
from switchyard.solver.routing.framework import NonFiniteCost, Profile, Weighted
from switchyard.solver.routing.pickers import FirstMin, LeastCost, PowerOfTwo
from switchyard.solver.routing.scorers import Column
from switchyard.solver.routing.tables import RoutingTables

Q = RouteQuery()
T = RoutingTables()

_BAD_PART = """
from dataclasses import dataclass

from switchyard.shared.signals import need


@dataclass(frozen=True)
class Misspelt:
    name: str = "misspelt"
    needs: frozenset[str] = need("load", "kv_usgae")
"""


# ----- unknown names fail at import -----


def test_a_part_naming_an_unknown_signal_fails_at_import(tmp_path: Path) -> None:
    path = tmp_path / "bad_part.py"
    path.write_text(_BAD_PART)
    spec = importlib.util.spec_from_file_location("bad_part", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(UnknownSignal, match=r"unknown signal 'kv_usgae' \(did you mean 'kv_usage'\?\).*shared/signals"):
        spec.loader.exec_module(module)
    assert "bad_part" not in sys.modules
    with pytest.raises(UnknownSignal, match="unknown signal 'lod'"):
        Column("lod")
    assert need("load", "similarity") == {"load", "similarity"} and need() == frozenset()


def test_a_profile_refuses_a_part_whose_needs_bypass_the_registry() -> None:
    @dataclass(frozen=True)
    class Raw:
        name: str = "raw"
        needs: frozenset[str] = frozenset({"load", "queue_depth"})

        def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
            return snap.load

    with pytest.raises(UnknownSignal, match=r"profile 'p': part 'raw' needs 'queue_depth'"):
        Profile("p", (Alive(),), (Weighted(Raw(), 1.0),), LeastCost())


# ----- every user reads the registry -----


def test_every_telemetry_field_is_a_registered_signal_s_producer() -> None:
    envelope = {"engine_id", "seq", "ts"}
    producers = " ".join(s.producer for s in SIGNALS.values())
    assert {f for f in Telemetry.model_fields if f not in envelope and f not in producers} == set()
    for s in SIGNALS.values():
        assert s.field is None or s.field in Telemetry.model_fields
        assert s.unit and s.staleness and s.producer


def test_the_router_stores_and_gathers_every_signal() -> None:
    view = TelemetryView(capacity=2)
    for name, (dtype, fill) in telemetry_view_columns().items():
        assert _COLUMNS[name] == (dtype, fill) and getattr(view, name).dtype == dtype
    assert set(router_core.COLUMNS) | {"load", "kv_usage", "alive"} == set(SIGNALS)
    assert set(router_core.PER_DECISION) <= set(SIGNALS)
    telemetry = Telemetry(
        engine_id="e", seq=1, ts=0.0, kv_usage=0.5, num_running=1, num_waiting=2, waiting_prefill_tokens=3,
        remaining_prefill_tokens=4, step_time_ema=0.02, expert_pressure=1.5, migrating=True,
    )  # fmt: skip
    view.on_telemetry(telemetry, 0.0)
    rows, snap = np.array([0]), FleetSnapshot.build(["e"])
    gathered = {name: float(gather(view, rows, snap)[0]) for name, gather in router_core.COLUMNS.items()}
    assert gathered == {
        "running": 1.0, "waiting": 2.0, "remaining_prefill": 4.0, "waiting_prefill": 3.0, "step_time": 0.02,
        "expert_pressure": 1.5, "migrating": 1.0, "inflight": 0.0, "inflight_tokens": 0.0, "outstanding": 0.0,
        "indexed_blocks": 0.0, "kv_blocks": 0.0, "pending_prefill": 0.0, "pending": 0.0, "decoding": 0.0,
        "recent_sends": 0.0,
    }  # fmt: skip


def test_the_dp_simulator_and_the_profiles_name_registered_signals() -> None:
    assert set(SIM_COLUMNS) <= set(SIGNALS)
    dispatcher = Dispatcher("gimbal", 2, GimbalParams(), 0.05)
    assert set(dispatcher.snap.columns) | {"load", "kv_usage", "alive"} == SIM_COLUMNS
    profiles = [*DECODE_PROFILES.values(), *(dp_profile(name) for name in DP_PROFILES)]
    known = set(SIGNALS) | set(REQUEST_INPUTS)
    assert all(profile.needs <= known for profile in profiles)
    assert set(REQUEST_INPUTS) == framework.REQUEST_INPUTS


# ----- costs are checked finite before a picker sees them -----


def _profile(picker: object = None) -> Profile:
    return Profile("p", (Alive(),), (Weighted(Column("load"), 1.0), Weighted(Column("step_time"), 1.0)),
                   picker or LeastCost())  # fmt: skip


def _snap(load: list[float], step_time: list[float], alive: list[bool] | None = None) -> FleetSnapshot:
    ids = [f"e{i}" for i in range(len(load))]
    snap = FleetSnapshot.build(ids, load=dict(zip(ids, load, strict=True)))
    if alive is not None:
        snap.alive[:] = alive
    snap.columns["step_time"] = np.array(step_time, dtype=np.float64)
    return snap


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_a_nan_or_minus_infinite_cost_is_an_error_naming_the_profile_scorer_and_engine(bad: float) -> None:
    snap = _snap([1.0, 0.0, 2.0], [0.0, bad, 0.0])
    with pytest.raises(
        NonFiniteCost, match=r"profile 'p': cost NaN or -inf on engine\(s\) e1 from scorer\(s\) step_time"
    ):
        _profile()(snap, Q, RouterState(), T)
    # on an engine no filter admits, it is never seen
    assert _profile()(_snap([1.0, 0.0, 2.0], [0.0, bad, 0.0], [True, False, True]), Q, RouterState(), T).index == 0


@pytest.mark.parametrize("picker", [LeastCost(), FirstMin(), PowerOfTwo()])
def test_a_plus_infinite_cost_excludes_the_engine(picker: object) -> None:
    snap = _snap([0.0, 5.0, 9.0], [np.inf, 0.0, np.inf])
    state = RouterState.seeded(3)
    assert {_profile(picker)(snap, Q, state, T).index for _ in range(20)} == {1}
    with pytest.raises(LookupError, match="no live engine"):
        _profile(picker)(_snap([0.0, 5.0], [np.inf, np.inf]), Q, RouterState(), T)
