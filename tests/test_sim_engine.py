"""Expert bitsets, the replay bank and the continuous-batching engines, against brute-force recounts."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.shared.routing_trace import RoutingTrace, split_phases
from switchyard.simulator.core.experts import (
    ReplayBank,
    distinct_per_layer,
    distinct_per_rank,
    expert_bitsets,
    rank_masks,
    token_counts,
)
from switchyard.simulator.core.physics import cost_model
from switchyard.simulator.core.xpyd_engines import DecodeEngine, PrefillEngine
from tests.eldr_helpers import random_experts


def _brute_distinct(experts: np.ndarray) -> np.ndarray:
    """[B, L, k] ids -> [L] distinct count, with Python sets."""
    return np.array([len(set(experts[:, layer].ravel().tolist())) for layer in range(experts.shape[1])])


@pytest.mark.parametrize("num_experts", [8, 64, 128, 160, 256])
def test_bitset_distinct_counts_match_sets(num_experts: int) -> None:
    rng = np.random.default_rng(num_experts)
    for batch in (1, 3, 40):
        ids = random_experts(rng, batch, 5, num_experts, min(6, num_experts))
        bits = expert_bitsets(ids, num_experts)
        assert bits.shape == (batch, 5, -(-num_experts // 64))
        assert np.array_equal(distinct_per_layer(bits), _brute_distinct(ids))


def test_token_counts_per_expert() -> None:
    rng = np.random.default_rng(9)
    ids = random_experts(rng, 25, 3, 130, 4)
    counts = token_counts(expert_bitsets(ids, 130), 130)
    expected = np.zeros((3, 130), dtype=np.int64)
    for layer in range(3):
        np.add.at(expected[layer], ids[:, layer].ravel(), 1)
    assert np.array_equal(counts, expected)


def test_bitsets_reject_out_of_range_and_ignore_padding() -> None:
    with pytest.raises(ValueError):
        expert_bitsets(np.array([[64]]), 64)
    padded = expert_bitsets(np.array([[3, -1, 5]]), 64)
    assert int(np.bitwise_count(padded).sum()) == 2


def test_rank_masks_partition_the_experts() -> None:
    rng = np.random.default_rng(2)
    ids = random_experts(rng, 30, 4, 128, 8)
    bits = expert_bitsets(ids, 128)
    masks = rank_masks(4, 128, ranks=4)
    per_rank = distinct_per_rank(bits, masks)
    assert np.array_equal(per_rank.sum(axis=0), distinct_per_layer(bits))
    placement = rng.integers(0, 4, (4, 128))
    per_rank = distinct_per_rank(bits, rank_masks(4, 128, 4, placement))
    for g in range(4):
        expected = [len({e for e in ids[:, layer].ravel() if placement[layer, e] == g}) for layer in range(4)]
        assert per_rank[g].tolist() == expected


def _trace(
    rng: np.random.Generator, lengths: list[int], layers: int = 3, experts: int = 16, k: int = 2
) -> RoutingTrace:
    req = np.repeat(np.arange(len(lengths)), lengths)
    ids = random_experts(rng, len(req), layers, experts, k)
    labels = np.repeat(np.arange(len(lengths)) % 2, lengths)
    trace = RoutingTrace.from_arrays(ids, req, experts, label=labels, label_names=["a", "b"])
    return split_phases(trace, 0.5)


def test_replay_bank_rows_are_the_requests_own_tokens() -> None:
    rng = np.random.default_rng(3)
    trace = _trace(rng, [5, 8, 2, 11])
    keep = np.array([3, 1])
    bank = ReplayBank.from_trace(trace, keep)
    starts, lengths = trace.request_starts(), trace.request_lengths()
    for row, r in enumerate(keep):
        tokens = slice(starts[r], starts[r] + lengths[r])
        phase = trace.phase[tokens]
        pre, dec = trace.experts[tokens][phase == 0], trace.experts[tokens][phase == 1]
        got = bank.decode_bits[bank.decode_start[row] : bank.decode_start[row] + bank.decode_len[row]]
        assert np.array_equal(got, expert_bitsets(dec, 16))
        assert np.array_equal(distinct_per_layer(bank.prefill_bits[row][None]), _brute_distinct(pre))
        assert bank.prefill_len[row] == len(pre)
        assert bank.label_names[bank.labels[row]] == "ab"[r % 2]


def _bank(seed: int = 0, requests: int = 12) -> tuple[ReplayBank, RoutingTrace]:
    rng = np.random.default_rng(seed)
    trace = _trace(rng, rng.integers(4, 30, requests).tolist(), layers=26, experts=64, k=6)
    return ReplayBank.from_trace(trace), trace


def _drive(engine: DecodeEngine, max_steps: int = 100_000) -> tuple[dict[int, int], dict[int, int]]:
    """Step until idle, checking invariants after each phase.

    Returns (tokens per request counted from the batches, tokens per request the engine reported at finish).
    """
    counted: dict[int, int] = {}
    reported: dict[int, int] = {}
    firsts: set[int] = set()
    for _ in range(max_steps):
        plan = engine.begin_step()
        if plan is None:
            return counted, reported
        batch = engine.running_ids().tolist()
        assert plan.batch == len(batch) == len(set(batch)) <= engine.max_running
        assert not set(batch) & set(engine.waiting_ids()), "a request is both running and waiting"
        assert engine.used_blocks == engine.blocks_held() <= engine.kv_blocks
        out = engine.end_step()
        for rid in batch:
            counted[rid] = counted.get(rid, 0) + 1
        assert not firsts & set(out.first), "a first token twice"
        firsts.update(out.first)
        assert engine.used_blocks == engine.blocks_held() <= engine.kv_blocks
        for rid, n in zip(out.finished, out.finished_tokens, strict=True):
            assert rid not in reported, "a request finished twice"
            reported[rid] = n
    raise AssertionError("engine never drained")


def test_decode_engine_conserves_tokens_under_preemption() -> None:
    bank, _ = _bank()
    cost = cost_model("deepseek-v2-lite", "H100")
    engine = DecodeEngine(cost, bank, max_running=6, kv_blocks=12)  # 192 KV tokens: forces preemption
    rng = np.random.default_rng(5)
    want = {}
    for rid in range(30):
        prompt, output = int(rng.integers(1, 60)), int(rng.integers(1, 80))
        engine.add(rid, int(rng.integers(bank.num_requests)), prompt, output)
        want[rid] = output
    counted, reported = _drive(engine)
    assert engine.preemptions > 0, "the test must exercise preemption"
    assert counted == want and reported == want
    assert engine.tokens_out == sum(want.values())
    assert engine.used_blocks == 0 and not engine.has_work()


def test_decode_engine_refuses_a_request_larger_than_its_cache() -> None:
    bank, _ = _bank()
    engine = DecodeEngine(cost_model("deepseek-v2-lite", "H100"), bank, kv_blocks=4)
    with pytest.raises(ValueError, match="KV tokens"):
        engine.add(0, 0, prompt_tokens=60, output_tokens=10)


def test_decode_step_cost_follows_the_batch_s_replayed_tokens() -> None:
    """Step i of a request replays its decode token i mod len; the cost uses the batch's distinct experts."""
    bank, _ = _bank(seed=1)
    cost = cost_model("deepseek-v2-lite", "H100")
    engine = DecodeEngine(cost, bank, max_running=8)
    rows = [0, 3, 7]
    for rid, r in enumerate(rows):
        engine.add(rid, r, prompt_tokens=10, output_tokens=3 * int(bank.decode_len.max()))
    for step in range(2 * int(bank.decode_len.max())):
        plan = engine.begin_step()
        token_rows = [bank.decode_start[r] + step % bank.decode_len[r] for r in rows]
        expected = distinct_per_layer(bank.decode_bits[token_rows])
        assert np.array_equal(plan.distinct, expected)
        assert sorted(plan.rows.tolist()) == sorted(int(r) for r in token_rows)
        ctx = np.full(3, 10 + step)
        assert plan.duration == pytest.approx(cost.decode_time(expected, 3, ctx))
        engine.end_step()


