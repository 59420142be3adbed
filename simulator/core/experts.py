"""Expert selections as bitsets, so a batch's distinct experts per layer is an OR-reduce and a popcount.

A token's top-k selections at one layer become a row of `W = ceil(E / 64)` uint64 words (E ≤ 256: at most
four words). The distinct experts a batch loads at each layer is then
``popcount(OR over the batch's rows)``: a handful of numpy calls whatever the batch size, no loop over
tokens or experts. With expert parallelism, ANDing the union with each rank's mask gives the per-rank
counts.

`ReplayBank` holds, for every request of a routing trace that the simulator may replay, the bitsets of its
decode tokens (concatenated, replayed in order and cycled when the simulated output is longer) and the
union of its prefill tokens (what its prefill step loads).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.routing_trace import PHASE_DECODE, RoutingTrace

__all__ = [
    "ReplayBank",
    "distinct_per_layer",
    "distinct_per_rank",
    "expert_bitsets",
    "num_words",
    "rank_masks",
    "token_counts",
]


def num_words(num_experts: int) -> int:
    return max(1, -(-num_experts // 64))


def expert_bitsets(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """`[..., k]` expert ids → `[..., W]` uint64 bitsets (ids < 0 are ignored, e.g. padding)."""
    ids = np.asarray(experts)
    if ids.size and int(ids.max()) >= num_experts:
        raise ValueError(f"expert id {int(ids.max())} out of range for {num_experts} experts")
    ids = ids.astype(np.int64)
    valid = ids >= 0
    safe = np.where(valid, ids, 0)
    bit = np.left_shift(np.uint64(1), (safe & 63).astype(np.uint64))
    bit = np.where(valid, bit, np.uint64(0))
    word = safe >> 6
    out = np.zeros((*ids.shape[:-1], num_words(num_experts)), dtype=np.uint64)
    for w in range(out.shape[-1]):
        # OR over the k selections of one token; a token never selects an expert twice, so OR == sum.
        out[..., w] = np.bitwise_or.reduce(np.where(word == w, bit, np.uint64(0)), axis=-1)
    return out


def distinct_per_layer(bits: np.ndarray) -> np.ndarray:
    """`[B, L, W]` token bitsets → `[L]` number of distinct experts the B tokens select at each layer."""
    if bits.shape[0] == 0:
        return np.zeros(bits.shape[1], dtype=np.int64)
    union = np.bitwise_or.reduce(bits, axis=0)
    return np.bitwise_count(union).sum(axis=-1, dtype=np.int64)


def token_counts(bits: np.ndarray, num_experts: int) -> np.ndarray:
    """`[B, L, W]` token bitsets → `[L, E]` tokens per expert (a live engine's `ExpertLoad` window rows)."""
    as_bytes = np.ascontiguousarray(bits).astype("<u8", copy=False).view(np.uint8)
    onehot = np.unpackbits(as_bytes, axis=-1, bitorder="little")  # [B, L, W*64]
    return onehot.sum(axis=0, dtype=np.int64)[:, :num_experts]


def rank_masks(num_layers: int, num_experts: int, ranks: int, placement: np.ndarray | None = None) -> np.ndarray:
    """`[G, L, W]` masks of the experts each expert-parallel rank holds.

    `placement` is `[L, E]` rank per expert; default: expert e on rank ``e * G // E`` (contiguous blocks,
    vLLM's default expert-parallel layout without EPLB).
    """
    if placement is None:
        placement = np.broadcast_to((np.arange(num_experts) * ranks) // num_experts, (num_layers, num_experts))
    placement = np.asarray(placement)
    ids = np.broadcast_to(np.arange(num_experts), (num_layers, num_experts))
    masks = np.zeros((ranks, num_layers, num_words(num_experts)), dtype=np.uint64)
    for g in range(ranks):
        masks[g] = expert_bitsets(np.where(placement == g, ids, -1), num_experts)
    return masks


def distinct_per_rank(bits: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """`[B, L, W]` token bitsets and `[G, L, W]` rank masks → `[G, L]` distinct experts per rank and layer."""
    union = np.bitwise_or.reduce(bits, axis=0) if bits.shape[0] else np.zeros(bits.shape[1:], np.uint64)
    return np.bitwise_count(union[None] & masks).sum(axis=-1, dtype=np.int64)


@dataclass(frozen=True)
class ReplayBank:
    """Expert bitsets of the requests a simulation replays (R requests, T decode tokens in all).

    - `decode_bits[T, L, W]`: request r's decode tokens are rows ``decode_start[r] : decode_start[r] +
      decode_len[r]``; decode step i of a simulated request uses row ``decode_start[r] + i % decode_len[r]``.
    - `prefill_bits[R, L, W]`: union of request r's prefill tokens.
    - `labels[R]`: index into `label_names` (−1 unknown), for the oracle Domain policy and Fig. 4.
    """

    decode_bits: np.ndarray
    decode_start: np.ndarray
    decode_len: np.ndarray
    prefill_bits: np.ndarray
    prefill_len: np.ndarray
    labels: np.ndarray
    label_names: tuple[str, ...]
    num_experts: int
    request_ids: np.ndarray  # the trace's request id of each row (for provenance)

    @property
    def num_requests(self) -> int:
        return int(self.decode_len.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.decode_bits.shape[1])

    @classmethod
    def from_trace(cls, trace: RoutingTrace, requests: np.ndarray | None = None) -> ReplayBank:
        """Bank rows for `requests` (trace request indices; default all) of a phase-split routing trace.

        Each request needs at least one decode token; its prefill tokens give `prefill_bits`.
        """
        if trace.phase is None:
            raise ValueError("the trace has no phase: split it first (shared.routing_trace.split_phases)")
        ids = np.arange(trace.num_requests) if requests is None else np.asarray(requests, dtype=np.int64)
        starts, lengths = trace.request_starts(), trace.request_lengths()
        decode_counts = np.bincount(trace.request, weights=trace.phase == PHASE_DECODE, minlength=len(lengths))
        decode_counts = decode_counts.astype(np.int64)
        if (decode_counts[ids] == 0).any():
            bad = ids[decode_counts[ids] == 0][:5].tolist()
            raise ValueError(f"trace requests {bad} have no decode tokens to replay")
        prefill_counts = lengths - decode_counts
        bits = expert_bitsets(trace.experts, trace.num_experts)
        # rows of each kept request's decode tokens (prefill tokens precede decode tokens in a request)
        dec_len = decode_counts[ids]
        dec_first = starts[ids] + prefill_counts[ids]
        dec_start = np.concatenate(([0], np.cumsum(dec_len)[:-1])).astype(np.int64)
        rows = np.repeat(dec_first - dec_start, dec_len) + np.arange(int(dec_len.sum()))
        # union of each kept request's prefill tokens: OR-reduce over [start, start + prefill) with reduceat on
        # (start, end) pairs; the odd segments (end → next start) are discarded. end < N: a decode token follows.
        pre_bits = np.zeros((len(ids), trace.num_layers, bits.shape[2]), dtype=np.uint64)
        has_pre = prefill_counts[ids] > 0
        if has_pre.any():
            seg = starts[ids][has_pre]
            pairs = np.stack([seg, seg + prefill_counts[ids][has_pre]], axis=1).ravel()
            pre_bits[has_pre] = np.bitwise_or.reduceat(bits, pairs, axis=0)[::2]
        labels = trace.request_labels()
        return cls(
            decode_bits=np.ascontiguousarray(bits[rows]),
            decode_start=dec_start,
            decode_len=dec_len,
            prefill_bits=pre_bits,
            prefill_len=prefill_counts[ids].astype(np.int64),
            labels=np.full(len(ids), -1, np.int64) if labels is None else labels[ids].astype(np.int64),
            label_names=tuple(trace.label_names or ()),
            num_experts=trace.num_experts,
            request_ids=ids,
        )
