"""The routing framework: each filter, scorer and picker; profile composition and weights; DP profiles equal
the dispatch formulas; settings choose and weight profiles; the router refuses the experiment variants; the
in-flight ledger; and the "How to add a decode scorer" example of docs/architecture.md."""

from __future__ import annotations

import importlib.util
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.services.router.core import DpChoice, RouterCore
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.codec import decode
from switchyard.shared.schemas import (
    Capacity,
    Hello,
    ModelShape,
    RouteDecodeRequest,
    RouteDpReply,
    RouteDpRequest,
    Telemetry,
)
from switchyard.solver.routing import (
    DECODE_POLICIES,
    DECODE_PROFILES,
    FleetSnapshot,
    InflightLedger,
    RouteQuery,
    RouterState,
    RoutingTables,
    decode_profile,
    dp_profile,
)
from switchyard.solver.routing.dispatch import (
    GimbalParams,
    kv_penalty,
    moe_penalty,
    pick_dp_engine,
    pick_jsq,
    pick_round_robin,
    pick_vllm,
    pick_vllm_main,
)
from switchyard.solver.routing.filters import Alive, DomainPartition, KvFirst, TauBand
from switchyard.solver.routing.pickers import FirstMin, LeastCost, PowerOfTwo, RandomPick, RoundRobin
from switchyard.solver.routing.scorers import Column, KvPenalty, MoePenalty, VllmMainKv, VllmMainLoad

ROOT = Path(__file__).resolve().parents[1]
Q = RouteQuery()
T = RoutingTables()


def _snap(load: list[float], alive: list[bool] | None = None, kv: list[float] | None = None, **columns: list[float]):
    ids = [f"e{i:02d}" for i in range(len(load))]
    snap = FleetSnapshot.build(
        ids,
        load=dict(zip(ids, load, strict=True)),
        kv_usage=dict(zip(ids, kv or [0.0] * len(ids), strict=True)),
        alive=dict(zip(ids, alive or [True] * len(ids), strict=True)),
    )
    snap.columns.update({name: np.asarray(values, dtype=np.float64) for name, values in columns.items()})
    return snap


# ----- filters -----


def test_alive_admits_the_live_engines_and_is_never_relaxed() -> None:
    snap = _snap([0, 0, 0], [True, False, True])
    assert Alive().admit(snap, Q, T).mask.tolist() == [True, False, True]
    with pytest.raises(LookupError):
        decode_profile("jsq")(_snap([0, 0], [False, False]), Q, RouterState(), T)


def test_tau_band_admits_the_engines_of_centroids_within_tau_and_prefers_the_most_similar() -> None:
    snap = _snap([0, 0, 0, 0])
    tables = RoutingTables.build(snap.engine_ids, num_centroids=4, tau=0.1)
    mask, why, prefer = TauBand().admit(snap, RouteQuery(sims=np.array([0.5, 0.95, 0.9, 0.2])), tables)
    assert mask.tolist() == [False, True, True, False] and why is None and prefer.tolist() == [0.5, 0.95, 0.9, 0.2]
    assert TauBand().admit(snap, RouteQuery(), tables) == (None, "no_signature", None)
    assert TauBand().admit(snap, RouteQuery(sims=np.ones(4)), T).fallback == "no_signature"  # no artifact


def test_domain_partition_admits_the_label_s_engines() -> None:
    snap = _snap([0, 0, 0, 0])
    tables = RoutingTables.build(snap.engine_ids, label_shares={"a": 1.0, "b": 1.0})
    assert DomainPartition().admit(snap, RouteQuery(label="b"), tables).mask.tolist() == [False, False, True, True]
    assert DomainPartition().admit(snap, RouteQuery(label="zzz"), tables) == (None, "no_label", None)


def test_kv_first_admits_only_the_most_free_kv_engine_when_it_applies() -> None:
    hot = _snap([0, 0, 0], kv=[0.95, 0.5, 0.5])
    assert KvFirst().admit(hot, Q, T).mask.tolist() == [False, True, False]  # first of equals
    assert KvFirst().admit(_snap([0, 0], kv=[0.85, 0.1]), Q, T).mask is None  # below kv_high: does not apply
    assert KvFirst(GimbalParams(kv_high=0.8)).admit(_snap([0, 0], kv=[0.85, 0.1]), Q, T).mask.tolist() == [
        False,
        True,
    ]