def test_admission_is_fcfs_and_bounded_by_max_running() -> None:
    bank, _ = _bank()
    engine = DecodeEngine(cost_model("deepseek-v2-lite", "H100"), bank, max_running=2)
    for rid in range(5):
        engine.add(rid, 0, 5, 3)
    plan = engine.begin_step()
    assert plan.admitted == [0, 1] and engine.num_waiting == 3
    out = engine.end_step()
    assert sorted(out.first) == [0, 1]
    with pytest.raises(RuntimeError):
        engine.end_step()
    engine.begin_step()
    with pytest.raises(RuntimeError):
        engine.begin_step()


def test_prefill_engine_chunks_fcfs_within_the_token_budget() -> None:
    bank, _ = _bank()
    engine = PrefillEngine(cost_model("deepseek-v2-lite", "H100"), bank, token_budget=100)
    prompts = {0: 250, 1: 30, 2: 90, 3: 1}
    for rid, n in prompts.items():
        engine.add(rid, rid, n)
    done, processed = [], 0
    while (plan := engine.begin_step()) is not None:
        assert 0 < plan.tokens <= 100
        processed += plan.tokens
        done.extend(engine.end_step().tolist())
    assert done == [0, 1, 2, 3]
    assert processed == sum(prompts.values())


def test_expert_parallel_step_waits_for_the_busiest_rank() -> None:
    bank, _ = _bank(seed=2)
    cost = cost_model("deepseek-v2-lite", "H100", gpus=4)
    masks = rank_masks(bank.num_layers, bank.num_experts, 4)
    engine = DecodeEngine(cost, bank, rank_masks=masks)
    for rid in range(5):
        engine.add(rid, rid, prompt_tokens=8, output_tokens=4)
    plan = engine.begin_step()
    rows = bank.decode_start[:5]
    bits = bank.decode_bits[rows]
    per_rank = np.stack([np.bitwise_count(np.bitwise_or.reduce(bits, axis=0) & m).sum(axis=-1) for m in masks])
    assert np.array_equal(plan.distinct, per_rank.max(axis=0))
    assert (plan.distinct <= distinct_per_layer(bits)).all()
