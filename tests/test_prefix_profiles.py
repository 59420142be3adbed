"""The peers' DP profiles (`llm-d`, `dynamo`, `sglang-cache`) on small fleets whose choice is computed by hand,
and the composed `switchyard` profile against `gimbal` (weight 0: the same decisions; equal pressure: the
cached engine)."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.solver.routing.pickers import SoftmaxSample
from switchyard.solver.routing.profiles import DP_PROFILES, PREFIX_WEIGHT, dp_profile
from switchyard.solver.routing.query import RouteQuery, RouterState
from switchyard.solver.routing.scorers import DynamoDecode, DynamoPrefill, SglangCacheAware
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables

TABLES = RoutingTables()
COLUMNS = (
    "waiting",
    "running",
    "outstanding",
    "remaining_prefill",
    "waiting_prefill",
    "inflight_tokens",
    "inflight",
    "expert_pressure",
    "kv_blocks",
    "indexed_blocks",
)


def fleet(n: int, kv: list[float] | None = None, alive: list[bool] | None = None, **cols: list[float]) -> FleetSnapshot:
    ids = [f"e{i}" for i in range(n)]
    snap = FleetSnapshot.build(
        ids,
        kv_usage=dict(zip(ids, kv or [0.0] * n, strict=True)),
        alive=dict(zip(ids, alive or [True] * n, strict=True)),
    )
    for name in COLUMNS:
        default = 1.0 if name == "expert_pressure" else 0.0
        snap.columns[name] = np.asarray(cols.get(name, [default] * n), dtype=np.float64)
    snap.load = snap.columns["outstanding"]
    return snap


def decide(name: str, snap: FleetSnapshot, query: RouteQuery, seed: int = 0, **kw: object) -> int:
    return dp_profile(name, **kw)(snap, query, RouterState.seeded(seed), TABLES).index  # type: ignore[arg-type]


def cached(*tokens: float) -> np.ndarray:
    return np.asarray(tokens, dtype=np.float64)


def test_the_peers_are_named_after_gimbal_and_before_switchyard() -> None:
    assert DP_PROFILES.index("gimbal") < DP_PROFILES.index("llm-d") < DP_PROFILES.index("dynamo")
    assert DP_PROFILES.index("dynamo") < DP_PROFILES.index("sglang-cache") < DP_PROFILES.index("switchyard")
    assert dp_profile("llm-d").weights == {"llmd_queue": 2.0, "llmd_kv_utilization": 2.0, "llmd_prefix": 3.0}
    assert dp_profile("dynamo").weights == {"dynamo_prefill": 1.0, "dynamo_decode": 1.0}


# -- llm-d ------------------------------------------------------------------------------------------------------


def test_llmd_picks_the_cached_engine_at_equal_load() -> None:
    snap = fleet(3, waiting=[2, 2, 2], kv=[0.3, 0.3, 0.3])
    assert decide("llm-d", snap, RouteQuery(prompt_tokens=1000, cached=cached(0, 800, 0))) == 1


def test_llmd_queue_and_kv_scores_outweigh_a_partial_hit() -> None:
    # engine 0: 40% cached, longest queue (queue score 0), KV 0.9 (score 0.1): 2·0 + 2·0.1 + 3·0.4 = 1.4
    # engine 1: nothing cached, shortest queue (1), KV 0.2 (0.8):            2·1 + 2·0.8 + 3·0 = 3.6
    snap = fleet(2, waiting=[10, 0], kv=[0.9, 0.2])
    query = RouteQuery(prompt_tokens=1000, cached=cached(400, 0))
    assert decide("llm-d", snap, query) == 1
    cost = dp_profile("llm-d").cost(snap, query, TABLES)
    np.testing.assert_allclose(cost, [-1.4, -3.6])
    # a full hit on engine 0 with the same pressure: 2·0 + 2·0.1 + 3·1 = 3.2 < 3.6, still engine 1
    assert decide("llm-d", snap, RouteQuery(prompt_tokens=1000, cached=cached(1000, 0))) == 1
    # ... and with an even queue (both score 1): 2 + 0.2 + 3 = 5.2 > 2 + 1.6 = 3.6: the cached engine
    snap = fleet(2, waiting=[3, 3], kv=[0.9, 0.2])
    assert decide("llm-d", snap, RouteQuery(prompt_tokens=1000, cached=cached(1000, 0))) == 0


def test_llmd_queue_is_min_max_normalised_over_live_engines() -> None:
    snap = fleet(3, waiting=[4, 2, 100], alive=[True, True, False])
    cost = dp_profile("llm-d").scorers[0].scorer.cost(snap, RouteQuery(), TABLES)
    np.testing.assert_allclose(cost[:2], [0.0, -1.0])
    assert decide("llm-d", snap, RouteQuery(prompt_tokens=100)) == 1


def test_llmd_without_an_index_answer_ties_at_random_among_equals() -> None:
    snap = fleet(4, waiting=[1, 1, 1, 1])
    picks = {decide("llm-d", snap, RouteQuery(prompt_tokens=100), seed=s) for s in range(40)}
    assert picks == {0, 1, 2, 3}


# -- dynamo -----------------------------------------------------------------------------------------------------


def test_dynamo_cost_numbers_by_hand() -> None:
    # block 16; prompt 320 tokens = 20 blocks; kv_blocks 1000
    # e0: 160 cached, backlog 0:            prefill (0 + 160)/16 = 10;   decode 0.2·1000 + 320/16 = 220 → 230
    # e1: nothing cached, backlog 96:       prefill (96 + 320)/16 = 26;  decode 0.05·1000 + 20 = 70      → 96
    # e2: all cached, 64 tokens in flight:  prefill (64 + 0)/16 = 4;     decode 0.1·1000 + (64+320)/16 = 124 → 128
    snap = fleet(
        3, kv=[0.2, 0.05, 0.1], kv_blocks=[1000, 1000, 1000], waiting_prefill=[0, 96, 0], inflight_tokens=[0, 0, 64]
    )
    query = RouteQuery(prompt_tokens=320, cached=cached(160, 0, 320))
    np.testing.assert_allclose(DynamoPrefill().cost(snap, query, TABLES), [10, 26, 4])
    np.testing.assert_allclose(DynamoDecode().cost(snap, query, TABLES), [220, 70, 124])
    np.testing.assert_allclose(dynamo_cost := dp_profile("dynamo").cost(snap, query, TABLES), [230, 96, 128])
    assert decide("dynamo", snap, query) == int(np.argmin(dynamo_cost)) == 1
    # overlap_score_weight 10 makes the cache win: 10·4 + 124 = 164 < 10·26 + 70 = 330
    assert decide("dynamo", snap, query, weights={"dynamo_prefill": 10.0}) == 2


def test_dynamo_docs_example() -> None:
    """Dynamo's documented example (kv_cache_routing.md): costs 18, 10, 11 pick worker 2 (index 1)."""
    # prefill blocks 8, 5, 2 and decode blocks 10, 5, 9 at block 1 token, prompt 0 (its blocks already counted)
    snap = fleet(3, kv=[1.0, 0.5, 0.9], kv_blocks=[10, 10, 10], waiting_prefill=[8, 5, 2])
    profile = dp_profile("dynamo")
    blocky = type(profile)(
        "dynamo",
        profile.filters,
        tuple(type(w)(type(w.scorer)(block_tokens=1), w.weight) for w in profile.scorers),
        profile.picker,
    )
    query = RouteQuery(prompt_tokens=0, cached=cached(0, 0, 0))
    np.testing.assert_allclose(blocky.cost(snap, query, TABLES), [18, 10, 11])
    assert blocky(snap, query, RouterState.seeded(0), TABLES).index == 1