# ----- scorers -----


def test_scorers_compute_their_formulas_over_the_columns_they_declare() -> None:
    p = GimbalParams()
    snap = _snap(
        [1, 2], kv=[0.2, 0.7], remaining_prefill=[10, 20], expert_pressure=[1.5, 0.9], waiting=[3, 1], running=[2, 5]
    )
    snap.columns["outstanding"] = snap.load
    assert Column("load").cost(snap, Q, T) is snap.load  # no copy
    assert Column("remaining_prefill").needs == {"remaining_prefill"}
    assert KvPenalty(p).cost(snap, Q, T).tolist() == kv_penalty(snap.kv_usage, p).tolist()
    assert MoePenalty(p).cost(snap, Q, T).tolist() == [512.0, 0.0]
    assert VllmMainLoad(client_count=3).cost(snap, Q, T).tolist() == [5.0, 6.0]  # max(3·[1, 2], [5, 6])
    assert VllmMainKv().cost(snap, Q, T).tolist() == pytest.approx([0.0, 6 * 1 * 0.2])
    assert moe_penalty(np.array([2.0]), p)[0] == p.moe_cost_tokens


# ----- pickers -----


def test_least_cost_breaks_ties_by_preference_else_at_random() -> None:
    cost, mask = np.array([1.0, 0.0, 0.0, 0.0]), np.array([True, True, True, False])
    assert LeastCost().pick(cost, mask, np.array([0, 0.2, 0.9, 1.0]), RouterState()) == 2  # 3 is not admitted
    picks = {LeastCost().pick(cost, mask, None, RouterState.seeded(s)) for s in range(40)}
    assert picks == {1, 2}


def test_first_min_scans_from_the_start_and_may_rotate() -> None:
    cost, mask = np.array([1.0, 0.0, 0.0]), np.ones(3, dtype=bool)
    state = RouterState()
    assert FirstMin().pick(cost, mask, None, state) == 1 and state.scan_start == 0
    state.scan_start = 2
    assert FirstMin().pick(cost, mask, None, state) == 2
    rotating = FirstMin(rotate=True)
    assert [rotating.pick(np.zeros(3), mask, None, state) for _ in range(4)] == [2, 0, 1, 2]


def test_power_of_two_keeps_the_cheaper_of_two_distinct_candidates() -> None:
    cost, mask = np.array([0.0, 5.0, 9.0]), np.array([False, True, True])
    state = RouterState.seeded(1)
    assert {PowerOfTwo().pick(cost, mask, None, state) for _ in range(50)} == {1}  # 2 only when drawn twice
    assert PowerOfTwo().pick(cost, np.array([False, False, True]), None, state) == 2


def test_round_robin_and_random_visit_only_admitted_engines() -> None:
    mask, state = np.array([True, False, True, True]), RouterState()
    assert [RoundRobin().pick(None, mask, None, state) for _ in range(5)] == [0, 2, 3, 0, 2]
    assert {RandomPick().pick(None, mask, None, RouterState.seeded(s)) for s in range(60)} == {0, 2, 3}


# ----- profiles -----


def test_a_profile_needs_what_its_parts_need() -> None:
    assert decode_profile("eldr").needs == {"alive", "similarity", "load"}
    assert decode_profile("rr").needs == {"alive"}
    assert dp_profile("vllm").columns == {"alive", "waiting", "running"}
    assert dp_profile("gimbal").columns == {
        "alive", "kv_usage", "remaining_prefill", "waiting_prefill", "inflight_tokens", "expert_pressure"
    }  # fmt: skip


def test_weights_change_the_pick_and_a_zero_weight_drops_the_scorer_and_its_needs() -> None:
    gimbal = dp_profile("gimbal")
    snap = _snap(
        [0, 0], kv=[0.6, 0.0], remaining_prefill=[0, 4000], waiting_prefill=[0, 0], inflight_tokens=[0, 0],
        expert_pressure=[1, 1],
    )  # fmt: skip
    # P_kv(0.6) = 2048·1.5 = 3072 < 4000: engine 0; the KV penalty doubled (6144) makes it engine 1.
    assert gimbal(snap, Q, RouterState(), T).index == 0
    assert gimbal.weighted({"kv_penalty": 2.0})(snap, Q, RouterState(), T).index == 1
    lighter = gimbal.weighted({"moe_penalty": 0})
    assert "expert_pressure" not in lighter.needs and len(lighter.scorers) == 4
    with pytest.raises(ValueError, match="no scorer 'nope'"):
        gimbal.weighted({"nope": 1.0})
    assert decode_profile("eldr").kernel is not None and decode_profile("eldr", {"load": 2.0}).kernel is None
    assert decode_profile("eldr", {"load": 1.0}) is decode_profile("eldr")


