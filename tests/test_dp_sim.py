"""The data-parallel fleet simulator: invariants, determinism, SJF-with-aging, dispatch views, the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from switchyard.cli import app
from switchyard.services.router.settings import RouterSettings
from switchyard.simulator.core.dp_engine import DPCost, MixedEngine
from switchyard.simulator.core.physics import cost_model
from switchyard.simulator.core.workload import Workload, load_request_csv
from switchyard.simulator.offline import dp_dispatch
from switchyard.simulator.offline.dp import Dispatcher, DPFleetConfig, simulate_dp
from switchyard.simulator.offline.dp_run import prompt_throughput_gap, summarize_dp, trace_window
from switchyard.simulator.offline.scenario import Scenario, prepare
from switchyard.solver.routing import Profile
from switchyard.solver.routing.dispatch import DISPATCH_POLICIES, GimbalParams
from switchyard.solver.routing.filters import Alive
from switchyard.solver.routing.framework import Weighted
from switchyard.solver.routing.pickers import FirstMin
from switchyard.solver.routing.profiles import DP_PROFILES
from switchyard.solver.routing.scorers import Column
from tests.conftest import SHIPPED_DATA
from tests.eldr_helpers import ESFT_DIR

AZURE = SHIPPED_DATA / "requests" / "azure_llm_2023"


@pytest.fixture(scope="module")
def esft() -> Scenario:
    return prepare(ESFT_DIR, gpu="H100", gpus=2, seed=0)


def _fleet(sc: Scenario, **kw: object) -> DPFleetConfig:
    return DPFleetConfig(cost=sc.cost, **{"engines": 2, **kw})  # type: ignore[arg-type]


def _workload(prompt: list[int] | np.ndarray, output: list[int] | np.ndarray, arrival: np.ndarray) -> Workload:
    n = len(arrival)
    replay = np.arange(n) % 7
    return Workload(np.asarray(arrival, float), np.asarray(prompt), np.asarray(output), replay, "synthetic")


def _run(sc: Scenario, wl: Workload, fleet: DPFleetConfig, dispatch: str, order: str = "fcfs", **kw: object):
    return simulate_dp(wl, sc.bank, fleet, dispatch, order, prefill_counts=sc.counts.prefill[sc.replay], **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("coupled", [True, False], ids=["lock-step", "independent"])
@pytest.mark.parametrize("order", ["fcfs", "sjf-aging"])
@pytest.mark.parametrize("dispatch", DISPATCH_POLICIES)
def test_invariants_every_request_once_tokens_conserved(
    esft: Scenario, dispatch: str, order: str, coupled: bool
) -> None:
    """check=True asserts after every event: one engine per request, KV within capacity and recounted."""
    fleet = _fleet(esft, coupled=coupled, kv_blocks=100, max_running=12, token_budget=512)
    wl = esft.workload(
        60, seed=4, requests=load_request_csv(AZURE / "AzureLLMInferenceTrace_conv.csv"), time_scale=200.0
    )
    wl = dataclasses.replace(wl, prompt=np.minimum(wl.prompt, 900), output=np.minimum(wl.output, 150))
    res = _run(esft, wl, fleet, dispatch, order, seed=4, check=True)
    assert np.array_equal(res.tokens, wl.output), "each request generated exactly its output tokens"
    assert np.isfinite(res.finish).all() and (res.arrival < res.first_token).all()
    assert (res.first_token <= res.finish).all()
    assert ((res.engine >= 0) & (res.engine < 2)).all() and res.engine_requests.sum() == wl.size
    assert res.engine_tokens.sum() == wl.output.sum()
    assert (res.engine_max_kv_blocks <= 100).all()
    assert res.engine_preemptions.sum() > 0, "the small KV cache must force preemptions"
    # every prompt token is computed at least once; recomputation after preemption only adds
    assert res.engine_prompt_tokens.sum() >= wl.prompt.sum()
    assert (res.step_tokens <= fleet.token_budget).all(), "a step never exceeds its token budget"


def test_tokens_are_conserved_exactly_without_preemption(esft: Scenario) -> None:
    fleet = _fleet(esft, token_budget=1024)
    wl = esft.workload(
        200, seed=1, requests=load_request_csv(AZURE / "AzureLLMInferenceTrace_code.csv"), time_scale=50.0
    )
    res = _run(esft, wl, fleet, "gimbal", "sjf-aging", check=True)
    assert res.engine_preemptions.sum() == 0
    assert res.step_prefill.sum() == wl.prompt.sum() == res.engine_prompt_tokens.sum()
    # each step computes its prefill chunks plus one token per decoding request: Σ prompt + Σ (output − 1)
    assert res.step_tokens.sum() == wl.prompt.sum() + (wl.output - 1).sum()
    assert (res.step_tokens == res.step_prefill + res.step_decode).all()
    assert res.step_prefill.max() <= 1024 and (wl.prompt > 1024).any(), "long prompts were chunked"


def test_chunked_prefill_shares_steps_with_decode(esft: Scenario) -> None:
    """A 20k-token prompt takes three 8192-token steps; a decoding request keeps getting tokens meanwhile."""
    cost = DPCost(esft.cost, ep_ranks=2)
    eng = MixedEngine(cost, esft.bank, token_budget=8192)
    eng.add(0, 0, 10, 50, arrival=0.0)
    plan = eng.begin_step(0.0)
    assert plan is not None and plan.prefill_tokens == 10
    assert eng.end_step().first == [0]
    eng.add(1, 1, 20_000, 5, arrival=0.0)
    chunks, decodes = [], []
    for _ in range(3):
        plan = eng.begin_step(0.0)
        assert plan is not None
        chunks.append(plan.prefill_tokens)
        decodes.append(plan.decode)
        out = eng.end_step()
    assert chunks == [8191, 8191, 20_000 - 2 * 8191], "the decoding request takes one token of every budget"
    assert decodes == [1, 1, 1] and out.first == [1]


def test_same_seed_same_run_other_seed_other_run(esft: Scenario) -> None:
    fleet = _fleet(esft)
    requests = load_request_csv(AZURE / "AzureLLMInferenceTrace_code.csv")
    runs = {}
    for seed in (5, 5, 6):
        wl = esft.workload(300, seed=seed, requests=requests, time_scale=60.0)
        runs.setdefault(seed, []).append(_run(esft, wl, fleet, "gimbal", "sjf-aging", seed=seed))
    a, b = runs[5]
    for name in ("engine", "first_token", "finish", "step_start", "step_duration"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert summarize_dp(a) == summarize_dp(b)
    c = runs[6][0]
    assert not np.array_equal(a.first_token, c.first_token), "another seed draws other routing and telemetry phases"


def test_sjf_aging_admission_order(esft: Scenario) -> None:
    """One slot, so requests are admitted one by one in the queue policy's order."""
    arrivals, prompts = [0.0, 1.0, 2.0, 3.0], [900, 50, 400, 10]

    def admitted(order: str, params: GimbalParams) -> list[int]:
        eng = MixedEngine(DPCost(esft.cost, 2), esft.bank, max_running=1, order=order, params=params)  # type: ignore[arg-type]
        for rid, (t, p) in enumerate(zip(arrivals, prompts, strict=True)):
            eng.add(rid, rid, p, 1, arrival=t)
        seen: list[int] = []
        now = 6.5
        while eng.has_work():
            plan = eng.begin_step(now)
            assert plan is not None
            seen += plan.admitted
            now += plan.duration
            eng.end_step()
        return seen

    # at 6.5 s requests 0 (waited 6.5 s) and 1 (5.5 s) are past θ = 5 s: oldest first, then shortest first
    assert admitted("sjf-aging", GimbalParams()) == [0, 1, 3, 2]
    assert admitted("sjf-aging", GimbalParams(age_threshold_s=1e9)) == [3, 1, 2, 0]
    assert admitted("fcfs", GimbalParams()) == [0, 1, 2, 3]


