"""The baseline: DeepSeek's published EPLB algorithm, re-implemented from its description.

EPLB balances computation only. Global policy: give each redundant slot to the expert with the largest
per-copy load, then pack the copies onto GPUs by "balanced packing": heaviest copy first, each onto the
least-loaded GPU that still has room, every GPU receiving the same number of copies. Hierarchical policy
(several nodes, experts in groups, as DeepSeek-V3's group-limited routing): pack whole expert groups onto
nodes the same way, then run the global policy inside each node on its own experts and its share of the
redundant slots, so that an expert's copies stay on its group's node.

It ignores where traffic comes from (A, D) and where experts are now (x⁰): every run is a fresh layout,
and its moves are whatever the diff says. Two changes from the published code, both in the baseline's
favour or neutral: copies of one expert never share a GPU (they would split no load), and copies are capped
at one per GPU. The replication rule is the same as Switchyard's (`replica_counts`).
"""

from __future__ import annotations

import numpy as np

from switchyard.solver.placement.problem import PlacementError
from switchyard.solver.placement.replication import replica_counts


def eplb_global(load: np.ndarray, num_gpus: int, redundant_slots: int = 0) -> np.ndarray:
    """Slot map [L, G, (E + R) / G] of EPLB's global policy."""
    load = np.asarray(load, dtype=np.float64)
    num_layers, num_experts = load.shape
    total = num_experts + redundant_slots
    if total % num_gpus:
        raise PlacementError(f"EPLB needs G to divide E + R: {total} copies on {num_gpus} GPUs")
    copies = replica_counts(load, redundant_slots, num_gpus)
    items = np.repeat(np.tile(np.arange(num_experts), num_layers), copies.ravel()).reshape(num_layers, total)
    weight = np.take_along_axis(load / copies, items, axis=1)
    gpu = balanced_packing(weight, num_gpus, conflicts=items)
    return _slot_map(items, gpu, num_gpus, total // num_gpus)


def eplb_hierarchical(
    load: np.ndarray, num_gpus: int, num_nodes: int, num_groups: int, redundant_slots: int = 0
) -> np.ndarray:
    """Slot map [L, G, (E + R) / G] of EPLB's hierarchical policy (groups to nodes, then global per node)."""
    load = np.asarray(load, dtype=np.float64)
    num_layers, num_experts = load.shape
    if num_experts % num_groups or num_groups % num_nodes or num_gpus % num_nodes or redundant_slots % num_nodes:
        raise PlacementError("hierarchical EPLB needs groups | E, nodes | groups, nodes | G and nodes | R")
    group_size, gpus_per_node = num_experts // num_groups, num_gpus // num_nodes
    group_load = load.reshape(num_layers, num_groups, group_size).sum(axis=2)
    node_of_group = balanced_packing(group_load, num_nodes)  # [L, groups]
    slots = (num_experts + redundant_slots) // num_gpus
    out = np.full((num_layers, num_gpus, slots), -1, dtype=np.int64)
    for layer in range(num_layers):  # each node is an independent global problem on its own experts
        for node in range(num_nodes):
            groups = np.flatnonzero(node_of_group[layer] == node)
            experts = (groups[:, None] * group_size + np.arange(group_size)).ravel()
            local = eplb_global(load[layer : layer + 1, experts], gpus_per_node, redundant_slots // num_nodes)
            block = out[layer, node * gpus_per_node : (node + 1) * gpus_per_node]
            block[...] = np.where(local[0] >= 0, experts[np.maximum(local[0], 0)], -1)
    return out


def balanced_packing(weight: np.ndarray, num_packs: int, conflicts: np.ndarray | None = None) -> np.ndarray:
    """Pack index [L, n] of each item: heaviest first onto the lightest pack with room (n / packs each).

    Items with equal `conflicts` ids never share a pack. Vectorised over layers; one step per item rank.
    """
    num_layers, num_items = weight.shape
    if num_items % num_packs:
        raise PlacementError(f"{num_items} items do not split evenly into {num_packs} packs")
    capacity = num_items // num_packs
    rows = np.arange(num_layers)
    order = np.argsort(-weight, axis=1, kind="stable")
    pack_load = np.zeros((num_layers, num_packs))
    pack_size = np.zeros((num_layers, num_packs), dtype=np.int64)
    holds = None if conflicts is None else np.zeros((num_layers, int(conflicts.max()) + 1, num_packs), dtype=bool)
    packs = np.empty((num_layers, num_items), dtype=np.int64)
    for step in range(num_items):
        item = order[:, step]
        full = pack_size >= capacity
        if holds is not None and conflicts is not None:
            blocked = full | holds[rows, conflicts[rows, item]]
            full = np.where(blocked.all(axis=1, keepdims=True), full, blocked)
        pack = np.where(full, np.inf, pack_load).argmin(axis=1)
        packs[rows, item] = pack
        pack_load[rows, pack] += weight[rows, item]
        pack_size[rows, pack] += 1
        if holds is not None and conflicts is not None:
            holds[rows, conflicts[rows, item], pack] = True
    return packs


def _slot_map(items: np.ndarray, gpu: np.ndarray, num_gpus: int, slots: int) -> np.ndarray:
    """Slot map from the expert id and GPU of every copy: a GPU's copies fill its slots in item order."""
    num_layers = items.shape[0]
    order = np.argsort(gpu, axis=1, kind="stable")
    return np.take_along_axis(items, order, axis=1).reshape(num_layers, num_gpus, slots)
