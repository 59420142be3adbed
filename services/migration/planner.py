"""Turn a target layout into ordered steps of moves, and applied steps into their rollback. Pure numpy.

A step is one atomic batch (see `shared.layout`) on one layer, sent to the group in one `MigrateRequest`.
Each GPU receives at most `buffer_slots` experts per step: the engine stages incoming weights in a buffer
before swapping them in, as vLLM's EPLB does with its one-layer buffer. When a layer needs more than that,
its moves are split over several steps ordered so the model stays servable between steps:

- a slot is only overwritten in the same step as, or after, every move that reads it (no expert is lost);
- a cycle of moves (A→B→C→A) has no free slot to go through, so it stays inside one step.

With `buffer_slots=None` (a whole layer's slots, the default) every layer is exactly one step.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from shared.layout import DST_GPU, DST_SLOT, LAYER, SRC_GPU, SRC_SLOT, LayoutError, apply_moves, layer_moves


class BufferTooSmall(LayoutError):
    """A cycle of moves needs more buffer slots on one GPU than the engines have."""


def _overwritten_slot(move: np.ndarray) -> tuple[int, int]:
    """The slot whose old content a move destroys: its destination, or its source when it frees a slot."""
    if move[DST_GPU] >= 0:
        return int(move[DST_GPU]), int(move[DST_SLOT])
    return int(move[SRC_GPU]), int(move[SRC_SLOT])


def _ordered_components(moves: np.ndarray) -> list[np.ndarray]:
    """Groups of move indices (cycles kept whole) in an order where readers come before overwriters."""
    readers: dict[tuple[int, int], list[int]] = {}
    for i, move in enumerate(moves):
        if move[SRC_GPU] >= 0:
            readers.setdefault((int(move[SRC_GPU]), int(move[SRC_SLOT])), []).append(i)
    edges = [
        (reader, i)
        for i, move in enumerate(moves)
        for reader in readers.get(_overwritten_slot(move), [])
        if reader != i
    ]
    n = len(moves)
    src, dst = (np.array(side, dtype=np.int64) for side in zip(*edges, strict=True)) if edges else ([], [])
    graph = coo_matrix((np.ones(len(src)), (src, dst)), shape=(n, n))
    count, label = connected_components(graph, directed=True, connection="strong")
    # Kahn's algorithm on the condensation: a component is ready once every component it reads from is placed.
    successors: list[set[int]] = [set() for _ in range(count)]
    indegree = np.zeros(count, dtype=np.int64)
    for a, b in edges:
        ca, cb = int(label[a]), int(label[b])
        if ca != cb and cb not in successors[ca]:
            successors[ca].add(cb)
            indegree[cb] += 1
    ready = deque(sorted(int(c) for c in np.flatnonzero(indegree == 0)))
    order: list[np.ndarray] = []
    while ready:
        component = ready.popleft()
        order.append(np.flatnonzero(label == component))
        for nxt in sorted(successors[component]):
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    return order


def _receives(moves: np.ndarray, num_gpus: int) -> np.ndarray:
    """Experts each GPU receives in a batch (frees receive nothing)."""
    written = moves[moves[:, DST_GPU] >= 0, DST_GPU]
    return np.bincount(written, minlength=num_gpus)


def split_layer(moves: np.ndarray, num_gpus: int, buffer_slots: int | None) -> list[np.ndarray]:
    """Split one layer's moves into ordered steps that each fit the per-GPU buffer."""
    if len(moves) == 0:
        return []
    if buffer_slots is None or _receives(moves, num_gpus).max(initial=0) <= buffer_slots:
        return [moves]
    steps: list[list[int]] = [[]]
    load = np.zeros(num_gpus, dtype=np.int64)
    for component in _ordered_components(moves):
        need = _receives(moves[component], num_gpus)
        if need.max(initial=0) > buffer_slots:
            layer, gpu = int(moves[0, LAYER]), int(need.argmax())
            raise BufferTooSmall(
                f"layer {layer}: a cycle of {len(component)} moves needs {int(need.max())} buffer slots on GPU "
                f"{gpu}, but engines have {buffer_slots}; raise SWITCHYARD_MIGRATION_BUFFER_SLOTS"
            )
        if (load + need).max() > buffer_slots:
            steps.append([])
            load[:] = 0
        steps[-1].extend(component.tolist())
        load += need
    return [moves[np.array(sorted(step))] for step in steps]


def plan_steps(current: np.ndarray, target: np.ndarray, buffer_slots: int | None = None) -> list[np.ndarray]:
    """Ordered steps (each `[n, 6]`, one layer) that take a group from `current` to `target`."""
    if current.shape != target.shape:
        raise LayoutError(f"current layout {list(current.shape)} and target {list(target.shape)} differ in shape")
    num_gpus = current.shape[1]
    steps: list[np.ndarray] = []
    for layer in range(current.shape[0]):
        steps.extend(split_layer(layer_moves(current[layer], target[layer], layer), num_gpus, buffer_slots))
    return steps


def states_after(base: np.ndarray, steps: list[np.ndarray]) -> list[np.ndarray]:
    """The layout after each step, starting from `base` (raises if a step does not apply)."""
    states, layout = [], base
    for step in steps:
        layout = apply_moves(layout, step)
        states.append(layout)
    return states


def rollback_steps(base: np.ndarray, applied: list[np.ndarray]) -> list[np.ndarray]:
    """The inverse of each applied step, last step first: back from where `applied` left `base` to `base`.

    Each inverse is one atomic batch on the step's layer; it receives on each GPU exactly as many experts
    as the forward step wrote there, so it fits the same buffer.
    """
    before = [base, *states_after(base, applied)]
    inverses = []
    for k in reversed(range(len(applied))):
        layer = int(applied[k][0, LAYER])
        inverse = layer_moves(before[k + 1][layer], before[k][layer], layer)
        if len(inverse):
            inverses.append(inverse)
    return inverses