def _starvation_run(esft: Scenario, theta: float) -> float:
    """TTFT of one 4,000-token prompt arriving in an overload of short requests (one engine, 4 slots)."""
    rng = np.random.default_rng(0)
    n = 900
    arrival = np.sort(rng.uniform(0.0, 15.0, n))
    prompt = np.full(n, 64)
    output = np.full(n, 48)
    long_rid = int(np.searchsorted(arrival, 0.5))
    prompt[long_rid] = 4000
    fleet = _fleet(esft, engines=1, max_running=4, params=GimbalParams(age_threshold_s=theta))
    res = _run(esft, _workload(prompt, output, arrival), fleet, "rr", "sjf-aging")
    backlog = res.step_waiting.max()
    assert backlog > 100, f"the short requests must overload the engine (max queue {backlog})"
    return float(res.first_token[long_rid] - res.arrival[long_rid])


def test_aging_prevents_starvation(esft: Scenario) -> None:
    theta = 2.0
    ttft = _starvation_run(esft, theta)
    # promoted once it has waited θ; then it waits only for one of the 4 slots to free and its own prefill
    assert theta < ttft < theta + 0.5
    starved = _starvation_run(esft, 1e9)
    assert starved > 5 * theta, "without aging the long prompt waits behind every short request"


def test_dispatcher_views_vllm_snapshot_and_gimbal_compensation() -> None:
    params = GimbalParams()
    vllm = Dispatcher("vllm", 2, params, grace_s=0.05)
    # empty snapshot: vLLM's local waiting increment alternates engines between coordinator snapshots
    assert [vllm.choose(0.0, 100) for _ in range(4)] == [0, 1, 0, 1]
    vllm.on_coordinator(np.array([0.0, 3.0]), np.array([2.0, 0.0]), np.zeros(2))
    assert vllm.snap_waiting.tolist() == [0.0, 3.0], "a snapshot replaces the local increments"
    assert vllm.choose(0.1, 100) == 0  # 4*0 + 2 < 4*3 + 0

    g = Dispatcher("gimbal", 2, params, grace_s=0.05)
    assert g.choose(0.0, 3000) == 0
    assert g.comp.tolist() == [3000.0, 0.0]
    assert g.choose(0.001, 100) == 1, "the in-flight compensation steers away from the engine just chosen"
    g.on_telemetry(0, 0.03, kv=0.1, remaining=0, waiting=0, pressure=1.0)
    assert g.comp[0] == 3000.0, "a report sent within the grace period may not include the decision yet"
    g.on_telemetry(0, 0.06, kv=0.1, remaining=2900, waiting=0, pressure=1.0)
    assert g.comp[0] == 0.0 and g.remaining[0] == 2900


