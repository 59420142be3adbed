"""Decode-routing policies: pure functions over a fleet snapshot, with explicit state."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import switchyard.solver.routing.eldr_kernel as decode_policies
from switchyard.solver.routing import (
    DECODE_POLICIES,
    FleetSnapshot,
    RouteQuery,
    RouterState,
    RoutingTables,
    centroid_members,
    domain_partition,
    get_policy,
)

IDS = [f"d{i}" for i in range(6)]


def _snap(load: list[float], alive: list[bool] | None = None, ids: list[str] | None = None) -> FleetSnapshot:
    ids = ids or IDS[: len(load)]
    return FleetSnapshot.build(
        ids, load=dict(zip(ids, load, strict=True)), alive=dict(zip(ids, alive or [True] * len(ids), strict=True))
    )


@settings(max_examples=60, deadline=None)
@given(
    load=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    alive_bits=st.integers(1, 255),
    seed=st.integers(0, 2**16),
)
def test_every_policy_picks_a_live_engine(load: list[int], alive_bits: int, seed: int) -> None:
    d = len(load)
    alive = [(alive_bits >> i) & 1 == 1 for i in range(d)]
    if not any(alive):
        alive[0] = True
    ids = [f"e{i}" for i in range(d)]
    snap = _snap([float(x) for x in load], alive, ids)
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 6))
    tables = RoutingTables.build(snap.engine_ids, num_centroids=k, label_shares={"x": 1.0, "y": 2.0})
    query = RouteQuery(sims=rng.random(k), label="x")
    state = RouterState.seeded(seed)
    for policy in DECODE_POLICIES.values():
        decision = policy(snap, query, state, tables)
        assert snap.alive[decision.index], policy.name
    live_min = min(x for x, a in zip(load, alive, strict=True) if a)
    assert snap.load[get_policy("jsq")(snap, query, state, tables).index] == live_min


def test_no_live_engine_is_an_error() -> None:
    snap = _snap([0.0, 0.0], [False, False])
    for policy in DECODE_POLICIES.values():
        with pytest.raises(LookupError):
            policy(snap, RouteQuery(sims=np.ones(2)), RouterState(), RoutingTables.build(snap.engine_ids, 2))


def test_round_robin_cycles_over_live_engines_in_order() -> None:
    snap = _snap([0.0] * 4, [True, False, True, True])
    state, rr = RouterState(), get_policy("rr")
    picks = [rr(snap, RouteQuery(), state, RoutingTables()).index for _ in range(6)]
    assert picks == [0, 2, 3, 0, 2, 3]


def test_random_and_p2c_are_seeded_and_spread() -> None:
    snap = _snap([0.0] * 5)
    for name in ("random", "p2c"):
        policy = get_policy(name)
        runs = [
            [policy(snap, RouteQuery(), st, RoutingTables()).index for _ in range(200)]
            for st in (RouterState.seeded(7), RouterState.seeded(7), RouterState.seeded(8))
        ]
        assert runs[0] == runs[1] and runs[0] != runs[2]
        assert set(runs[0]) == set(range(5))


def test_p2c_never_picks_the_unique_most_loaded_engine() -> None:
    snap = _snap([1.0, 1.0, 9.0])
    state = RouterState.seeded(1)
    picks = {get_policy("p2c")(snap, RouteQuery(), state, RoutingTables()).index for _ in range(200)}
    assert 2 not in picks


def test_centroid_members_mapping_rules() -> None:
    ids = ["a", "b", "c", "d"]
    assert np.array_equal(centroid_members(4, ids), np.eye(4, dtype=bool))
    two = centroid_members(2, ids)  # D > K: engine j serves centroid j mod K
    assert two[:, 0].tolist() == [True, False] and two[:, 1].tolist() == [False, True] and two[0, 2] and two[1, 3]
    six = centroid_members(6, ids)  # K > D: centroid k served by engine k mod D
    assert six[4].tolist() == [True, False, False, False] and six.sum(axis=1).tolist() == [1] * 6
    named = centroid_members(2, ids, decoder_ids=["c", "a"])
    assert named[:, 2].tolist() == [True, False] and named[:, 0].tolist() == [False, True]
    assert named[:, 1].all() and named[:, 3].all(), "engines the artifact does not name serve every band"
    with pytest.raises(ValueError):
        centroid_members(3, ids, decoder_ids=["a"])


def test_eldr_picks_least_loaded_engine_in_the_band() -> None:
    snap = _snap([5.0, 1.0, 3.0, 0.0])
    tables = RoutingTables.build(snap.engine_ids, num_centroids=4, tau=0.1)
    sims = np.array([0.90, 0.50, 0.85, 0.20])  # band: centroids 0 and 2
    d = get_policy("eldr")(snap, RouteQuery(sims=sims), RouterState(), tables)
    assert (d.index, d.band_size, d.fallback) == (2, 2, None)
    d0 = get_policy("eldr-tau0")(snap, RouteQuery(sims=sims), RouterState(), tables)
    assert (d0.index, d0.band_size) == (0, 1)
    wide = RoutingTables.build(snap.engine_ids, num_centroids=4, tau=1.0)
    assert get_policy("eldr")(snap, RouteQuery(sims=sims), RouterState(), wide).index == 3  # pure JSQ


def test_eldr_ties_go_to_the_most_similar_engine() -> None:
    snap = _snap([2.0, 2.0, 2.0])
    tables = RoutingTables.build(snap.engine_ids, num_centroids=3, tau=0.5)
    d = get_policy("eldr")(snap, RouteQuery(sims=np.array([0.6, 0.9, 0.7])), RouterState(), tables)
    assert d.index == 1


def test_eldr_dead_decoder_and_empty_band() -> None:
    sims = np.array([0.9, 0.1, 0.85])
    snap = _snap([0.0, 0.0, 4.0], [False, True, True])
    tables = RoutingTables.build(snap.engine_ids, num_centroids=3, tau=0.1)
    d = get_policy("eldr")(snap, RouteQuery(sims=sims), RouterState(), tables)
    assert (d.index, d.band_size, d.fallback) == (2, 1, None), "the band's remaining member serves"
    snap = _snap([0.0, 0.0, 4.0], [False, True, False])
    d = get_policy("eldr")(snap, RouteQuery(sims=sims), RouterState(), tables)
    assert (d.index, d.fallback) == (1, "band_empty"), "empty band: least loaded live engine"
    d = get_policy("eldr")(snap, RouteQuery(sims=None), RouterState(), tables)
    assert d.fallback == "no_signature"


def test_eldr_with_named_decoders_and_more_engines_than_centroids() -> None:
    ids = ["a", "b", "c"]
    snap = _snap([3.0, 1.0, 0.0], ids=ids)
    tables = RoutingTables.build(snap.engine_ids, num_centroids=2, decoder_ids=["a", "b"], tau=0.0)
    # centroid 0 -> a (load 3); c is unnamed, so it serves every band and is least loaded
    d = get_policy("eldr")(snap, RouteQuery(sims=np.array([1.0, 0.0])), RouterState(), tables)
    assert snap.engine_ids[d.index] == "c" and d.band_size == 2


def _eldr_by_definition(snap: FleetSnapshot, sims: np.ndarray, tables: RoutingTables) -> tuple[int, int] | None:
    """The ELDR pick written out over whole arrays: (index, band size), or None when the band has no live engine."""
    assert tables.members is not None
    engine_sim = np.where(tables.members, sims[:, None], -np.inf).max(axis=0)
    band = (engine_sim >= sims.max() - tables.tau) & snap.alive
    load = np.where(band, snap.load, np.inf)
    if load.min() == np.inf:
        return None
    return int(np.argmax(np.where(load == load.min(), engine_sim, -np.inf))), int(band.sum())


@settings(max_examples=300, deadline=None)
@given(
    load=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    alive_bits=st.integers(0, 4095),
    sims=st.lists(st.sampled_from([0.0, 0.1, 0.2, 0.25, 0.3, 0.5, 0.55, 0.9, 1.0]), min_size=1, max_size=8),
    tau=st.sampled_from([0.0, 0.05, 0.1, 0.25, 2.0]),
    named=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float64]),
    arrays=st.booleans(),
)
def test_eldr_matches_its_definition(
    load: list[int], alive_bits: int, sims: list[float], tau: float, named: bool, dtype: type, arrays: bool
) -> None:
    """Ties in load and similarity are frequent here: the pick must be the definition's, index for index, on
    both of the policy's code paths (the per-engine loop for small fleets, numpy beyond)."""
    d, k = len(load), len(sims)
    alive = [(alive_bits >> i) & 1 == 1 for i in range(d)]
    ids = [f"e{i:02d}" for i in range(d)]
    snap = _snap([float(x) for x in load], alive, ids)
    decoders = [ids[i % d] for i in range(k)] if named else None
    tables = RoutingTables.build(snap.engine_ids, num_centroids=k, decoder_ids=decoders, tau=tau)
    similarities = np.array(sims, dtype=dtype)
    query = RouteQuery(sims=similarities)
    with mock.patch.object(decode_policies, "LOOP_MAX_ENGINES", 0 if arrays else decode_policies.LOOP_MAX_ENGINES):
        if not any(alive):
            with pytest.raises(LookupError):
                get_policy("eldr")(snap, query, RouterState(), tables)
            return
        decision = get_policy("eldr")(snap, query, RouterState(), tables)
    expected = _eldr_by_definition(snap, similarities, tables)
    if expected is None:
        assert decision.fallback == "band_empty"
        assert snap.load[decision.index] == min(x for x, a in zip(load, alive, strict=True) if a)
    else:
        assert (decision.index, decision.band_size, decision.fallback) == (*expected, None)


