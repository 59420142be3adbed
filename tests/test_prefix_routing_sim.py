"""Prefix-cache routing in the DP simulator: the dispatcher feeds ``cached_tokens`` (precise or approximate
index), the `switchyard` profile uses it, its controls hold, and `sim-dp --json` keeps issue 25's contract."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from switchyard.cli import app
from switchyard.simulator.core.workload import Workload
from switchyard.simulator.offline.dp import PREFIX_INDEXES, DPFleetConfig, DPSimResult, simulate_dp
from switchyard.simulator.offline.dp_run import summarize_dp
from switchyard.simulator.offline.scenario import Scenario, prepare
from switchyard.solver.routing.profiles import DP_PROFILES
from tests.eldr_helpers import ESFT_DIR

#: Issue 25's CLI contract: the profiles compared and the keys each `<profile>+<order>` entry must carry.
CONTRACT_PROFILES = ("vllm", "gimbal", "llm-d", "dynamo", "sglang-cache", "switchyard")
CONTRACT_KEYS = ("ttft_mean", "ttft_p99", "tpot_mean", "throughput", "prefix_hit_rate")
#: With hash ids shuffled across requests, switchyard's and gimbal's hit rates differ by at most this.
SHUFFLED_HIT_TOLERANCE = 0.01


@pytest.fixture(scope="module")
def esft() -> Scenario:
    return prepare(ESFT_DIR, gpu="H100", gpus=2, seed=0)


#: KV blocks per engine in these tests: room for about 8 of the 16 conversations' prefixes (12 × 32 blocks each)
#: and the running requests, so an engine that serves every conversation evicts what one that serves half keeps.
KV_BLOCKS = 4000


def _prefix_heavy(n: int = 160, groups: int = 16, seed: int = 3) -> Workload:
    """`groups` conversations, each a shared 12-block (6,144-token) prefix, plus a private tail of 1-3 blocks;
    Poisson arrivals, a random conversation each: every conversation's later turns could hit its prefix."""
    rng = np.random.default_rng(seed)
    group = rng.integers(0, groups, n)
    tail = rng.integers(1, 4, n)
    ids = tuple(
        np.r_[1000 * g + np.arange(12), 10**6 + 10 * r + np.arange(t)]
        for r, (g, t) in enumerate(zip(group, tail, strict=True))
    )
    return Workload(
        arrival=np.cumsum(rng.exponential(0.06, n)),
        prompt=np.array([512 * len(h) + 100 for h in ids]),
        output=rng.integers(8, 40, n),
        replay=np.arange(n) % 7,
        description="prefix-heavy synthetic",
        hash_ids=ids,
        hash_block=512,
    )


def _shuffled(wl: Workload, seed: int = 0) -> Workload:
    assert wl.hash_ids is not None
    ids = np.concatenate(wl.hash_ids)
    ids = ids[np.random.default_rng(seed).permutation(len(ids))]
    cuts = np.cumsum([len(h) for h in wl.hash_ids])[:-1]
    return dataclasses.replace(wl, hash_ids=tuple(np.split(ids, cuts)))


def _run(sc: Scenario, wl: Workload, dispatch: str, **fleet: object) -> DPSimResult:
    cfg = DPFleetConfig(cost=sc.cost, **{"engines": 2, "kv_blocks": KV_BLOCKS, **fleet})  # type: ignore[arg-type]
    return simulate_dp(wl, sc.bank, cfg, dispatch, "fcfs", prefill_counts=sc.counts.prefill[sc.replay])


def _ttft(res: DPSimResult) -> float:
    return float((res.first_token - res.arrival).mean())


def test_prefix_weight_zero_is_gimbal(esft: Scenario) -> None:
    wl = _prefix_heavy()
    gimbal = _run(esft, wl, "gimbal")
    zero = _run(esft, wl, "switchyard", dispatch_weights=(("uncached_prompt", 0.0),))
    assert np.array_equal(zero.engine, gimbal.engine), "same decisions, request by request"
    assert np.array_equal(zero.first_token, gimbal.first_token)


