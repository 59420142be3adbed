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

__all__ = [
    "ReplayBank",
    "distinct_per_layer",
    "distinct_per_rank",
    "expert_bitsets",
    "num_words",
    "rank_masks",
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
    def from_tokens(
        cls,
        experts: np.ndarray,
        request: np.ndarray,
        is_prefill: np.ndarray,
        num_experts: int,
        labels: np.ndarray | None = None,
        label_names: tuple[str, ...] = (),
        keep: np.ndarray | None = None,
    ) -> ReplayBank:
        """Build from per-token arrays of a routing trace: `experts[N, L, k]`, `request[N]`,
        `is_prefill[N]` (bool), optional per-token `labels[N]`. Tokens must be in order within a request.
        `keep`: the trace request ids to include (default all that have at least one decode token).
        """
        experts = np.asarray(experts)
        request = np.asarray(request)
        is_prefill = np.asarray(is_prefill, dtype=bool)
        ids = np.unique(request) if keep is None else np.asarray(keep)
        order = np.argsort(request, kind="stable")
        req_sorted = request[order]
        lo = np.searchsorted(req_sorted, ids, side="left")
        hi = np.searchsorted(req_sorted, ids, side="right")
        bits = expert_bitsets(experts, num_experts)
        layers, words = bits.shape[1], bits.shape[2]
        dec_rows, dec_start, dec_len = [], [], []
        pre_bits = np.zeros((len(ids), layers, words), dtype=np.uint64)
        pre_len = np.zeros(len(ids), dtype=np.int64)
        lab = np.full(len(ids), -1, dtype=np.int64)
        total = 0
        for i, (a, b) in enumerate(zip(lo, hi, strict=True)):
            rows = order[a:b]
            pre = rows[is_prefill[rows]]
            dec = rows[~is_prefill[rows]]
            if len(dec) == 0:
                raise ValueError(f"trace request {ids[i]} has no decode tokens to replay")
            if len(pre):
                pre_bits[i] = np.bitwise_or.reduce(bits[pre], axis=0)
            pre_len[i] = len(pre)
            dec_rows.append(dec)
            dec_start.append(total)
            dec_len.append(len(dec))
            total += len(dec)
            if labels is not None:
                lab[i] = int(np.asarray(labels)[rows[0]])
        return cls(
            decode_bits=np.ascontiguousarray(bits[np.concatenate(dec_rows)]),
            decode_start=np.asarray(dec_start, dtype=np.int64),
            decode_len=np.asarray(dec_len, dtype=np.int64),
            prefill_bits=pre_bits,
            prefill_len=pre_len,
            labels=lab,
            label_names=tuple(label_names),
            num_experts=num_experts,
            request_ids=np.asarray(ids),
        )
