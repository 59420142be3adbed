"""Expert layouts and what a move means, shared by the placement and migration services and the engine agents.

A layout is an int array `[L, G, S]`: the expert held by slot `s` of GPU `g` (an EP rank of the group) at
MoE layer `l`, or -1 for an empty slot. A move is one row of `MOVE_COLUMNS`
(`layer, expert, src_gpu, src_slot, dst_gpu, dst_slot`); `src = (-1, -1)` copies the expert in from
outside the group (host memory, a checkpoint), `dst = (-1, -1)` frees the source slot.

A batch of moves is applied **atomically with read-before-write semantics**, as vLLM's EPLB does per layer:
every source slot is read from the layout as it was before the batch, then every destination is written.
Swaps and cycles are therefore legal inside one batch, and a batch is either applied whole or refused.
"""

from __future__ import annotations

import numpy as np

from shared.schemas import MOVE_COLUMNS

LAYER, EXPERT, SRC_GPU, SRC_SLOT, DST_GPU, DST_SLOT = range(len(MOVE_COLUMNS))
MOVE_DTYPE = np.int32


class LayoutError(ValueError):
    """A layout or a batch of moves that cannot be accepted; the message says which layer/slot and why."""


def default_layout(num_layers: int, num_experts: int, num_gpus: int, slots_per_gpu: int | None = None) -> np.ndarray:
    """vLLM's layout without EPLB: experts split contiguously over the GPUs (expert e on GPU e // ⌈E/G⌉).

    This is where a group starts before Switchyard has applied any placement, so both the placement
    service (as x⁰) and the migration service (as the base of the first migration) assume it.
    """
    per_gpu = -(-num_experts // num_gpus)
    slots = per_gpu if slots_per_gpu is None else slots_per_gpu
    if slots < per_gpu:
        raise LayoutError(f"{num_gpus} GPUs x {slots} slots cannot hold {num_experts} experts")
    layout = np.full((num_layers, num_gpus, slots), -1, dtype=MOVE_DTYPE)
    experts = np.arange(num_experts)
    layout[:, experts // per_gpu, experts % per_gpu] = experts
    return layout


def check_layout(layout: np.ndarray, num_experts: int | None = None) -> int:
    """Check that every layer holds every expert at least once; returns the number of experts E.

    `num_experts` defaults to the largest expert id + 1. A layer that misses an expert could not serve the
    tokens routed to it, so such a layout is refused rather than migrated to.
    """
    if layout.ndim != 3:
        raise LayoutError(f"a layout is [layers, gpus, slots], got shape {list(layout.shape)}")
    if layout.size and layout.min() < -1:
        raise LayoutError("expert ids must be >= 0 (or -1 for an empty slot)")
    experts = int(layout.max()) + 1 if num_experts is None and layout.size else int(num_experts or 0)
    if layout.size and layout.max() >= experts:
        raise LayoutError(f"expert id {int(layout.max())} out of range for {experts} experts")
    for layer in range(layout.shape[0]):
        present = np.zeros(experts, dtype=bool)
        held = layout[layer][layout[layer] >= 0]
        present[held] = True
        if not present.all():
            missing = np.flatnonzero(~present)[:8].tolist()
            raise LayoutError(f"layer {layer} does not hold experts {missing}")
    return experts


def layer_moves(current: np.ndarray, target: np.ndarray, layer: int) -> np.ndarray:
    """The moves `[n, 6]` that turn one layer `[G, S]` from `current` into `target` as one atomic batch.

    One move per slot whose expert changes (sourced from a slot that holds the expert now, preferring the
    destination's own GPU, else copied in with src -1), plus one free per slot that becomes empty.
    """
    if current.shape != target.shape:
        raise LayoutError(f"layer {layer}: current {list(current.shape)} and target {list(target.shape)} differ")
    moves: list[tuple[int, int, int, int, int, int]] = []
    holders: dict[int, list[tuple[int, int]]] = {}
    for g, s in zip(*np.nonzero(current >= 0), strict=True):
        holders.setdefault(int(current[g, s]), []).append((int(g), int(s)))
    for g, s in zip(*np.nonzero(current != target), strict=True):
        g, s = int(g), int(s)
        expert = int(target[g, s])
        if expert < 0:
            moves.append((layer, int(current[g, s]), g, s, -1, -1))
            continue
        sources = holders.get(expert, [])
        local = [src for src in sources if src[0] == g]
        src_gpu, src_slot = (local or sources or [(-1, -1)])[0]
        moves.append((layer, expert, src_gpu, src_slot, g, s))
    return np.array(moves, dtype=MOVE_DTYPE).reshape(-1, len(MOVE_COLUMNS))


def diff_moves(current: np.ndarray, target: np.ndarray) -> np.ndarray:
    """All layers' moves from `current` to `target`, layer by layer (each layer one atomic batch)."""
    if current.shape != target.shape:
        raise LayoutError(f"layouts differ in shape: {list(current.shape)} vs {list(target.shape)}")
    parts = [layer_moves(current[layer], target[layer], layer) for layer in range(current.shape[0])]
    return np.concatenate(parts) if parts else np.zeros((0, len(MOVE_COLUMNS)), MOVE_DTYPE)


def apply_moves(layout: np.ndarray, moves: np.ndarray) -> np.ndarray:
    """Apply one batch atomically (read every source, then write every destination); returns a new layout.

    Raises `LayoutError`, leaving `layout` untouched, when a move names a slot outside the layout, a source
    slot that does not hold the moved expert, or a destination written twice.
    """
    moves = np.asarray(moves)
    if moves.ndim != 2 or moves.shape[1] != len(MOVE_COLUMNS):
        raise LayoutError(f"moves must be [n, {len(MOVE_COLUMNS)}], got {list(moves.shape)}")
    num_layers, num_gpus, num_slots = layout.shape
    result = layout.copy()
    written: set[tuple[int, int, int]] = set()
    freed: set[tuple[int, int, int]] = set()
    for row in moves.tolist():
        layer, expert, src_gpu, src_slot, dst_gpu, dst_slot = row
        if not 0 <= layer < num_layers:
            raise LayoutError(f"move {row}: layer {layer} outside 0..{num_layers - 1}")
        for what, gpu, slot in (("src", src_gpu, src_slot), ("dst", dst_gpu, dst_slot)):
            if (gpu, slot) != (-1, -1) and not (0 <= gpu < num_gpus and 0 <= slot < num_slots):
                raise LayoutError(f"move {row}: {what} (gpu {gpu}, slot {slot}) outside {num_gpus}x{num_slots}")
        if src_gpu >= 0 and layout[layer, src_gpu, src_slot] != expert:
            held = int(layout[layer, src_gpu, src_slot])
            raise LayoutError(f"move {row}: source slot holds expert {held}, not {expert}")
        if dst_gpu < 0:
            if src_gpu < 0:
                raise LayoutError(f"move {row}: neither a source nor a destination")
            freed.add((layer, src_gpu, src_slot))
            continue
        key = (layer, dst_gpu, dst_slot)
        if key in written:
            raise LayoutError(f"move {row}: destination written twice in one batch")
        written.add(key)
        result[key] = expert
    if conflict := freed & written:
        raise LayoutError(f"slots {sorted(conflict)[:4]} both freed and written in one batch")
    for key in freed:
        result[key] = -1
    return result


def layout_rows(layout: np.ndarray) -> list[dict[str, int]]:
    """`placement_assignments` rows for a layout (empty slots included, so the shape round-trips)."""
    layers, gpus, slots = np.indices(layout.shape).reshape(3, -1)
    return [
        {"layer": int(layer), "gpu": int(gpu), "slot": int(slot), "expert": int(expert)}
        for layer, gpu, slot, expert in zip(layers, gpus, slots, layout.reshape(-1), strict=True)
    ]


def layout_from_rows(rows: list[tuple[int, int, int, int]], shape: tuple[int, int, int]) -> np.ndarray:
    """Rebuild a layout from `(layer, gpu, slot, expert)` rows; slots without a row are empty."""
    layout = np.full(shape, -1, dtype=MOVE_DTYPE)
    if rows:
        index = np.array(rows, dtype=np.int64)
        layout[index[:, 0], index[:, 1], index[:, 2]] = index[:, 3]
    return layout
