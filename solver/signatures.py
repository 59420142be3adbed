"""Expert counts per request: prefill signatures, decode patterns, and the block-granular signature cache.

A request's prefill signature `c[L, E]` counts the prompt tokens whose top-k at layer l includes expert e;
its decode pattern `p[L, E]` counts the same for generated tokens (the target the signature must predict).
Both are one `np.bincount` over the whole trace.

Under prefix caching a request's prompt is spread over KV blocks some of which another request computed.
ELDR therefore keeps one uint8 `[L, E]` row per KV block (each token adds at most 1 to a cell, so a block of
at most 255 tokens cannot overflow) and sums the rows of a request's block table: the sum is exact whoever
populated each block (`BlockSignatureCache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.routing_trace import PHASE_DECODE, PHASE_PREFILL, RoutingTrace

__all__ = [
    "MAX_BLOCK_SIZE",
    "BlockSignatureCache",
    "RequestCounts",
    "SignatureError",
    "block_rows",
    "block_sum",
    "expert_counts",
    "request_counts",
]

#: Largest KV block size a uint8 signature row can hold without overflow.
MAX_BLOCK_SIZE = 255


class SignatureError(ValueError):
    """Counts or block ids that do not fit the model shape or the cache."""


def expert_counts(
    experts: np.ndarray,
    group: np.ndarray,
    num_groups: int,
    num_experts: int,
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """Per group, per layer, per expert: how many tokens selected it (or the sum of their gate weights).

    experts[T, L, k] expert ids, group[T] in [0, num_groups) -> [num_groups, L, E] int64 (float64 with weights).
    """
    experts, group = np.asarray(experts), np.asarray(group)
    if experts.ndim != 3 or group.shape != experts.shape[:1]:
        shapes = f"{list(experts.shape)}, {list(group.shape)}"
        raise SignatureError(f"experts [T, L, k] and group [T] expected, got {shapes}")
    if experts.shape[0] and (group.min() < 0 or group.max() >= num_groups):
        raise SignatureError(f"group ids must lie in [0, {num_groups})")
    layers = experts.shape[1]
    cell = (group.astype(np.int64)[:, None, None] * layers + np.arange(layers)[None, :, None]) * num_experts + experts
    w = None if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    counts = np.bincount(cell.ravel(), weights=w, minlength=num_groups * layers * num_experts)
    return counts.reshape(num_groups, layers, num_experts)


@dataclass(frozen=True, eq=False)
class RequestCounts:
    """The calibration set of the offline fit: per-request prefill and decode counts, [R, L, E].

    prefill_gate: per request the summed gate probabilities of the prompt's selected experts (None when the
    trace recorded none). label/label_names: optional domain labels, for reports only.
    """

    prefill: np.ndarray
    decode: np.ndarray
    top_k: int
    prefill_gate: np.ndarray | None = None
    label: np.ndarray | None = None
    label_names: tuple[str, ...] | None = None
    model_name: str = "unknown"

    def __post_init__(self) -> None:
        p, d = self.prefill, self.decode
        if not isinstance(p, np.ndarray) or p.ndim != 3 or p.dtype.kind not in "iu":
            raise SignatureError(f"prefill counts must be an integer array [R, L, E], got shape {np.shape(p)}")
        if not isinstance(d, np.ndarray) or d.shape != p.shape or d.dtype.kind not in "iu":
            raise SignatureError(f"decode counts must be an integer array of prefill's shape {list(p.shape)}")
        if p.shape[0] == 0:
            raise SignatureError("no requests")
        if (p < 0).any() or (d < 0).any():
            raise SignatureError("counts must be non-negative")
        if self.top_k < 1 or self.top_k > p.shape[2]:
            raise SignatureError(f"top_k {self.top_k} must lie in [1, {p.shape[2]}]")
        if self.prefill_gate is not None and self.prefill_gate.shape != p.shape:
            raise SignatureError(f"prefill_gate shape {list(self.prefill_gate.shape)} differs from {list(p.shape)}")
        if self.label is not None and self.label.shape != (p.shape[0],):
            raise SignatureError(f"label must have one entry per request ({p.shape[0]})")

    @property
    def num_requests(self) -> int:
        return int(self.prefill.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.prefill.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.prefill.shape[2])

    @property
    def prefill_tokens(self) -> np.ndarray:
        """Prompt tokens per request (each token adds top_k to every layer's row), [R]."""
        return self.prefill[:, 0, :].sum(axis=1) // self.top_k

    @property
    def decode_tokens(self) -> np.ndarray:
        return self.decode[:, 0, :].sum(axis=1) // self.top_k

    def subset(self, index: np.ndarray) -> RequestCounts:
        """The requests selected by a boolean mask or an index array."""

        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[index]

        return RequestCounts(
            prefill=self.prefill[index],
            decode=self.decode[index],
            top_k=self.top_k,
            prefill_gate=pick(self.prefill_gate),
            label=pick(self.label),
            label_names=self.label_names,
            model_name=self.model_name,
        )


def request_counts(trace: RoutingTrace) -> RequestCounts:
    """Prefill counts, decode patterns (and gate sums, if recorded) of every request of a phase-split trace."""
    if trace.phase is None:
        raise SignatureError("the trace has no phase: split it first (shared.routing_trace.split_phases)")
    # One bincount over (request, phase) groups gives both matrices.
    group = trace.request * 2 + trace.phase.astype(np.int64)
    r = trace.num_requests
    both = expert_counts(trace.experts, group, 2 * r, trace.num_experts).astype(np.int32)
    gate = None
    if trace.weights is not None:
        prefill = trace.phase == PHASE_PREFILL
        gate = expert_counts(
            trace.experts[prefill], trace.request[prefill], r, trace.num_experts, trace.weights[prefill]
        ).astype(np.float32)
    return RequestCounts(
        prefill=both[PHASE_PREFILL::2],
        decode=both[PHASE_DECODE::2],
        top_k=trace.top_k,
        prefill_gate=gate,
        label=trace.request_labels(),
        label_names=trace.label_names,
        model_name=trace.model_name,
    )


def _check_block_size(block_size: int) -> None:
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise SignatureError(f"block size must lie in [1, {MAX_BLOCK_SIZE}] for uint8 rows, got {block_size}")


def block_rows(experts: np.ndarray, num_experts: int, block_size: int) -> np.ndarray:
    """Signature rows of consecutive KV blocks: tokens [T, L, k] -> uint8 [⌈T/B⌉, L, E]; the last may be partial."""
    _check_block_size(block_size)
    experts = np.asarray(experts)
    if experts.ndim != 3:
        raise SignatureError(f"experts must be [tokens, layers, top_k], got shape {list(experts.shape)}")
    tokens = experts.shape[0]
    blocks = -(-tokens // block_size)
    counts = expert_counts(experts, np.arange(tokens) // block_size, blocks, num_experts)
    if counts.size and counts.max() > np.iinfo(np.uint8).max:
        raise SignatureError("a block row overflows uint8: a token selected the same expert twice")
    return counts.astype(np.uint8)


def block_sum(table: np.ndarray, block_ids: np.ndarray) -> np.ndarray:
    """A request's signature: the sum of its blocks' rows, accumulated in int32. [num_blocks, L, E] -> [L, E]."""
    block_ids = np.asarray(block_ids)
    if block_ids.ndim != 1 or block_ids.dtype.kind not in "iu":
        raise SignatureError("block ids must be a 1-D integer array")
    if block_ids.size and (block_ids.min() < 0 or block_ids.max() >= table.shape[0]):
        raise SignatureError(f"block ids must lie in [0, {table.shape[0]})")
    return table[block_ids].sum(axis=0, dtype=np.int32)


class BlockSignatureCache:
    """One uint8 `[L, E]` signature row per KV block id, living and dying with the KV cache's blocks.

    The prefill hook `write`s the rows of the blocks it fills; at handoff the request's signature is
    `signature(block_table)`, exact even when some blocks were filled by earlier requests (prefix hits).
    Memory: num_blocks · L · E bytes (6 KiB per block at 48 × 128).
    """

    def __init__(self, num_blocks: int, num_layers: int, num_experts: int, block_size: int) -> None:
        _check_block_size(block_size)
        if min(num_blocks, num_layers, num_experts) < 1:
            raise SignatureError("num_blocks, num_layers and num_experts must be positive")
        self.block_size = block_size
        self.num_experts = num_experts
        self.table = np.zeros((num_blocks, num_layers, num_experts), dtype=np.uint8)

    def write(self, block_ids: np.ndarray, experts: np.ndarray) -> None:
        """Record the tokens [T, L, k] that fill `block_ids` in order (B tokens per block, the last maybe fewer)."""
        block_ids = np.asarray(block_ids)
        rows = block_rows(experts, self.num_experts, self.block_size)
        if rows.shape[1:] != self.table.shape[1:]:
            raise SignatureError(f"tokens have {rows.shape[1]} layers, the cache {self.table.shape[1]}")
        if block_ids.shape != (rows.shape[0],):
            raise SignatureError(f"{rows.shape[0]} blocks of tokens but {block_ids.size} block ids")
        if block_ids.size and (block_ids.min() < 0 or block_ids.max() >= self.table.shape[0]):
            raise SignatureError(f"block ids must lie in [0, {self.table.shape[0]})")
        self.table[block_ids] = rows

    def signature(self, block_ids: np.ndarray) -> np.ndarray:
        """The prefill counts [L, E] of the request whose block table is `block_ids`."""
        return block_sum(self.table, block_ids)