def test_softmax_picker_temperature() -> None:
    cost, mask = np.array([0.0, 1.0, 2.0]), np.array([True, True, True])
    np.testing.assert_allclose(SoftmaxSample(0.0).probabilities(cost, mask), [1, 0, 0])
    p = SoftmaxSample(1.0).probabilities(cost, mask)  # exp(-0), exp(-0.5), exp(-1), normalised
    np.testing.assert_allclose(p, np.exp([0, -0.5, -1]) / np.exp([0, -0.5, -1]).sum())
    masked = SoftmaxSample(1.0).probabilities(cost, np.array([False, True, True]))
    assert masked[0] == 0 and masked[1] > masked[2]
    state = RouterState.seeded(3)
    picks = np.bincount([SoftmaxSample(1.0).pick(cost, mask, None, state) for _ in range(3000)], minlength=3)
    np.testing.assert_allclose(picks / 3000, p, atol=0.03)


# -- sglang-cache -----------------------------------------------------------------------------------------------


def test_sglang_imbalanced_goes_to_the_shortest_queue() -> None:
    # max − min = 70 > 64 and 80 > 10·1.5: imbalanced → least outstanding, whatever is cached
    snap = fleet(3, outstanding=[80, 10, 40], indexed_blocks=[0, 500, 500])
    query = RouteQuery(prompt_tokens=1000, cached=cached(1000, 0, 0))
    assert SglangCacheAware().branch(snap, query) == "balance"
    assert decide("sglang-cache", snap, query) == 1


def test_sglang_balanced_needs_both_thresholds() -> None:
    # diff 50 ≤ 64 (and 200 ≤ 150·1.5): balanced
    snap = fleet(2, outstanding=[200, 150], indexed_blocks=[10, 0])
    assert SglangCacheAware().branch(snap, RouteQuery(prompt_tokens=100, cached=cached(100, 0))) == "cache"
    # diff 100 > 64 but 1000 ≤ 900·1.5: still balanced
    snap = fleet(2, outstanding=[1000, 900], indexed_blocks=[10, 0])
    assert SglangCacheAware().branch(snap, RouteQuery(prompt_tokens=100, cached=cached(100, 0))) == "cache"


def test_sglang_balanced_match_over_threshold_takes_the_longest_match() -> None:
    snap = fleet(3, outstanding=[5, 0, 3], indexed_blocks=[900, 10, 10])
    query = RouteQuery(prompt_tokens=1000, cached=cached(310, 0, 200))  # 0.31 > 0.3
    assert SglangCacheAware().branch(snap, query) == "cache"
    assert decide("sglang-cache", snap, query) == 0