def test_a_relaxed_band_says_so_and_picks_among_live_engines() -> None:
    snap = _snap([5, 1, 0], [True, True, False])
    tables = RoutingTables.build(snap.engine_ids, num_centroids=3, tau=0.0)
    d = decode_profile("eldr").compose(snap, RouteQuery(sims=np.array([0.0, 0.0, 1.0])), RouterState(), tables)
    assert (d.index, d.fallback, d.band_size) == (1, "band_empty", 0)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 6),
    data=st.data(),
)
def test_dp_profiles_pick_what_the_dispatch_formulas_pick(n: int, data: st.DataObject) -> None:
    ints = st.lists(st.integers(0, 6), min_size=n, max_size=n)
    alive = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    if not alive.any():
        alive[0] = True
    kv = np.array(data.draw(st.lists(st.sampled_from([0.0, 0.3, 0.6, 0.92, 0.97]), min_size=n, max_size=n)))
    rem, wait, comp, running, waiting, outstanding = (
        np.array(data.draw(ints), dtype=np.float64) * 700 for _ in range(6)
    )
    pressure = np.array(data.draw(st.lists(st.sampled_from([1.0, 1.5, 3.0]), min_size=n, max_size=n)))
    start = data.draw(st.integers(0, n - 1))
    ids = [f"e{i}" for i in range(n)]
    snap = FleetSnapshot(tuple(ids), outstanding.copy(), kv, alive)
    snap.columns.update(
        remaining_prefill=rem, waiting_prefill=wait, inflight_tokens=comp, expert_pressure=pressure,
        waiting=waiting, running=running, outstanding=outstanding,
    )  # fmt: skip
    p = GimbalParams()

    def run(name: str, **state: int) -> int:
        return dp_profile(name, p)(snap, Q, RouterState(**state), T).index

    assert run("gimbal") == pick_dp_engine(alive, kv, rem, wait, comp, pressure, p)
    assert run("vllm", scan_start=start) == pick_vllm(alive, waiting, running, start)
    assert run("vllm-main", scan_start=start) == pick_vllm_main(alive, waiting, running, kv, outstanding, start)
    assert run("jsq") == pick_jsq(alive, outstanding)
    assert run("rr", rr_next=start + 1) == pick_round_robin(alive, start)


# ----- the router: settings choose and weight; experiment variants refused -----


@pytest.mark.parametrize("name", ["eldr-vanilla", "eldr-tau0"])
def test_the_router_refuses_the_simulator_s_experiment_variants(name: str) -> None:
    with pytest.raises(ValueError, match=r"not a router profile.*simulator option"):
        RouterSettings(policy=name)
    with pytest.raises(ValueError, match="not a router profile"):
        decode_profile(name)
    assert DECODE_POLICIES[name].profile is DECODE_PROFILES["eldr"]  # the simulator maps them to options
    assert (DECODE_POLICIES["eldr-vanilla"].fit, DECODE_POLICIES["eldr-tau0"].tau) == ("vanilla", 0.0)


def test_unknown_names_and_weights_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="unknown decode profile"):
        RouterSettings(policy="nope")
    with pytest.raises(ValueError, match="no scorer"):
        RouterSettings(decode_weights={"kv": 1.0})
    with pytest.raises(ValueError, match="dp_rule"):
        RouterSettings(dp_rule="p2c")


def _hello(engine_id: str, role: str) -> Hello:
    shape = ModelShape(name="m", num_layers=2, num_experts=4, top_k=2)
    capacity = Capacity(max_running=64, kv_blocks=1024, block_size=16)
    return Hello(
        engine_id=engine_id, role=role, model=shape, ep_group=engine_id, gpus=["0"], capacity=capacity, ts=0.0,
        agent="sim",
    )  # fmt: skip