@pytest.mark.parametrize("arrays", [False, True])
def test_eldr_band_edge_is_computed_in_the_similarities_dtype(arrays: bool) -> None:
    snap = _snap([1.0, 0.0])
    tables = RoutingTables.build(snap.engine_ids, num_centroids=2, tau=0.1)
    limit = 0 if arrays else decode_policies.LOOP_MAX_ENGINES
    with mock.patch.object(decode_policies, "LOOP_MAX_ENGINES", limit):
        # float64: 0.3 - 0.1 = 0.19999999999999998 <= 0.2, so engine 1 is in the band...
        wide = get_policy("eldr")(snap, RouteQuery(sims=np.array([0.3, 0.2])), RouterState(), tables)
        # ...float32: 0.3f - 0.1f rounds to just above 0.2f, so it is not
        narrow = get_policy("eldr")(snap, RouteQuery(sims=np.array([0.3, 0.2], np.float32)), RouterState(), tables)
    assert (wide.index, wide.band_size) == (1, 2)
    assert (narrow.index, narrow.band_size) == (0, 1)


def test_domain_partition_is_proportional_and_covers_every_engine() -> None:
    ids = [f"d{i:02d}" for i in range(16)]
    parts = domain_partition({"intent": 0.6, "law": 0.15, "summary": 0.06, "translation": 0.19}, ids)
    counts = {k: int(v.sum()) for k, v in parts.items()}
    assert sum(counts.values()) == 16 and min(counts.values()) >= 1
    assert counts["intent"] > counts["translation"] >= counts["law"] >= counts["summary"]
    assert np.array_equal(np.sum(list(parts.values()), axis=0), np.ones(16)), "each engine in one partition"
    few = domain_partition({"a": 1, "b": 1, "c": 1}, ids[:2])
    assert all(v.sum() == 1 for v in few.values())


