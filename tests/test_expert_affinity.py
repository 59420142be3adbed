"""Expert-affinity dispatch (issue 40 item 3): the signature cache, the engines' traffic, the centered cosine,
the scorer in the `gimbal-affinity` profile, the prefix-linked workloads and the simulator's feed with its
shuffled control."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.shared.signals import REQUEST_INPUTS
from switchyard.simulator.core.linked_replay import prefix_linked, task_prefixed
from switchyard.simulator.core.prefix_cache import prefix_keys
from switchyard.simulator.core.workload import Workload
from switchyard.simulator.offline.dp import DPFleetConfig, simulate_dp
from switchyard.simulator.offline.dp_affinity import AffinityFeed
from switchyard.simulator.offline.scenario import Scenario, prepare
from switchyard.solver.routing.affinity import (
    AffinityQuery,
    EngineTraffic,
    SignatureCache,
    affinity,
    signature_vector,
)
from switchyard.solver.routing.profiles import dp_profile
from switchyard.solver.routing.query import RouteQuery, RouterState
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables
from tests.eldr_helpers import ESFT_DIR


def _sig(hot: list[int], layers: int = 2, experts: int = 8) -> np.ndarray:
    c = np.ones((layers, experts))
    c[:, hot] += 20
    return signature_vector(c)


def test_signature_vector_is_a_distribution_per_layer() -> None:
    v = signature_vector(np.array([[3, 1, 0, 0], [0, 0, 0, 0]]))
    assert v.tolist() == [0.75, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        signature_vector(np.zeros(4))


def test_affinity_prefers_the_engine_whose_traffic_used_the_same_experts() -> None:
    a, b = _sig([0, 1]), _sig([6, 7])
    traffic = np.stack([3 * a + b, a + 3 * b])  # engine 0 mostly A, engine 1 mostly B; unequal volume is fine
    traffic[1] *= 5
    got = affinity(a, traffic)
    assert got is not None and got[0] > 0.9 and got[1] < -0.9
    assert affinity(b, traffic).tolist() == pytest.approx((-got).tolist())
    # a signature equal to the fleet's mean traffic tells the engines apart by nothing
    assert np.allclose(affinity((a + b) / 2, traffic), 0.0)
    # nothing to compare: no signature, or fewer than two engines with traffic
    assert affinity(None, traffic) is None
    assert affinity(a, np.stack([a, np.zeros_like(a)])) is None


def test_signature_cache_answers_with_the_longest_shared_prefix_and_stays_bounded() -> None:
    cache = SignatureCache(max_keys=4)
    a, b = _sig([0]), _sig([7])
    cache.record((1, 2), a)
    cache.record((1, 2, 3), b)  # the later request overwrites the shared keys
    sig, depth = cache.predict((1, 2, 3, 9))
    assert depth == 3 and sig is b
    assert cache.predict((5, 6)) is None and cache.misses == 1
    cache.record((10, 11, 12), a)  # 6 keys filed into 4: the oldest (1, 2) go
    assert len(cache) == 4
    assert cache.predict((1,)) is None
    assert cache.predict((1, 2, 3))[1] == 3


def test_engine_traffic_halves_every_half_life() -> None:
    t = EngineTraffic(2, 3, half_life_s=2.0)
    t.add(0, 10.0, np.array([4.0, 0.0, 0.0]))
    assert t.at(12.0)[0].tolist() == [2.0, 0.0, 0.0]
    assert t.at(11.0)[0].tolist() == [2.0, 0.0, 0.0]  # time does not run backwards
    with pytest.raises(ValueError):
        EngineTraffic(1, 1, half_life_s=0.0)


def test_the_profile_follows_affinity_at_equal_pressure_and_pressure_without_a_prediction() -> None:
    assert "expert_affinity" in REQUEST_INPUTS
    profile = dp_profile("gimbal-affinity")
    assert "expert_affinity" in profile.needs and "expert_affinity" not in profile.columns
    cols = {name: np.zeros(2) for name in ("remaining_prefill", "waiting_prefill", "inflight_tokens")}
    cols["expert_pressure"] = np.ones(2)
    snap = FleetSnapshot(("a", "b"), np.zeros(2), np.zeros(2), np.ones(2, dtype=bool), columns=cols)
    pick = lambda q: profile(snap, q, RouterState(), RoutingTables()).index  # noqa: E731
    assert pick(AffinityQuery(prompt_tokens=500, affinity=np.array([-0.8, 0.8]))) == 1
    assert pick(AffinityQuery(prompt_tokens=500, affinity=np.array([0.8, -0.8]))) == 0
    # engine 1 carries 6000 tokens of pressure: a 500-token prompt's full affinity (x 64) outweighs it, none does not
    snap.columns["waiting_prefill"] = np.array([0.0, 6000.0])
    assert pick(AffinityQuery(prompt_tokens=500, affinity=np.array([-1.0, 1.0]))) == 1
    assert pick(RouteQuery(prompt_tokens=500)) == 0
    assert pick(AffinityQuery(prompt_tokens=500)) == 0


def _workload(replay: list[int], prompt: list[int], hash_ids=None, block: int = 0) -> Workload:
    n = len(replay)
    return Workload(
        arrival=np.arange(n, dtype=np.float64),
        prompt=np.array(prompt),
        output=np.full(n, 4),
        replay=np.array(replay),
        description="test",
        hash_ids=hash_ids,
        hash_block=block,
    )


def test_task_prefixed_shares_the_system_prompt_within_a_task_only() -> None:
    labels = np.array([0, 0, 1, -1])
    wl = task_prefixed(_workload([0, 1, 2, 3, 0], [160, 64, 160, 160, 20]), labels, block=16, system_blocks=4)
    keys = [prefix_keys(h, int(p), 16) for h, p in zip(wl.hash_ids, wl.prompt, strict=True)]
    assert keys[0][:4] == keys[1][:4] and keys[0][4:5] != keys[4][4:5]
    assert not set(keys[0]) & set(keys[2])  # another task
    assert not set(keys[3]) & set(keys[0] + keys[2])  # no task: nothing shared
    assert len(keys[1]) == 4 and len(keys[4]) == 1  # the prompt's full blocks only
    assert len(set(keys[0][4:]) & set(keys[4])) == 0


def test_prefix_linked_replays_one_task_per_root_deterministically() -> None:
    labels = np.array([0, 0, 1, 1, 2, 2])
    roots = [np.array([r, 100 + i]) for i, r in enumerate([7, 8, 7, 9, 8, 7, 9, 7])]
    wl = _workload([0] * 8, [1024] * 8, hash_ids=tuple(roots), block=512)
    linked = prefix_linked(wl, labels, seed=3)
    task = labels[linked.replay]
    for root in (7, 8, 9):
        idx = [i for i, h in enumerate(roots) if h[0] == root]
        assert len(set(task[idx].tolist())) == 1
    assert prefix_linked(wl, labels, seed=3).replay.tolist() == linked.replay.tolist()
    with pytest.raises(ValueError):
        prefix_linked(_workload([0], [10]), labels, seed=0)


def test_the_feed_records_on_first_token_and_the_shuffled_control_moves_signatures() -> None:
    sigs = np.stack([_sig([0]), _sig([7])])
    keys = [(1, 2), (1, 2, 3), (5,)]
    feed = AffinityFeed(2, sigs, np.array([0, 0, 1]), keys)
    assert feed.query(0.0, 100, 0).affinity is None  # nothing recorded yet
    feed.routed(0, 0)
    feed.routed(2, 1)
    feed.first_tokens(1.0, [0, 2])
    q = feed.query(1.0, 100, 1)  # shares (1, 2) with request 0, which engine 0 served
    assert q.affinity is not None and q.affinity[0] > 0.9
    shuffled = AffinityFeed(2, sigs, np.array([0, 0, 1]), keys, control="shuffled", seed=1)
    assert sorted(shuffled.source.tolist()) == [0, 0, 1] and shuffled.source.tolist() != [0, 0, 1]
    with pytest.raises(ValueError):
        AffinityFeed(2, sigs, np.array([0]), None, control="nope")


@pytest.fixture(scope="module")
def esft() -> Scenario:
    return prepare(ESFT_DIR, gpu="H100", gpus=2, seed=0)


def _purity(engine: np.ndarray, task: np.ndarray) -> float:
    counts = np.zeros((int(task.max()) + 1, 2))
    np.add.at(counts, (task, engine), 1)
    return float(counts.max(axis=1).sum() / len(task))


def test_affinity_dispatch_groups_tasks_and_the_shuffled_control_does_not(esft: Scenario) -> None:
    wl = task_prefixed(esft.workload(300, seed=0, rate=20.0), esft.bank.labels)
    counts = esft.counts.prefill[esft.replay]
    task = esft.bank.labels[wl.replay]
    purity = {}
    for name, dispatch, control in (
        ("pressure", "gimbal", "none"),
        ("affinity", "gimbal-affinity", "none"),
        ("shuffled", "gimbal-affinity", "shuffled"),
    ):
        fleet = DPFleetConfig(
            engines=2, cost=esft.cost, dispatch_weights=(("expert_affinity", 64.0),), affinity_control=control
        )
        res = simulate_dp(wl, esft.bank, fleet, dispatch, "fcfs", seed=0, prefill_counts=counts)
        assert np.isfinite(res.finish).all()
        purity[name] = _purity(res.engine, task)
    assert purity["affinity"] > purity["pressure"] + 0.15
    assert purity["shuffled"] < purity["pressure"] + 0.1


def test_sim_dp_takes_the_affinity_control_from_the_command_line(esft: Scenario) -> None:
    from typer.testing import CliRunner

    from switchyard.cli import app
    from switchyard.simulator.offline.dp_run import DPSimOptions, fleet_for, run_sim_dp

    opts = DPSimOptions(trace=ESFT_DIR, rate=10.0, dispatch=("gimbal-affinity",), affinity_control="shuffled")
    assert fleet_for(esft, opts).affinity_control == "shuffled"
    with pytest.raises(ValueError, match="affinity control"):
        run_sim_dp(DPSimOptions(trace=ESFT_DIR, rate=10.0, affinity_control="sorted"), scenario=esft)
    result = CliRunner().invoke(app, ["sim-dp", "--rate", "10", "--affinity-control", "sorted"])
    assert result.exit_code == 2 and "affinity control" in result.output
