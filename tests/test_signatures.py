"""Per-request counts and the block-granular signature cache."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.shared.routing_trace import RoutingTrace, split_phases
from switchyard.solver.signatures import (
    BlockSignatureCache,
    SignatureError,
    block_rows,
    block_sum,
    expert_counts,
    request_counts,
)
from tests.eldr_helpers import random_experts


def test_expert_counts_match_a_hand_count() -> None:
    # 3 tokens, 2 layers, top-2 of 4 experts; tokens 0 and 2 belong to group 0, token 1 to group 1.
    experts = np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[1, 3], [2, 0]]])
    counts = expert_counts(experts, np.array([0, 1, 0]), 2, 4)
    np.testing.assert_array_equal(counts[0], [[1, 2, 0, 1], [1, 0, 2, 1]])
    np.testing.assert_array_equal(counts[1], [[0, 1, 1, 0], [1, 0, 0, 1]])
    gate = expert_counts(experts, np.array([0, 1, 0]), 2, 4, weights=np.full(experts.shape, 0.25))
    np.testing.assert_allclose(gate, counts * 0.25)


def test_request_counts_split_prefill_and_decode() -> None:
    rng = np.random.default_rng(4)
    lengths = np.array([5, 1, 8, 3])
    experts = random_experts(rng, int(lengths.sum()), 3, 10, 3)
    weights = rng.random(experts.shape).astype(np.float32)
    request, label = np.repeat(np.arange(4), lengths), np.repeat([0, 1, 0, 1], lengths)
    trace = split_phases(RoutingTrace(experts, request, 10, weights=weights, label=label), 0.5)
    counts = request_counts(trace)
    everything = expert_counts(experts, trace.request, 4, 10)
    np.testing.assert_array_equal(counts.prefill + counts.decode, everything)
    np.testing.assert_array_equal(counts.prefill_tokens, [2, 1, 4, 1])
    np.testing.assert_array_equal(counts.decode_tokens, [3, 0, 4, 2])
    # Each token adds top_k to every layer's row.
    np.testing.assert_array_equal(counts.prefill.sum(axis=2), np.repeat(counts.prefill_tokens[:, None] * 3, 3, axis=1))
    first = trace.phase == 0
    by_hand = np.zeros((4, 3, 10))
    cells = (trace.request[first][:, None, None], np.arange(3)[None, :, None], experts[first])
    np.add.at(by_hand, cells, weights[first])
    np.testing.assert_allclose(counts.prefill_gate, by_hand, rtol=1e-6)
    np.testing.assert_array_equal(counts.label, [0, 1, 0, 1])
    sub = counts.subset(np.array([2, 0]))
    np.testing.assert_array_equal(sub.decode, counts.decode[[2, 0]])
    with pytest.raises(SignatureError, match="no phase"):
        request_counts(RoutingTrace(experts, trace.request, 10))


def test_block_rows_are_uint8_per_block_with_a_partial_tail() -> None:
    rng = np.random.default_rng(5)
    experts = random_experts(rng, 37, 4, 16, 2)
    rows = block_rows(experts, 16, block_size=16)
    assert rows.dtype == np.uint8 and rows.shape == (3, 4, 16)
    np.testing.assert_array_equal(rows[2], expert_counts(experts[32:], np.zeros(5, int), 1, 16)[0])
    full = block_rows(np.zeros((255, 1, 1), int), 1, block_size=255)
    assert full[0, 0, 0] == 255  # the largest block still fits
    with pytest.raises(SignatureError, match="block size"):
        block_rows(experts, 16, block_size=256)


def test_block_sums_are_exact_when_requests_share_prefix_blocks() -> None:
    """Requests fork from earlier ones at block boundaries and reuse their blocks (prefix-cache hits)."""
    rng = np.random.default_rng(6)
    layers, num_experts, k, block = 5, 12, 3, 4
    cache = BlockSignatureCache(num_blocks=400, num_layers=layers, num_experts=num_experts, block_size=block)
    free = iter(range(400))
    requests: list[tuple[np.ndarray, list[int]]] = []  # (tokens, block table)
    for _ in range(30):
        if requests and rng.random() < 0.7:
            parent_tokens, parent_table = requests[rng.integers(len(requests))]
            full_blocks = len(parent_tokens) // block
            shared = int(rng.integers(0, full_blocks + 1))
            prefix, table = parent_tokens[: shared * block], list(parent_table[:shared])
        else:
            prefix, table = np.empty((0, layers, k), dtype=np.int16), []
        tail = random_experts(rng, int(rng.integers(1, 15)), layers, num_experts, k)
        new_ids = [next(free) for _ in range(-(-len(tail) // block))]
        cache.write(np.array(new_ids), tail)  # only the request's own blocks are computed
        requests.append((np.concatenate([prefix, tail]), table + new_ids))
    assert any(len(t) > 0 for t, _ in requests)
    for tokens, table in requests:
        direct = expert_counts(tokens, np.zeros(len(tokens), int), 1, num_experts)[0]
        np.testing.assert_array_equal(cache.signature(np.array(table)), direct)


def test_block_cache_rejects_bad_block_ids_and_shapes() -> None:
    cache = BlockSignatureCache(num_blocks=4, num_layers=2, num_experts=4, block_size=2)
    tokens = np.zeros((3, 2, 1), dtype=int)
    with pytest.raises(SignatureError, match="block ids"):
        cache.write(np.array([0]), tokens)  # 3 tokens need two blocks
    with pytest.raises(SignatureError, match=r"lie in \[0, 4\)"):
        cache.write(np.array([3, 4]), tokens)
    with pytest.raises(SignatureError, match="layers"):
        cache.write(np.array([0, 1]), np.zeros((3, 3, 1), dtype=int))
    with pytest.raises(SignatureError, match=r"lie in \[0, 4\)"):
        block_sum(cache.table, np.array([5]))
