"""Trace-level and physics-level experiments of the ELDR seed that need no serving simulation (Fig. 2, Fig. 4)."""

from __future__ import annotations

import numpy as np

from switchyard.shared.streams import stream
from switchyard.simulator.core.experts import ReplayBank
from switchyard.simulator.core.physics import CostModel

__all__ = ["batch_distinct", "moe_layer_grid"]


def moe_layer_grid(cost: CostModel, experts: np.ndarray, batches: np.ndarray) -> np.ndarray:
    """Fig. 2 analogue: one MoE layer's time (s) per (active experts, batch) → [len(experts), len(batches)]."""
    return cost.moe_time(np.asarray(experts)[:, None, None], np.asarray(batches)[None, :])[..., 0]


def batch_distinct(
    bank: ReplayBank, batch: int, samples: int, seed: int
) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """Fig. 4 analogue: mean distinct experts per layer of a decode step, same-domain vs mixed batches.

    A batch is `batch` distinct requests, each at a random decode token. Mixed batches draw the requests
    uniformly from the bank; same-domain batches first draw a label with probability equal to its share of
    the bank, then requests of that label only. Both therefore see the same requests on average; only
    their co-location differs. Returns (same, mixed, {label: (same, mixed)}); mixed per label is the mixed
    value restricted to batches whose first request has that label (for symmetry of the comparison).
    """
    rng = stream(seed, "fig4")
    labels = bank.labels
    names = bank.label_names
    groups = [np.flatnonzero(labels == g) for g in range(len(names))]
    if any(len(g) < batch for g in groups if len(g)):
        raise ValueError(f"a label has fewer than {batch} requests; lower the batch")
    n = bank.num_requests
    shares = np.array([len(g) for g in groups], dtype=np.float64) / n

    def union_distinct(req: np.ndarray) -> np.ndarray:
        offset = (rng.random(req.shape) * bank.decode_len[req]).astype(np.int64)
        bits = bank.decode_bits[bank.decode_start[req] + offset]  # [S, B, L, W]
        union = np.bitwise_or.reduce(bits, axis=1)
        return np.bitwise_count(union).sum(axis=-1).mean(axis=-1)  # [S]

    mixed_req = np.argsort(rng.random((samples, n)), axis=1)[:, :batch]
    mixed = union_distinct(mixed_req)
    batch_label = rng.choice(len(names), size=samples, p=shares)
    same = np.empty(samples)
    per_label: dict[str, tuple[float, float]] = {}
    for g, members in enumerate(groups):
        rows = np.flatnonzero(batch_label == g)
        if len(rows) == 0:
            continue
        pick = np.argsort(rng.random((len(rows), len(members))), axis=1)[:, :batch]
        same[rows] = union_distinct(members[pick])
        first_is_g = labels[mixed_req[:, 0]] == g
        per_label[names[g]] = (float(same[rows].mean()), float(mixed[first_is_g].mean()))
    return float(same.mean()), float(mixed.mean()), per_label
