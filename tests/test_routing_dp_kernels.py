"""The DP profiles' fused kernels (`solver.routing.dp_kernels`) decide exactly as their compositions do: the same
engine, ties included, or they decline (None) and the composition decides."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.solver.routing import FleetSnapshot, RouteQuery, RouterState, RoutingTables, dp_profile
from switchyard.solver.routing.dispatch import GimbalParams
from switchyard.solver.routing.dp_kernels import ColumnsKernel, GimbalKernel
from switchyard.solver.routing.eldr_kernel import LOOP_MAX_ENGINES
from switchyard.solver.routing.framework import NonFiniteCost
from switchyard.solver.routing.profiles import PREFIX_WEIGHT

# The compositions meet the odd values and PARAMS[2]'s overflow with numpy's warnings; the kernels decline them.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
Q = RouteQuery()
T = RoutingTables()
PARAMS = (
    GimbalParams(),
    GimbalParams(kv_high=0.5, kv_spread=0.0),  # KV first whenever a cache is over half full and caches differ
    GimbalParams(kv_floor=1e-300, kv_cost_tokens=1e10, moe_cost_tokens=0.0),  # a full cache costs +inf
)
#: KV usages around the KV-first threshold (0.9) and spread (0.1), and out of [0, 1] (the penalty clips).
KV = st.sampled_from([0.0, 0.0, 0.3, 0.6, 0.8, 0.92, 0.97, 1.0, 1.2, -0.1])
HOT_KV = st.sampled_from([0.91, 0.92, 0.97, 1.0])
TOKENS = st.integers(0, 4).map(lambda k: 700.0 * k)  # few values: ties are frequent
PRESSURE = st.sampled_from([0.5, 1.0, 1.0, 1.5, 3.0])
ODD = st.sampled_from([np.nan, np.inf, -np.inf, 0.5])


def _fleet(data: st.DataObject, n: int, odd: bool) -> FleetSnapshot:
    """n engines, some dead, some not serving the request's model (the router's narrowed `alive`)."""
    bools = st.lists(st.booleans(), min_size=n, max_size=n)
    alive = np.array(data.draw(bools, "alive"), dtype=bool)
    kv = np.array(data.draw(st.lists(HOT_KV if data.draw(st.booleans(), "all hot") else KV, min_size=n, max_size=n)))
    columns = {
        name: np.array(data.draw(st.lists(TOKENS, min_size=n, max_size=n), name))
        for name in ("remaining_prefill", "waiting_prefill", "inflight_tokens", "waiting", "running")
    }
    columns["expert_pressure"] = np.array(data.draw(st.lists(PRESSURE, min_size=n, max_size=n), "pressure"))
    if odd:  # a NaN or infinity in one cell of one column
        name = data.draw(st.sampled_from(["kv_usage", *columns]), "odd column")
        target = kv if name == "kv_usage" else columns[name]
        target[data.draw(st.integers(0, n - 1), "odd row")] = data.draw(ODD, "odd value")
    load = np.array(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), "load"), dtype=np.float64)
    snap = FleetSnapshot(tuple(f"e{i}" for i in range(n)), load, kv, alive, columns=columns)
    snap.columns["outstanding"] = snap.load
    serving = data.draw(st.none() | bools, "serving")
    return snap if serving is None else replace(snap, alive=alive & np.array(serving, dtype=bool))


def _composed(profile_name: str, params: GimbalParams, snap: FleetSnapshot, start: int) -> int | None:
    try:
        return dp_profile(profile_name, params).compose(snap, Q, RouterState(scan_start=start), T).index
    except (LookupError, NonFiniteCost):  # no live engine (or none of finite cost); a NaN or -inf cost
        return None


@settings(max_examples=600, deadline=None)
@given(n=st.integers(1, 8), odd=st.booleans(), data=st.data())
def test_the_gimbal_kernel_picks_what_the_composition_picks(n: int, odd: bool, data: st.DataObject) -> None:
    params = data.draw(st.sampled_from(PARAMS), "params")
    snap = _fleet(data, n, odd)
    profile = dp_profile("gimbal", params)
    assert profile.kernel == GimbalKernel(params)
    decision = profile.kernel(snap, Q, RouterState(), T)
    expected = _composed("gimbal", params, snap, 0)
    if decision is not None:
        assert decision == profile.compose(snap, Q, RouterState(), T)
    elif not odd and params is not PARAMS[2]:  # finite scores: the kernel declines only without a live engine
        assert expected is None


#: Cached prompt tokens per engine as the prefix index gives them (float64), in the odd dtypes a caller could.
CACHED = st.sampled_from([0.0, 0.0, 512.0, 1400.0, 2800.0, 4000.0])


@settings(max_examples=600, deadline=None)
@given(n=st.integers(1, 8), odd=st.booleans(), data=st.data())
def test_the_switchyard_kernel_picks_what_the_composition_picks(n: int, odd: bool, data: st.DataObject) -> None:
    """Gimbal's kernel plus the uncached prompt (`switchyard`, the router's default), with and without a prefix
    match: the same engine as the composition, ties included, or it declines."""
    params = data.draw(st.sampled_from(PARAMS), "params")
    snap = _fleet(data, n, odd)
    prompt = data.draw(st.sampled_from([0, 1, 1400, 2800, 5000]), "prompt")
    cached = data.draw(st.none() | st.lists(CACHED, min_size=n, max_size=n), "cached")
    dtype = data.draw(st.sampled_from([np.float64, np.int64, np.float32]), "dtype")
    query = RouteQuery(prompt_tokens=prompt, cached=None if cached is None else np.array(cached, dtype=dtype))
    profile = dp_profile("switchyard", params)
    assert profile.kernel == GimbalKernel(params, PREFIX_WEIGHT)
    decision = profile.kernel(snap, query, RouterState(), T)
    try:
        expected: int | None = profile.compose(snap, query, RouterState(), T).index
    except (LookupError, NonFiniteCost):
        expected = None
    if decision is not None:
        assert decision.index == expected
    elif not odd and params is not PARAMS[2] and (cached is None or dtype is not np.float32):
        assert expected is None  # it declines only without a live engine (or a float32 column)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 8), odd=st.booleans(), name=st.sampled_from(["jsq", "vllm"]), data=st.data())
def test_the_column_kernels_pick_what_the_compositions_pick(n: int, odd: bool, name: str, data: st.DataObject) -> None:
    snap = _fleet(data, n, odd)
    start = data.draw(st.integers(0, 2 * n), "scan start")
    profile = dp_profile(name)
    decision = profile.kernel(snap, Q, RouterState(scan_start=start), T)
    expected = _composed(name, GimbalParams(), snap, start)
    if decision is not None:
        assert decision == profile.compose(snap, Q, RouterState(scan_start=start), T)
    elif not odd:
        assert expected is None


def test_the_gimbal_kernel_sends_to_the_freest_cache_when_kv_binds_and_else_to_the_least_pressure() -> None:
    columns = {name: np.zeros(3) for name in ("remaining_prefill", "waiting_prefill", "inflight_tokens")}
    columns["expert_pressure"] = np.ones(3)
    columns["remaining_prefill"][:] = [0.0, 4000.0, 4000.0]
    kernel = GimbalKernel(GimbalParams())
    snap = FleetSnapshot(("a", "b", "c"), np.zeros(3), np.array([0.95, 0.5, 0.5]), np.ones(3, bool), columns=columns)
    assert kernel(snap, Q, RouterState(), T).index == 1  # KV first: the first of the two freest caches
    snap.kv_usage[0] = 0.6  # 0.6 - 0.5 is within the spread: pressure decides, P_kv(0.6) = 3072 < 4000
    assert kernel(snap, Q, RouterState(), T).index == 0
    snap.kv_usage[:] = [0.0, -0.1, 0.0]  # clipped to 0: a tie, to the first (unclipped, P_kv(-0.1) < 0)
    snap.columns["remaining_prefill"][:] = 0.0
    assert kernel(snap, Q, RouterState(), T).index == 0 == dp_profile("gimbal").compose(snap, Q, RouterState(), T).index


def test_kernels_decline_what_they_do_not_fuse() -> None:
    d = LOOP_MAX_ENGINES + 1
    names = ("remaining_prefill", "waiting_prefill", "inflight_tokens", "expert_pressure", "waiting", "running")
    big = FleetSnapshot(tuple(f"e{i:03d}" for i in range(d)), np.zeros(d), np.zeros(d), np.ones(d, bool))
    big.columns.update({name: np.ones(d) for name in names})
    gimbal, vllm = GimbalKernel(GimbalParams()), ColumnsKernel((("waiting", 4.0), ("running", 1.0)))
    assert gimbal(big, Q, RouterState(), T) is None and vllm(big, Q, RouterState(), T) is None
    small = FleetSnapshot(("a", "b"), np.zeros(2), np.zeros(2), np.ones(2, bool))
    small.columns.update({name: np.ones(2) for name in names})
    assert (
        gimbal(small, Q, RouterState(), T)
        == vllm(small, Q, RouterState(), T)
        == dp_profile("gimbal")(small, Q, RouterState(), T)
    )
    assert gimbal(small, Q, RouterState(scan_start=1), T) is None  # Gimbal's argmin scans from engine 0
    small.columns["running"] = np.ones(2, dtype=np.float32)  # numpy would add in another precision
    assert vllm(small, Q, RouterState(), T) is None
    assert GimbalKernel(GimbalParams(kv_floor=0.0))(small, Q, RouterState(), T) is None  # numpy: x / 0 = inf
    assert dp_profile("gimbal").weighted({"kv_penalty": 2.0}).kernel is None


def test_without_a_live_engine_the_kernel_declines_and_the_profile_fails() -> None:
    snap = FleetSnapshot(("a",), np.zeros(1), np.zeros(1), np.zeros(1, bool))
    snap.columns.update({name: np.zeros(1) for name in ("remaining_prefill", "waiting_prefill", "inflight_tokens")})
    snap.columns["expert_pressure"] = np.ones(1)
    assert GimbalKernel(GimbalParams())(snap, Q, RouterState(), T) is None
    with pytest.raises(LookupError):
        dp_profile("gimbal")(snap, Q, RouterState(), T)