def _core(router: RouterSettings, role: str, rows: list[tuple[int, int, float, int]]) -> RouterCore:
    """Engines e0, e1, ... of `role` reporting (running, waiting, kv, remaining prefill tokens)."""
    core = RouterCore(router)
    for i, (running, waiting, kv, remaining) in enumerate(rows):
        core.on_hello(_hello(f"e{i}", role), 0.0)
        core.on_telemetry(
            Telemetry(
                engine_id=f"e{i}", seq=1, ts=0.0, kv_usage=kv, num_running=running, num_waiting=waiting,
                waiting_prefill_tokens=0, remaining_prefill_tokens=remaining, step_time_ema=0.01,
            ),
            0.0,
        )  # fmt: skip
    return core


@given(
    request_id=st.text(min_size=1, max_size=128),
    prompt_tokens=st.integers(0, 2**63 - 1),
    engine=st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True),
)
@settings(max_examples=50, deadline=None)
def test_a_dp_reply_packed_unchecked_is_a_valid_reply(request_id: str, prompt_tokens: int, engine: str) -> None:
    """The router packs its DP replies without validating them: whatever a validated request and a known
    engine can put in one must decode, validated, to the same fields."""
    core = RouterCore(RouterSettings())
    core.on_hello(_hello(engine, "dp"), 0.0)
    core.on_telemetry(
        Telemetry(
            engine_id=engine, seq=1, ts=0.0, kv_usage=0.0, num_running=0, num_waiting=0, waiting_prefill_tokens=0,
            remaining_prefill_tokens=0, step_time_ema=0.01,
        ),
        0.0,
    )  # fmt: skip
    reply = core.route_dp(RouteDpRequest(request_id=request_id, prompt_tokens=prompt_tokens), 0.0).reply
    assert isinstance(reply, DpChoice)
    decoded = decode(reply.encode(), RouteDpReply)
    assert (decoded.request_id, decoded.engine_id, decoded.priority) == (request_id, engine, prompt_tokens)
    assert decoded.decision_us == reply.decision_us >= 0


def test_views_refreshed_ahead_leave_a_decision_nothing_to_read_and_the_same_choice() -> None:
    rows = [(0, 0, 0.6, 0), (0, 0, 0.0, 4000), (2, 1, 0.1, 50)]
    ahead, plain = _core(RouterSettings(), "dp", rows), _core(RouterSettings(), "dp", rows)
    ahead.refresh_views(0.0)
    version = ahead.fleet.data_version
    assert ahead.dp._synced == version and ahead.dp._gathered == (ahead._dp_columns, version)
    for i in range(5):
        request = RouteDpRequest(request_id=f"r{i}", prompt_tokens=100 * i + 1)
        assert ahead.route_dp(request, 0.0).reply.engine_id == plain.route_dp(request, 0.0).reply.engine_id


def test_settings_from_the_environment_choose_and_weight_the_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    dp = RouteDpRequest(request_id="r", prompt_tokens=10)
    rows = [(0, 0, 0.6, 0), (0, 0, 0.0, 4000)]  # Gimbal: P_kv(0.6) = 3072 on e0 against 4000 tokens on e1
    assert _core(RouterSettings(), "dp", rows).route_dp(dp, 0.0).reply.engine_id == "e0"
    monkeypatch.setenv("SWITCHYARD_ROUTER_DP_WEIGHTS", '{"kv_penalty": 2}')
    assert _core(RouterSettings(), "dp", rows).route_dp(dp, 0.0).reply.engine_id == "e1"
    monkeypatch.delenv("SWITCHYARD_ROUTER_DP_WEIGHTS")
    monkeypatch.setenv("SWITCHYARD_ROUTER_GIMBAL_KV_COST_TOKENS", "4096")  # Gimbal's parameters, too
    assert _core(RouterSettings(), "dp", rows).route_dp(dp, 0.0).reply.engine_id == "e1"
    monkeypatch.setenv("SWITCHYARD_ROUTER_DP_PROFILE", "vllm")
    core = _core(RouterSettings(), "dp", [(3, 0, 0.0, 0), (1, 0, 0.0, 0)])
    assert core.route_dp(dp, 0.0).reply.engine_id == "e1"
    assert set(core.dp.snap.columns) == {"running", "waiting"}  # only the columns the profile reads
    monkeypatch.setenv("SWITCHYARD_ROUTER_DECODE_PROFILE", "rr")
    assert RouterSettings(policy="jsq").policy == "rr"  # the newer name wins


# ----- the in-flight ledger -----


