"""The xPyD discrete-event simulator on the real ESFT routing trace: invariants, determinism, locality."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.simulator.core.workload import load_request_csv
from switchyard.simulator.offline.experiments import batch_distinct
from switchyard.simulator.offline.metrics import summarize
from switchyard.simulator.offline.scenario import Scenario, match_model, prepare, split_calibration
from switchyard.simulator.offline.xpyd import FleetConfig
from switchyard.solver.routing import DECODE_POLICIES
from tests.conftest import SHIPPED_DATA
from tests.eldr_helpers import ESFT_DIR

AZURE_CONV = SHIPPED_DATA / "requests" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"


@pytest.fixture(scope="module")
def esft() -> Scenario:
    return prepare(ESFT_DIR, gpu="H100", seed=0)


def test_calibration_and_replay_parts_are_disjoint_and_stratified(esft: Scenario) -> None:
    assert not set(esft.calib.tolist()) & set(esft.replay.tolist())
    assert len(esft.calib) + len(esft.replay) == esft.counts.num_requests
    for g in range(len(esft.bank.label_names)):
        assert (esft.counts.label[esft.calib] == g).any() and (esft.counts.label[esft.replay] == g).any()
    assert esft.bank.request_ids.tolist() == esft.replay.tolist(), "only replay requests are replayed"
    a, _ = split_calibration(esft.counts.label, esft.counts.num_requests, 0.5, seed=1)
    assert not np.array_equal(a, esft.calib), "the split depends on the seed"


def test_physics_must_match_the_trace_shape(esft: Scenario) -> None:
    assert esft.model.name == "deepseek-v2-lite"
    with pytest.raises(ValueError, match="physics would not match"):
        match_model(esft.trace, "qwen3-30b-a3b")


def _small_fleet(esft: Scenario, kv_blocks: int | None = 96) -> FleetConfig:
    return esft.fleet(2, 3, kv_blocks=kv_blocks, max_running=8)


@pytest.mark.parametrize("policy", list(DECODE_POLICIES))
def test_invariants_every_request_once_tokens_conserved(esft: Scenario, policy: str) -> None:
    """check=True asserts after every event: one engine per request, KV within capacity and recounted."""
    fleet = _small_fleet(esft)
    wl = esft.workload(120, seed=3, rate=400.0, max_tokens=fleet.decode_kv_blocks * 16)
    res = esft.run(wl, fleet, policy, seed=3, check=True)
    assert np.array_equal(res.tokens, wl.output), "each request generated exactly its output tokens"
    assert int(res.step_batch.sum()) == int(wl.output.sum()), "Σ batch over steps = Σ output tokens"
    assert np.isfinite(res.finish).all() and np.isfinite(res.first_token).all()
    assert (res.arrival <= res.prefill_done).all() and (res.prefill_done <= res.decode_ready).all()
    assert (res.decode_ready < res.first_token).all() and (res.first_token <= res.finish).all()
    assert ((res.decode_engine >= 0) & (res.decode_engine < 3)).all()
    assert (res.max_kv_blocks_used <= fleet.decode_kv_blocks).all()
    assert res.engine_preemptions.sum() > 0, "the small KV cache must force preemptions"
    assert res.engine_tokens.sum() == wl.output.sum()


def test_azure_arrivals_and_lengths(esft: Scenario) -> None:
    requests = load_request_csv(AZURE_CONV)
    wl = esft.workload(60, seed=0, requests=requests, time_scale=10.0)
    assert np.allclose(wl.arrival, requests.arrival[:60] / 10.0)
    assert np.array_equal(wl.output, np.maximum(requests.output[:60], 1))
    res = esft.run(wl, esft.fleet(2, 2), "jsq", seed=0)
    assert np.array_equal(res.tokens, wl.output)
    poisson = esft.workload(60, seed=0, requests=requests, rate=5.0)  # Poisson arrivals, the CSV's lengths
    assert np.array_equal(poisson.prompt, wl.prompt) and not np.allclose(poisson.arrival, wl.arrival)
    assert 2.0 < poisson.offered_rate < 10.0


def test_same_seed_same_run_other_seed_other_run(esft: Scenario) -> None:
    fleet = esft.fleet(2, 4)
    runs = {}
    for seed in (5, 5, 6):
        wl = esft.workload(80, seed=seed, rate=200.0)
        res = esft.run(wl, fleet, "p2c", seed=seed)
        runs.setdefault(seed, []).append(res)
    a, b = runs[5]
    for field in ("first_token", "finish", "decode_engine", "step_duration"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert summarize(a) == summarize(b)
    assert not np.array_equal(a.finish, runs[6][0].finish)


def test_same_domain_batches_select_fewer_experts_on_esft(esft: Scenario) -> None:
    """The seed's Fig. 4 fact on real routing: co-locating one task's requests loads fewer experts."""
    from switchyard.simulator.core.experts import ReplayBank

    bank = ReplayBank.from_trace(esft.trace)  # all 213 sequences: a trace statistic, not a serving run
    same, mixed, _ = batch_distinct(bank, batch=8, samples=1500, seed=0)
    assert same < mixed


@pytest.mark.parametrize("policy", ["domain", "eldr"])
def test_locality_policies_lower_distinct_experts_per_step(esft: Scenario, policy: str) -> None:
    """Co-locating similar requests makes decode steps load fewer distinct experts per token than round robin."""
    fleet = esft.fleet(2, 8)
    wl = esft.workload(600, seed=1, rate=300.0, requests=load_request_csv(AZURE_CONV))  # lengths independent of domain
    rr = summarize(esft.run(wl, fleet, "rr", seed=1))
    local = summarize(esft.run(wl, fleet, policy, seed=1))
    assert local["token_distinct_experts"] < rr["token_distinct_experts"]


def test_eldr_is_fit_on_calibration_requests_only(esft: Scenario) -> None:
    artifact, sims = esft.eldr_inputs("balanced", 4)
    assert artifact.num_calibration == len(esft.calib)
    assert artifact.centroids.shape[0] == 4 and sims.shape == (len(esft.replay), 4)
    vanilla, _ = esft.eldr_inputs("vanilla", 4)
    assert not np.array_equal(vanilla.centroids, artifact.centroids)
    tables, _ = esft.policy_inputs(DECODE_POLICIES["eldr-tau0"], esft.fleet(1, 4), esft.workload(5, 0, rate=1.0))
    assert tables.tau == 0.0