@pytest.mark.parametrize("dispatch", DP_PROFILES)
def test_the_simulator_dispatches_with_the_router_s_dp_profile(dispatch: str) -> None:
    params = GimbalParams(kv_high=0.8, kv_cost_tokens=1000.0)
    router = RouterSettings(dp_rule=dispatch).build_dp_profile(params)
    sim = Dispatcher(dispatch, 3, params, grace_s=0.05).profile
    assert sim == router and sim.columns == router.columns


def test_a_reweighted_profile_changes_what_the_simulated_dispatcher_reads() -> None:
    plain = Dispatcher("gimbal", 2, GimbalParams(), grace_s=0.05)
    blind = Dispatcher("gimbal", 2, GimbalParams(), grace_s=0.05, weights={"inflight_tokens": 0.0})
    assert [plain.choose(0.0, 3000), plain.choose(0.001, 100)] == [0, 1]
    assert [blind.choose(0.0, 3000), blind.choose(0.001, 100)] == [0, 0], "no in-flight term: no compensation"
    assert blind.ledger.tokens.tolist() == [0.0, 0.0], "a profile without the in-flight columns keeps no ledger"


def test_a_new_dp_profile_runs_in_the_simulator_without_simulator_code(monkeypatch: pytest.MonkeyPatch) -> None:
    least_kv = Profile("least-kv", (Alive(),), (Weighted(Column("kv_usage"), 1.0),), FirstMin())
    monkeypatch.setattr(dp_dispatch, "dp_profile", lambda name, params, weights=None: least_kv)
    d = Dispatcher("least-kv", 2, GimbalParams(), grace_s=0.05)
    assert d.needs_telemetry and not d.needs_coordinator, "KV usage alone comes from the engines' telemetry"
    d.on_telemetry(0, 0.0, kv=0.7, remaining=0, waiting=0, pressure=1.0)
    d.on_telemetry(1, 0.0, kv=0.2, remaining=0, waiting=0, pressure=1.0)
    assert d.choose(0.1, 100) == 1
    step_time = Profile("by-step", (Alive(),), (Weighted(Column("step_time"), 1.0),), FirstMin())
    monkeypatch.setattr(dp_dispatch, "dp_profile", lambda name, params, weights=None: step_time)
    with pytest.raises(ValueError, match="does not feed: step_time"):
        Dispatcher("by-step", 2, GimbalParams(), grace_s=0.05)