def test_sglang_balanced_low_match_takes_the_smallest_tree() -> None:
    snap = fleet(3, outstanding=[0, 5, 3], indexed_blocks=[900, 10, 50])
    query = RouteQuery(prompt_tokens=1000, cached=cached(300, 0, 200))  # 0.3 is not above 0.3
    assert SglangCacheAware().branch(snap, query) == "smallest_tree"
    assert decide("sglang-cache", snap, query) == 1
    assert decide("sglang-cache", snap, RouteQuery(prompt_tokens=1000)) == 1  # no index answer: a miss


def test_sglang_ignores_dead_engines() -> None:
    snap = fleet(3, outstanding=[100, 0, 0], alive=[True, False, True], indexed_blocks=[0, 0, 5])
    # imbalanced among the live engines (100 vs 0 on e2): the least loaded live one, not the dead e1
    assert decide("sglang-cache", snap, RouteQuery(prompt_tokens=10)) == 2
    snap = fleet(3, outstanding=[10, 0, 10], alive=[True, False, True], indexed_blocks=[7, 0, 5])
    query = RouteQuery(prompt_tokens=10, cached=cached(0, 10, 0))  # only the dead engine holds the prefix
    assert SglangCacheAware().branch(snap, query) == "smallest_tree"
    assert decide("sglang-cache", snap, query) == 2


def test_sglang_reweighted_still_decides_by_its_rule() -> None:
    snap = fleet(3, outstanding=[5, 0, 3], indexed_blocks=[900, 10, 10])
    query = RouteQuery(prompt_tokens=1000, cached=cached(310, 0, 200))
    assert decide("sglang-cache", snap, query, weights={"sglang_cache_aware": 3.0}) == 0


# -- switchyard -------------------------------------------------------------------------------------------------


def _random_fleet(rng: np.random.Generator, n: int) -> tuple[FleetSnapshot, RouteQuery]:
    kv = rng.choice([rng.uniform(0, 1, n), rng.uniform(0.85, 1.0, n), np.full(n, 0.5)])
    snap = fleet(
        n,
        kv=list(kv),
        alive=list(rng.random(n) > 0.15) if rng.random() < 0.5 else None,
        remaining_prefill=list(rng.integers(0, 5000, n).astype(float)),
        waiting_prefill=list(rng.choice([0, 1000, 8000], n).astype(float)),
        inflight_tokens=list(rng.integers(0, 3, n) * 512.0),
        expert_pressure=list(rng.uniform(1.0, 1.5, n)),
    )
    if not snap.alive.any():
        snap.alive[0] = True
    prompt = int(rng.integers(1, 8192))
    hits = rng.integers(0, prompt + 1, n).astype(float) * (rng.random(n) < 0.5)
    return snap, RouteQuery(prompt_tokens=prompt, cached=hits)


def test_switchyard_at_prefix_weight_zero_is_gimbal() -> None:
    rng = np.random.default_rng(25)
    gimbal = dp_profile("gimbal")
    plain = dp_profile("switchyard", weights={"uncached_prompt": 0})
    assert "cached_tokens" not in plain.needs
    for _ in range(500):
        snap, query = _random_fleet(rng, int(rng.integers(1, 9)))
        expect = gimbal(snap, query, RouterState.seeded(1), TABLES)
        got = plain(snap, query, RouterState.seeded(1), TABLES)
        assert got == expect


def test_switchyard_prefers_the_cached_engine_at_equal_pressure() -> None:
    snap = fleet(4, kv=[0.4] * 4, remaining_prefill=[1000] * 4, waiting_prefill=[512] * 4)
    query = RouteQuery(prompt_tokens=4096, cached=cached(0, 0, 2048, 4096))
    assert decide("switchyard", snap, query) == 3
    assert decide("gimbal", snap, query) == 0  # Gimbal is blind to it: the first minimum
    # ... but not at any price: more queued tokens on the cached engine than its 2048 cached are worth
    # (PREFIX_WEIGHT x 2048) send the request elsewhere
    worth = PREFIX_WEIGHT * 2048
    snap = fleet(2, kv=[0.4, 0.4], remaining_prefill=[0, worth + 1000])
    assert decide("switchyard", snap, RouteQuery(prompt_tokens=4096, cached=cached(0, 2048))) == 0
    snap = fleet(2, kv=[0.4, 0.4], remaining_prefill=[0, worth - 1000])
    assert decide("switchyard", snap, RouteQuery(prompt_tokens=4096, cached=cached(0, 2048))) == 1


@pytest.mark.parametrize("name", ["llm-d", "dynamo", "sglang-cache", "switchyard"])
def test_every_prefix_profile_decides_without_an_index(name: str) -> None:
    rng = np.random.default_rng(7)
    for _ in range(50):
        snap, query = _random_fleet(rng, 5)
        snap.columns["kv_blocks"] = np.full(5, 1000.0)
        index = decide(name, snap, RouteQuery(prompt_tokens=query.prompt_tokens))
        assert snap.alive[index]
        assert snap.alive[decide(name, snap, query)]
