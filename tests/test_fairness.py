"""The fairness policies alone (`solver/fairness.py`: footprints, costs, the queue's correction) and the
simulator's two-tenant scenario (`simulator/offline/fairness.py`) on which docs/gateway.md's figure is measured;
the policies in the gateway on real processes: tests/test_gateway_fairness.py."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.simulator.offline.fairness import FairnessConfig, simulate_fairness, two_tenant_bank
from switchyard.solver.fairness import FairQueue, Footprints, Waiter, footprint, request_cost, weighted_tokens

NARROW = np.array([[3, 0, 0, 0], [0, 3, 0, 0]], dtype=np.uint16)
WIDE = np.ones((2, 4), dtype=np.uint16)


def test_footprint_is_the_share_of_experts_touched() -> None:
    assert footprint(NARROW) == 0.25
    assert footprint(WIDE) == 1.0
    assert footprint(np.zeros((2, 4))) == 1.0  # nothing known: every expert
    assert footprint(np.array([[1, 1, 0, 0], [1, 0, 0, 0]])) == pytest.approx(3 / 8)


def test_without_a_footprint_expert_load_is_tokens() -> None:
    weighted = weighted_tokens(100, 50, 2.0)
    assert weighted == 200.0
    assert request_cost("expert-load", weighted, None) == request_cost("tokens", weighted, 0.25) == 200.0
    assert request_cost("expert-load", weighted, 0.25) == 50.0


def test_footprints_estimate_the_tenant_then_the_fleet_and_stay_bounded() -> None:
    prints = Footprints(max_tenants=2, alpha=0.5)
    assert prints.estimate("a") is None
    prints.observe("a", 0.25)
    assert prints.estimate("a") == 0.25
    assert prints.estimate("new") == 0.25  # the fleet's mean for a tenant never seen
    prints.observe("a", 0.75)
    assert prints.estimate("a") == 0.5
    for tenant in ("b", "c", "d"):
        prints.observe(tenant, 1.0)
    assert len(prints.tenants) == 2 and "a" not in prints.tenants


def test_a_correction_moves_the_tenant_in_the_order() -> None:
    """Charged an estimate (1) that its signature then cuts to 1/4, a tenant is served again before the other."""
    queue = FairQueue(16, 16, 16)
    for tenant in ("a", "b", "a", "b"):
        queue.push(Waiter(1, tenant, 10.0, 0.0))
    first = queue.pop()
    assert first is not None and first.tenant == "a"
    assert queue.pop().tenant == "b"  # type: ignore[union-attr]
    queue.charge("a", 10.0 * (0.25 - 1.0))  # a's request touched a quarter of the experts
    assert queue.attained == {"a": 2.5, "b": 10.0}
    assert queue.pop().tenant == "a"  # type: ignore[union-attr]
    queue.charge("gone", 5.0)
    assert "gone" not in queue.attained


def test_the_scenarios_tenants_differ_in_footprint_only() -> None:
    config = FairnessConfig(bank_rows=8)
    bank, tenant, shares = two_tenant_bank(config)
    assert (tenant == np.repeat([0, 1], 8)).all()
    assert np.allclose(shares[:8], 16 / 64)  # narrow: its 16 experts per layer, each touched by 64 prompt tokens
    assert (shares[8:] > 0.95).all()  # wide: nearly all 64
    assert (bank.prefill_len == bank.prefill_len[0]).all() and (bank.decode_len == bank.decode_len[0]).all()


def _ttft_ratio(policy: str, shuffled: bool = False) -> tuple[float, float]:
    """(narrow TTFT P50 / wide TTFT P50, fleet throughput) on a small overloaded run."""
    config = FairnessConfig(policy=policy, shuffle_labels=shuffled, requests=150, rate=60.0, bank_rows=16)
    result = simulate_fairness(config)
    assert result.tenants["narrow"]["requests"] == result.tenants["wide"]["requests"] == 150  # nothing lost
    return result.tenants["narrow"]["ttft_p50_s"] / result.tenants["wide"]["ttft_p50_s"], result.throughput_tok_s


def test_expert_load_fairness_favours_the_narrow_tenant_and_the_shuffled_control_erases_it() -> None:
    fcfs, _ = _ttft_ratio("fcfs")
    tokens, _ = _ttft_ratio("tokens")
    expert, _ = _ttft_ratio("expert-load")
    control, _ = _ttft_ratio("expert-load", shuffled=True)
    assert 0.5 < fcfs < 2 and 0.5 < tokens < 2  # equal tokens: neither tenant is favoured
    assert expert < 0.5  # a narrow request is charged a quarter: the narrow tenant waits far less
    assert 0.5 < control < 2  # labels shuffled: each "tenant" mixes footprints, nothing to tell apart


def test_the_simulation_is_a_function_of_its_seed() -> None:
    config = FairnessConfig(requests=40, rate=60.0, bank_rows=8, seed=3)
    assert simulate_fairness(config).row() == simulate_fairness(config).row()
    other = simulate_fairness(FairnessConfig(requests=40, rate=60.0, bank_rows=8, seed=4)).row()
    assert other != simulate_fairness(config).row()
    with pytest.raises(ValueError, match="unknown policy"):
        simulate_fairness(FairnessConfig(policy="lottery"))