def test_dispatch_weights_reach_the_profiles_that_have_the_scorer(esft: Scenario) -> None:
    fleet = _fleet(esft, dispatch_weights=(("inflight_tokens", 0.0), ("waiting", 8.0)))
    assert fleet.weights_for("gimbal") == {"inflight_tokens": 0.0}
    assert fleet.weights_for("vllm") == {"waiting": 8.0} and fleet.weights_for("jsq") == {}
    burst = _workload([500] * 4, [2] * 4, np.zeros(4))  # all before any engine reports
    assert _run(esft, burst, _fleet(esft), "gimbal").engine.tolist() == [0, 1, 0, 1]
    assert _run(esft, burst, fleet, "gimbal").engine.tolist() == [0, 0, 0, 0], "no in-flight term: herding"
    runner = CliRunner()
    bad = runner.invoke(app, ["sim-dp", "--rate", "5", "--dispatch", "jsq", "--dp-weights", "kv_penalty=2"])
    assert bad.exit_code != 0 and "no dispatched profile has a scorer 'kv_penalty'" in bad.output
    bad = runner.invoke(app, ["sim-dp", "--rate", "5", "--dispatch", "jsq", "--dp-weights", "outstanding"])
    assert bad.exit_code != 0 and "not name=weight" in bad.output


def test_draining_compensation_forgets_a_prompt_at_the_drain_rate() -> None:
    g = Dispatcher("gimbal", 2, GimbalParams(), grace_s=0.05, drain_tokens_per_s=10_000)
    assert g.choose(0.0, 3000) == 0
    assert g._drained(0.1).tolist() == [2000.0, 0.0]  # 0.1 s at 10,000 tokens/s drained a third of it
    assert g.choose(0.1, 100) == 1  # 2,000 tokens still count: the other engine
    assert g._drained(0.4).tolist() == [0.0, 0.0]  # both prompts have drained before any report arrived
    assert g.choose(0.4, 100) == 0  # nothing counts any more: ties go to the first engine
    assert g.comp.tolist() == [3100.0, 100.0]  # the report-based count is kept alongside, unchanged


def test_gimbal_kv_first_rule_triggers_only_when_it_should() -> None:
    g = Dispatcher("gimbal", 2, GimbalParams(), grace_s=0.05)
    # engine 1 has far more prefill work, but engine 0's cache is 95 % full and 45 points above engine 1's
    g.on_telemetry(0, 0.0, kv=0.95, remaining=0, waiting=0, pressure=1.0)
    g.on_telemetry(1, 0.0, kv=0.50, remaining=20_000, waiting=20_000, pressure=1.0)
    assert g.choose(0.1, 100) == 1 and g.kv_first == 1
    g.on_telemetry(0, 0.2, kv=0.85, remaining=0, waiting=0, pressure=1.0)  # below 90 %: pressure scores again
    assert g.choose(0.3, 100) == 0 and g.kv_first == 1


def test_kv_first_rule_fires_in_a_kv_bound_fleet(esft: Scenario) -> None:
    """Long outputs into small caches: some engine passes 90 % with a spread, and KV stays within capacity."""
    fleet = _fleet(esft, kv_blocks=300, max_running=64)
    rng = np.random.default_rng(1)
    n = 100
    arrival = np.sort(rng.uniform(0.0, 0.5, n))
    wl = _workload(rng.integers(100, 1200, n), rng.integers(200, 600, n), arrival)
    res = _run(esft, wl, fleet, "gimbal")
    assert res.kv_first_decisions > 0
    assert (res.engine_max_kv_blocks <= 300).all()
    assert np.array_equal(res.tokens, wl.output)


