"""The simulator's vLLM-style prefix cache: LRU eviction order, hits that skip prefill, no change without hashes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from switchyard.simulator.core.prefix_cache import PrefixCache, prefix_keys
from switchyard.simulator.core.workload import Workload, load_requests
from switchyard.simulator.offline.dp import DPFleetConfig, simulate_dp
from switchyard.simulator.offline.dp_run import summarize_dp
from switchyard.simulator.offline.metrics import summarize
from switchyard.simulator.offline.scenario import Scenario, prepare
from tests.conftest import SHIPPED_DATA
from tests.eldr_helpers import ESFT_DIR

MOONCAKE = SHIPPED_DATA / "requests" / "mooncake_fast25" / "synthetic_trace.jsonl"
AZURE_CONV = SHIPPED_DATA / "requests" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"


def test_keys_chain_prefixes_and_cover_full_blocks_only() -> None:
    a = prefix_keys([7, 8, 9], prompt_tokens=3 * 512, trace_block=512)
    assert len(a) == 3
    assert prefix_keys([7, 8, 9], prompt_tokens=3 * 512 - 1, trace_block=512) == a[:2], "a partial block has no key"
    assert prefix_keys([1, 8], 1024, 512)[1] != a[1], "the same id after another prefix is another block"
    assert prefix_keys([7, 8], 1024, 512) == a[:2]


def test_lru_order_hand_worked() -> None:
    """8 blocks, 2 per key. A holds keys a1, a2 and 1 private block, then leaves; B allocates."""
    c = PrefixCache(capacity=8, span=2)
    a1, a2 = 101, 102
    c.allocate(5)  # A: 2 keys' blocks + 1 private (its partial tail block)
    assert c.register(a1) and c.register(a2)
    assert c.free_blocks == 3
    assert c.release(private=1, keys=[a1, a2]) == 5
    # the never-used 3 blocks first, then A's blocks in reverse: its private tail, a2, then the root a1
    assert c.free_order() == [(3, None), (1, None), (2, a2), (2, a1)]
    c.allocate(4)  # the anonymous blocks go first: nothing evicted
    assert c.evicted == 0 and c.cached(a1) and c.cached(a2)
    c.allocate(1)  # reaches a2 (the prompt's tail is evicted before its root); its other block stays free
    assert c.evicted == 1 and not c.cached(a2) and c.cached(a1)
    assert c.free_order() == [(1, None), (2, a1)]
    assert c.lookup([a1, a2], limit=2) == (1, 1), "a1 cached and free, a2 gone"
    c.acquire([a1])  # a hit on a free block takes it off the queue
    assert c.free_order() == [(1, None)] and c.free_blocks == 1
    c.acquire([a1])  # a second holder only adds a reference
    assert c.release(0, [a1]) == 0 and c.release(0, [a1]) == 2
    assert c.free_order() == [(1, None), (2, a1)]


def test_recently_freed_survives_longer() -> None:
    c = PrefixCache(capacity=4, span=2)
    c.allocate(4)
    c.register(1)
    c.register(2)
    c.release(0, [1])  # key 1 freed first: least recently used
    c.release(0, [2])
    c.allocate(2)
    assert not c.cached(1) and c.cached(2)


def test_allocating_more_than_free_is_refused() -> None:
    c = PrefixCache(capacity=4, span=2)
    with pytest.raises(ValueError):
        c.allocate(5)


@pytest.fixture(scope="module")
def esft() -> Scenario:
    return prepare(ESFT_DIR, gpu="H100", gpus=2, seed=0)


def _shared_prefix_workload(gap_s: float) -> Workload:
    """Three requests with the same 8-block (4,096-token) prefix, far enough apart to run alone."""
    prompt = np.array([4096 + 100, 4096 + 300, 4096 + 50])
    ids = tuple(np.r_[np.arange(8), 100 + i] for i in range(3))
    return Workload(
        arrival=np.arange(3) * gap_s,
        prompt=prompt,
        output=np.array([4, 4, 4]),
        replay=np.arange(3),
        description="shared prefix",
        hash_ids=ids,
        hash_block=512,
    )


def test_repeated_prefix_skips_prefill(esft: Scenario) -> None:
    wl = _shared_prefix_workload(gap_s=5.0)
    fleet = DPFleetConfig(cost=esft.cost, engines=1)
    on = simulate_dp(wl, esft.bank, fleet, "vllm", check=True)
    off = simulate_dp(wl, esft.bank, dataclasses.replace(fleet, prefix_caching=False), "vllm", check=True)
    assert on.prefix_hit.tolist() == [0, 4096, 4096]
    assert int(on.engine_prompt_tokens.sum()) == int(wl.prompt.sum()) - 2 * 4096, "hit tokens are not computed"
    assert int(off.engine_prompt_tokens.sum()) == int(wl.prompt.sum())
    ttft_on, ttft_off = on.first_token - on.arrival, off.first_token - off.arrival
    assert ttft_on[0] == pytest.approx(ttft_off[0])
    assert (ttft_on[1:] < 0.5 * ttft_off[1:]).all(), "the cached prefix's prefill is skipped"
    summary = summarize_dp(on)
    assert summary["prefix_hit_rate"] == pytest.approx(2 * 4096 / wl.prompt.sum())
    assert summary["per_engine"]["prefix_hit_rate"] == [round(2 * 4096 / wl.prompt.sum(), 4)]  # type: ignore[index]
    assert summarize_dp(off)["prefix_hit_rate"] == 0.0


def test_whole_prompt_cached_still_computes_its_last_token(esft: Scenario) -> None:
    wl = _shared_prefix_workload(gap_s=5.0)
    wl = dataclasses.replace(wl, prompt=np.array([4096, 4096, 4096]), hash_ids=(np.arange(8),) * 3)
    res = simulate_dp(wl, esft.bank, DPFleetConfig(cost=esft.cost, engines=1), "vllm", check=True)
    assert res.prefix_hit.tolist() == [0, 3584, 3584], "vLLM recomputes the last token: the last block is not hit"


def test_eviction_under_kv_pressure_keeps_accounting(esft: Scenario) -> None:
    """A small KV cache on the Mooncake excerpt: hits, evictions and preemptions, invariants after every event."""
    trace = load_requests(MOONCAKE)
    fleet = DPFleetConfig(cost=esft.cost, engines=2, kv_blocks=6000, max_running=16, token_budget=2048)
    wl = esft.workload(120, seed=1, requests=trace, time_scale=4.0, max_tokens=6000 * 16)
    res = simulate_dp(wl, esft.bank, fleet, "vllm", check=True)
    assert np.array_equal(res.tokens, wl.output)
    assert res.prefix_hit_rate > 0
    assert res.engine_prefix_evictions.sum() > 0 and res.engine_preemptions.sum() > 0
    assert (res.prefix_hit % 512 == 0).all() and (res.prefix_hit < wl.prompt).all()


def test_no_hash_ids_changes_nothing(esft: Scenario) -> None:
    fleet = DPFleetConfig(cost=esft.cost, engines=2, kv_blocks=400, max_running=12, token_budget=512)
    wl = esft.workload(80, seed=2, requests=load_requests(AZURE_CONV), time_scale=100.0, max_tokens=400 * 16)
    assert wl.hash_ids is None
    on = summarize_dp(simulate_dp(wl, esft.bank, fleet, "gimbal", check=True))
    off = summarize_dp(simulate_dp(wl, esft.bank, dataclasses.replace(fleet, prefix_caching=False), "gimbal"))
    assert on == off
    assert on["prefix_hit_rate"] == 0.0


def test_xpyd_prefill_engines_cache_prefixes(esft: Scenario) -> None:
    """`switchyard sim`: a repeated prefix skips its prefill on the prefill engine, and TTFT drops."""
    wl = _shared_prefix_workload(gap_s=5.0)
    fleet = esft.fleet(1, 1)
    on = esft.run(wl, fleet, "rr", seed=0, check=True)
    off = esft.run(wl, dataclasses.replace(fleet, prefix_caching=False), "rr", seed=0, check=True)
    assert on.prefix_hit.tolist() == [0, 4096, 4096]
    assert on.prefix_hit_rate == pytest.approx(2 * 4096 / wl.prompt.sum()) and off.prefix_hit_rate == 0.0
    ttft_on, ttft_off = on.first_token - on.arrival, off.first_token - off.arrival
    assert ttft_on[0] == pytest.approx(ttft_off[0])
    assert (ttft_on[1:] < ttft_off[1:]).all()
    assert summarize(on)["prefill_prefix_hit_rate"] == [round(2 * 4096 / wl.prompt.sum(), 4)]