def test_the_ledger_counts_decisions_until_a_late_enough_report() -> None:
    ledger = InflightLedger(2)
    ledger.add(0, 1.0, 300)
    ledger.add(0, 1.2, 100)
    ledger.add(1, 1.2, 50)
    assert (ledger.count.tolist(), ledger.tokens.tolist()) == ([2, 1], [400, 50])
    ledger.settle(0, before=1.1)
    assert (ledger.count[0], ledger.tokens[0]) == (1, 100) and list(ledger.entries(0)) == [(1.2, 100)]
    ledger.clear(1)
    assert (ledger.count[1], ledger.tokens[1]) == (0, 0)
    ledger.resize(4)
    ledger.add(3, 2.0, 7)
    ledger.compact(np.array([0, 3]))
    assert ledger.tokens.tolist() == [100, 7, 0, 0] and list(ledger.entries(1)) == [(2.0, 7)]
    ledger.settle(1, before=9.0)
    assert ledger.count[1] == 0 and not ledger.entries(1)


# ----- docs/architecture.md: how to add a decode scorer -----


def _example() -> ModuleType:
    path = ROOT / "docs" / "examples" / "decode_scorer.py"
    spec = importlib.util.spec_from_file_location("decode_scorer_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_the_documented_example_is_the_tested_file_and_fits_the_budget() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("## How to add a decode scorer", 1)[1].split("\n## ", 1)[0]
    listings = re.findall(r"```python\n(.*?)```", section, re.S)
    code = (ROOT / "docs" / "examples" / "decode_scorer.py").read_text()
    assert code in listings
    assert len(code.splitlines()) <= 60
    entry = next(listing for listing in listings if listing.startswith("Signal("))  # the registry's entry
    assert textwrap.indent(entry.rstrip("\n") + ",\n", "    ") in (ROOT / "shared" / "signals.py").read_text()
    producer = "self.migrating[row] = t.migrating"  # the producer code the section shows
    assert f"`{producer}`" in section and producer in (ROOT / "services" / "router" / "telemetry_view.py").read_text()


def _migrating_core(router: RouterSettings, rows: list[tuple[int, bool]]) -> RouterCore:
    """Decode engines e0, e1, ... reporting (running, migrating)."""
    core = RouterCore(router)
    for i, (running, migrating) in enumerate(rows):
        core.on_hello(_hello(f"e{i}", "decode"), 0.0)
        core.on_telemetry(
            Telemetry(
                engine_id=f"e{i}", seq=1, ts=0.0, kv_usage=0.0, num_running=running, num_waiting=0,
                waiting_prefill_tokens=0, remaining_prefill_tokens=0, step_time_ema=0.01, migrating=migrating,
            ),
            0.0,
        )  # fmt: skip
    return core


def test_the_example_scorer_needing_a_new_signal_steers_a_profile_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    example = _example()
    profile = example.JSQ_MIGRATION
    assert profile.needs == {"alive", "load", "migrating"}
    # equal load: the engine not migrating wins; a lighter engine that migrates loses to up to 4 more requests
    assert profile(_snap([2, 2, 3], migrating=[1, 0, 0]), Q, RouterState(), T).index == 1
    assert profile(_snap([2, 5], migrating=[1, 0]), Q, RouterState(), T).index == 1
    assert decode_profile("jsq")(_snap([2, 5], migrating=[1, 0]), Q, RouterState(), T).index == 0
    # registered, it is chosen and weighted from settings alone, in the router, which gathers the new signal
    # from the engines' telemetry with no code of its own
    monkeypatch.setitem(DECODE_PROFILES, profile.name, profile)
    request = RouteDecodeRequest(request_id="r", prompt_tokens=10)
    rows = [(2, True), (3, False), (4, False)]
    core = _migrating_core(RouterSettings(policy="jsq-migration"), rows)
    assert core.route_decode(request, 0.0).reply.engine_id == "e1"
    assert core.decode.snap.column("migrating").tolist() == [1.0, 0.0, 0.0]
    weights = {"migration": 0.5}  # migrating is now worth half a request: e0 (2.5) beats e1 (3)
    reply = _migrating_core(RouterSettings(policy="jsq-migration", decode_weights=weights), rows).route_decode(
        request, 0.0
    )
    assert (reply.reply.engine_id, reply.reply.policy) == ("e0", "jsq-migration")
