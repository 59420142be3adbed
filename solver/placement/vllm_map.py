"""Placements in the form vLLM's proposed `eplb_config.initial_expert_map_path` takes (vllm-project/vllm PR #49572).

The PR's format (from its description): a JSON physical-to-logical expert map, either one list shared by every
MoE layer or one list per MoE layer; entry p is the logical expert held by physical expert slot p, so a list has
`num_physical_experts` (= logical experts + `num_redundant_experts`) entries, every logical id lies in
[0, num_logical_experts) and every logical expert appears at least once (a replica appears more than once). vLLM
lays physical slots out contiguously over the EP ranks: rank r holds slots [r·n, (r+1)·n), n = physical / EP
size. A slot map `[L, G, slots]` is therefore that map with each layer's GPUs in rank order, flattened.

`to_expert_map` writes it (per layer, always: a placement's layers differ), `from_expert_map` reads either form
back into a slot map and checks what the PR says vLLM checks, so a round trip proves the export loads.
"""

from __future__ import annotations

import numpy as np

from switchyard.solver.placement.errors import PlacementError

__all__ = ["from_expert_map", "to_expert_map"]


def to_expert_map(layout: np.ndarray) -> list[list[int]]:
    """Slot map `[L, G, slots]` (GPUs in EP-rank order) → one physical→logical list per MoE layer.

    Refuses a layout with an empty slot: vLLM has no empty physical expert (every slot holds a logical one)."""
    layout = np.asarray(layout)
    if layout.ndim != 3:
        raise PlacementError(f"a slot map is [L, G, slots], got shape {list(layout.shape)}")
    if (layout < 0).any():
        layer, gpu, slot = (int(i) for i in np.argwhere(layout < 0)[0])
        raise PlacementError(
            f"layer {layer}, GPU {gpu}, slot {slot} is empty: vLLM's map has a logical expert in every physical slot"
        )
    return layout.reshape(layout.shape[0], -1).astype(int).tolist()


def from_expert_map(
    data: object, num_gpus: int, num_layers: int | None = None, num_experts: int | None = None
) -> np.ndarray:
    """A physical→logical map (one shared list, or one per layer) → slot map `[L, G, slots]`, validated as the PR
    describes: integers, equal lengths dividing over `num_gpus` EP ranks, ids in [0, num_experts) and every
    logical expert present (`num_experts` defaults to the largest id + 1; `num_layers` is needed for a shared list)."""
    if not isinstance(data, list) or not data:
        raise PlacementError("an expert map is a non-empty JSON list")
    shared = all(isinstance(v, int) and not isinstance(v, bool) for v in data)
    if shared:
        if num_layers is None:
            raise PlacementError("a map shared by all layers needs the number of MoE layers")
        rows = [data] * num_layers
    elif all(isinstance(row, list) for row in data):
        rows = data
        if num_layers is not None and len(rows) != num_layers:
            raise PlacementError(f"the map has {len(rows)} layers, the model {num_layers}")
    else:
        raise PlacementError("an expert map is a list of ints or a list of lists of ints")
    for layer, row in enumerate(rows):
        if not row or not all(isinstance(v, int) and not isinstance(v, bool) for v in row):
            raise PlacementError(f"layer {layer}: entries must be integers (logical expert ids)")
    widths = {len(row) for row in rows}
    if len(widths) != 1:
        raise PlacementError(f"layers have different numbers of physical experts: {sorted(widths)}")
    (physical,) = widths
    if num_gpus < 1 or physical % num_gpus:
        raise PlacementError(f"{physical} physical experts do not divide over {num_gpus} EP ranks")
    array = np.array(rows, dtype=np.int64)
    logical = int(array.max()) + 1 if num_experts is None else num_experts
    if array.min() < 0 or array.max() >= logical:
        raise PlacementError(f"logical expert ids must lie in [0, {logical})")
    for layer, row in enumerate(array):
        missing = np.setdiff1d(np.arange(logical), row)
        if len(missing):
            raise PlacementError(f"layer {layer}: logical expert {int(missing[0])} has no physical slot")
    return array.reshape(len(rows), num_gpus, physical // num_gpus).astype(np.int32)
