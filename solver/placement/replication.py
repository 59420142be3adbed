"""How many copies of each expert: spend the redundant slots on the hottest experts.

Each redundant slot goes to the expert whose per-copy load B_e / r_e is largest at that moment. This
greedy minimises the largest per-copy load for any number of redundant slots (each step lowers the
current maximum as far as one copy can), which is the quantity that bounds the hottest GPU: no
placement can bring a GPU below its heaviest single copy. It is the replication rule of DeepSeek's EPLB,
here vectorised over layers; copies are capped at one per GPU, since two copies of an expert on one GPU
would split no load.
"""

from __future__ import annotations

import numpy as np

from switchyard.solver.placement.problem import PlacementError


def replica_counts(load: np.ndarray, redundant_slots: int, max_copies: int) -> np.ndarray:
    """r[L, E] >= 1 with Σ_e r = E + redundant_slots per layer, each extra copy to the hottest per-copy load."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2:
        raise PlacementError(f"load must be B[L, E], got shape {list(load.shape)}")
    num_layers, num_experts = load.shape
    if redundant_slots < 0 or max_copies < 1:
        raise PlacementError("redundant_slots must be >= 0 and max_copies >= 1")
    if redundant_slots > num_experts * (max_copies - 1):
        raise PlacementError(f"{redundant_slots} redundant slots exceed {max_copies} copies of {num_experts} experts")
    copies = np.ones((num_layers, num_experts), dtype=np.int64)
    rows = np.arange(num_layers)
    for _ in range(redundant_slots):  # one vectorised step per redundant slot, all layers at once
        per_copy = np.where(copies < max_copies, load / copies, -np.inf)
        copies[rows, per_copy.argmax(axis=1)] += 1
    return copies


def check_replicas(replicas: np.ndarray, num_layers: int, num_experts: int, num_gpus: int) -> np.ndarray:
    """Validate copy counts r[L, E]: 1 <= r <= G, the same number of copies in every layer."""
    r = np.asarray(replicas)
    if r.shape != (num_layers, num_experts) or r.dtype.kind not in "iu":
        raise PlacementError(f"replicas must be integer [L, E] = [{num_layers}, {num_experts}], got {list(r.shape)}")
    if (r < 1).any() or (r > num_gpus).any():
        raise PlacementError(f"replica counts must lie in [1, {num_gpus}] (one copy per GPU at most)")
    totals = r.sum(axis=1)
    if (totals != totals[0]).any():
        raise PlacementError("every layer must have the same number of expert copies")
    return r.astype(np.int64)