def test_switchyard_finds_more_cached_and_answers_sooner(esft: Scenario) -> None:
    wl = _prefix_heavy()
    gimbal, sy = _run(esft, wl, "gimbal"), _run(esft, wl, "switchyard")
    assert sy.prefix_hit_rate > gimbal.prefix_hit_rate + 0.03, (sy.prefix_hit_rate, gimbal.prefix_hit_rate)
    assert _ttft(sy) < _ttft(gimbal)
    assert np.array_equal(sy.tokens, wl.output)


def test_shuffled_hash_ids_leave_no_gap(esft: Scenario) -> None:
    wl = _shuffled(_prefix_heavy())
    gimbal, sy = _run(esft, wl, "gimbal"), _run(esft, wl, "switchyard")
    assert abs(sy.prefix_hit_rate - gimbal.prefix_hit_rate) <= SHUFFLED_HIT_TOLERANCE
    assert sy.prefix_hit_rate < 0.05, "hardly anything is shared any more"


@pytest.mark.parametrize("index", PREFIX_INDEXES)
def test_both_indexes_predictions_are_recorded(esft: Scenario, index: str) -> None:
    wl = _prefix_heavy()
    res = _run(esft, wl, "switchyard", prefix_index=index)
    pred = res.prefix_predicted
    assert pred.shape == (wl.size, 2) and (pred >= 0).all(), "every request with keys gets both predictions"
    assert (pred[:, 1] > 0).any(), "the approximate index learns from the dispatcher's own decisions"
    assert (pred % 512 == 0).all() and (pred < wl.prompt[:, None]).all(), "whole blocks, under the prompt"
    summary = summarize_dp(res)
    for name in PREFIX_INDEXES:
        assert 0.0 <= summary[f"prefix_{name}_exact"] <= 1.0  # type: ignore[operator]
        assert summary[f"prefix_{name}_mae"] >= 0.0  # type: ignore[operator]
    assert summary["prefix_precise_exact"] > 0.5  # type: ignore[operator]
    assert _run(esft, wl, "gimbal").prefix_predicted.min() == -1, "a profile without the prefix term asks no index"


def test_indexed_blocks_is_fed(esft: Scenario) -> None:
    from switchyard.simulator.offline.dp import SIM_COLUMNS, Dispatcher
    from switchyard.solver.routing.dispatch import GimbalParams

    assert {"indexed_blocks", "kv_blocks"} <= SIM_COLUMNS
    # without hash ids, SGLang's tree still grows by every prompt routed: misses then balance by routed tokens
    disp = Dispatcher("sglang-cache", 2, GimbalParams(), 0.05, kv_blocks=1000)
    picks = [disp.choose(0.0, 1600) for _ in range(4)]
    assert picks == [0, 1, 0, 1] and disp.indexed.tolist() == [200.0, 200.0]
    assert disp.snap.columns["kv_blocks"].tolist() == [1000.0, 1000.0]


def test_sim_dp_json_contract(tmp_path: Path) -> None:
    wl = _prefix_heavy(n=40)
    trace = tmp_path / "trace.jsonl"
    with trace.open("w") as f:
        for a, p, o, h in zip(wl.arrival, wl.prompt, wl.output, wl.hash_ids or (), strict=True):
            row = {"timestamp": int(a * 1000), "input_length": int(p), "output_length": int(o)}
            f.write(json.dumps({**row, "hash_ids": [int(x) for x in h]}) + "\n")
    profiles = [p for p in CONTRACT_PROFILES if p in DP_PROFILES]
    out = tmp_path / "dp.json"
    args = ["sim-dp", "--requests", str(trace), "--dispatch", ",".join(profiles), "--order", "fcfs"]
    args += ["--num-requests", "40", "--prefix-index", "approximate", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert set(payload["runs"]) == {f"{p}+fcfs" for p in profiles}
    for s in payload["runs"].values():
        for key in CONTRACT_KEYS:
            assert isinstance(s[key], float) and s[key] >= 0, key
    assert payload["runs"]["switchyard+fcfs"]["prefix_hit_rate"] > 0
    assert "prefix_approximate_mae" in payload["runs"]["switchyard+fcfs"]
    assert payload["config"]["prefix_index"] == "approximate"
    bad = CliRunner().invoke(app, [*args[:-2], "--prefix-index", "psychic"])
    assert bad.exit_code != 0 and "prefix_index" in bad.output
