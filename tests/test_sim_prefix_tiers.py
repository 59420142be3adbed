"""The simulator's CPU prefix tier (issue 42 item 4): blocks the GPU cache evicts go to a bounded CPU tier, and a
prompt that finds its prefix there loads it back (priced over PCIe) instead of recomputing it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from switchyard.simulator.core.prefix_cache import PrefixCache
from switchyard.simulator.core.workload import Workload
from switchyard.simulator.offline.dp import DPFleetConfig, simulate_dp
from switchyard.simulator.offline.scenario import Scenario, prepare
from tests.eldr_helpers import ESFT_DIR


def test_evicted_keys_go_to_a_bounded_cpu_tier() -> None:
    c = PrefixCache(capacity=6, span=2, cpu_keys=2)
    c.allocate(6)
    for key in (1, 2, 3):
        assert c.register(key)
    c.release(private=0, keys=[1, 2, 3])  # freed deepest first: 3, 2, 1 from the head
    c.allocate(4)  # evicts 3 then 2 into the CPU tier
    assert c.lookup([1, 2, 3], 3) == (1, 1) and not c.cached(2)
    assert c.cpu_held == 2 and c.lookup_cpu([1, 2, 3], 1, 3) == 2, "past the GPU hit, the CPU tier's run"
    assert c.credit([1, 2, 3], 3, 0.75) == pytest.approx(1 + 2 * 0.75)
    c.allocate(2)  # evicts 1: the CPU tier is full, its oldest (3) is dropped
    assert c.cpu_held == 2 and c.cpu_dropped == 1
    assert c.lookup_cpu([1, 2, 3], 0, 3) == 2, "1 and 2 in a row; 3 was dropped"
    assert c.credit([1, 2, 3], 3, 0.75) == pytest.approx(2 * 0.75)
    assert c.credit([1, 2, 3], 3, 0.0) == 0.0, "weight 0: the GPU hit alone"
    c.loaded([1])
    assert c.cpu_held == 2
    with pytest.raises(ValueError):
        PrefixCache(capacity=6, span=2, cpu_keys=-1)


def test_no_tier_keeps_nothing() -> None:
    c = PrefixCache(capacity=4, span=2)
    c.allocate(2)
    c.register(7)
    c.release(private=0, keys=[7])
    c.allocate(4)
    assert c.evicted == 1 and c.cpu_held == 0 and c.lookup_cpu([7], 0, 1) == 0


@pytest.fixture(scope="module")
def esft() -> Scenario:
    return prepare(ESFT_DIR, gpu="H100", gpus=2, seed=0)


def _evicting_workload() -> Workload:
    """A 4,096-token prefix, a 6,000-token stranger that evicts it from a 400-block GPU cache, the prefix again."""
    ids = (np.r_[np.arange(8), 100], np.arange(1000, 1012), np.r_[np.arange(8), 200])
    return Workload(
        arrival=np.arange(3) * 5.0,
        prompt=np.array([4096 + 100, 6000, 4096 + 100]),
        output=np.array([4, 4, 4]),
        replay=np.arange(3),
        description="a prefix evicted, then asked again",
        hash_ids=ids,
        hash_block=512,
    )


def test_a_cpu_hit_is_loaded_not_recomputed(esft: Scenario) -> None:
    wl = _evicting_workload()
    fleet = DPFleetConfig(cost=esft.cost, engines=1, kv_blocks=400, token_budget=8192)
    off = simulate_dp(wl, esft.bank, fleet, "vllm", check=True)
    on = simulate_dp(wl, esft.bank, dataclasses.replace(fleet, prefix_cpu_tokens=1 << 20), "vllm", check=True)
    assert off.prefix_hit.tolist() == [0, 0, 0], "evicted without a tier: recomputed"
    assert on.prefix_hit.tolist() == [0, 0, 4096], "loaded back from the CPU tier"
    assert int(on.engine_prompt_tokens.sum()) == int(off.engine_prompt_tokens.sum()) - 4096
    ttft_on, ttft_off = on.first_token - on.arrival, off.first_token - off.arrival
    assert ttft_on[:2] == pytest.approx(ttft_off[:2])
    assert ttft_on[2] < ttft_off[2], "a copy over PCIe is cheaper than the prefill"
    gpu_hit = simulate_dp(wl, esft.bank, dataclasses.replace(fleet, kv_blocks=4000), "vllm", check=True)
    assert gpu_hit.prefix_hit.tolist() == [0, 0, 4096]
    assert ttft_on[2] > (gpu_hit.first_token - gpu_hit.arrival)[2], "and dearer than a GPU hit: the copy is priced"