def test_domain_routes_inside_the_label_partition() -> None:
    snap = _snap([0.0, 5.0, 4.0, 9.0])
    tables = RoutingTables.build(snap.engine_ids, label_shares={"a": 1.0, "b": 1.0})
    d = get_policy("domain")(snap, RouteQuery(label="b"), RouterState(), tables)
    assert d.index == 2 and d.band_size == 2
    d = get_policy("domain")(snap, RouteQuery(label="zzz"), RouterState(), tables)
    assert d.index == 0 and d.fallback == "no_label"


def test_snapshot_requires_sorted_unique_ids() -> None:
    with pytest.raises(ValueError):
        FleetSnapshot(("b", "a"), np.zeros(2), np.zeros(2), np.ones(2, bool))
    snap = FleetSnapshot.build(["z", "a"], load={"z": 2.0})
    assert snap.engine_ids == ("a", "z") and snap.load.tolist() == [0.0, 2.0] and snap.index("z") == 1


def test_snapshot_from_router_columns_sorts_by_id() -> None:
    ids = ["decode-b", "decode-c", "decode-a"]
    snap = FleetSnapshot.from_columns(ids, np.array([2.0, 3.0, 1.0]), np.array([0.2, 0.3, 0.1]), np.array([1, 0, 1]))
    assert snap.engine_ids == ("decode-a", "decode-b", "decode-c")
    assert snap.load.tolist() == [1.0, 2.0, 3.0] and snap.alive.tolist() == [True, True, False]
    assert snap.kv_usage.tolist() == [0.1, 0.2, 0.3]