def test_mla_kv_is_replicated_over_tensor_parallel_ranks(esft: Scenario) -> None:
    """DeepSeek's latent KV cannot be split by heads, so each TP rank holds all of it; Qwen3's GQA KV splits."""

    def by_hand(cost: DPCost, shards: int) -> int:
        m, g = cost.cost.model, cost.cost.gpu
        experts = m.moe_layers * m.num_experts * m.expert_bytes
        weights = (m.weight_bytes - experts) / cost.tp + experts / cost.ep_ranks
        return int((0.9 * g.hbm_bytes - weights) // (16 * m.kv_bytes_per_token / shards))

    mla = DPCost(esft.cost, ep_ranks=4)
    gqa = DPCost(cost_model("qwen3-30b-a3b", "H100", gpus=2), ep_ranks=4)
    assert (mla.kv_shards, gqa.kv_shards) == (1, 2)
    assert mla.kv_capacity_blocks == by_hand(mla, 1)
    assert gqa.kv_capacity_blocks == by_hand(gqa, 2)
    assert mla.kv_capacity_blocks < esft.cost.kv_capacity_blocks, "fewer tokens than a split cache would hold"
    with pytest.raises(ValueError, match="multiple"):
        DPCost(esft.cost, ep_ranks=3)


def test_lock_step_steps_are_shared_and_last_the_slowest_engine(esft: Scenario) -> None:
    fleet = _fleet(esft)
    wl = _workload([8000, 50, 60, 70], [3, 3, 3, 3], np.array([0.0, 0.0, 0.0, 0.0]))
    res = _run(esft, wl, fleet, "rr")
    starts, counts = np.unique(res.step_start, return_counts=True)
    assert (counts <= 2).all() and (counts == 2).any(), "both engines step together while both have work"
    for t in starts[counts == 2]:
        d = res.step_duration[res.step_start == t]
        assert d[0] == d[1], "one duration per lock-step step"


def test_prompt_throughput_gap_and_trace_window(esft: Scenario) -> None:
    requests = load_request_csv(AZURE / "AzureLLMInferenceTrace_code.csv")
    later = trace_window(requests, 100)
    assert later.arrival[0] == 0.0 and later.prompt[0] == requests.prompt[100]
    wl = esft.workload(400, seed=0, requests=requests, time_scale=30.0)
    res = _run(esft, wl, _fleet(esft), "rr")
    gap, cov = prompt_throughput_gap(res, window_s=2.0)
    assert gap > 0 and 0 < cov < 2
    assert summarize_dp(res)["dispatch_run_mean"] == 1.0, "round robin over two engines strictly alternates"
    one = _run(esft, wl, _fleet(esft, engines=1), "rr")
    assert prompt_throughput_gap(one, window_s=2.0) == (0.0, 0.0), "one engine has no cross-engine gap"


def test_sim_dp_cli_writes_every_pair(tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    args = ["sim-dp", "--requests", str(AZURE / "AzureLLMInferenceTrace_code.csv"), "--time-scale", "40"]
    args += ["--dispatch", "vllm,gimbal", "--order", "both", "--num-requests", "150", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert set(payload["runs"]) == {"vllm+fcfs", "vllm+sjf-aging", "gimbal+fcfs", "gimbal+sjf-aging"}
    for s in payload["runs"].values():
        for key in ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99", "throughput"):
            assert s[key] > 0, key
        assert s["prompt_tput_gap"] >= 0
    assert payload["config"]["fleet"] == "DP2 TP2 EP4 lock-step" and payload["config"]["model"] == "deepseek-v2-lite"
    progress = [line for line in result.stderr.splitlines() if line.startswith("[")]  # one line per finished run
    drawn = CliRunner().invoke(app, [*args[:-2], "--out", str(tmp_path / "figures"), "--no-progress"])
    assert drawn.exit_code == 0, drawn.output
    for name in ("latency_cdf.png", "engine_load.png", "summary.json"):  # --out draws the runs, as sim's does
        assert (tmp_path / "figures" / name).stat().st_size > 0, name
    assert [line.split()[0] for line in progress] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"], result.stderr
    bad = CliRunner().invoke(app, ["sim-dp", "--rate", "5", "--order", "lifo"])
    assert bad.exit_code != 0 and "order" in bad.output
