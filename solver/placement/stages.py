"""Move less, sooner: a plan that is a prefix of the full target, the hottest experts first, bounded in bytes.

A layer's change from one slot map to another is a permutation of its changed slots (an expert leaves slot a
and the expert arriving there left slot b, …); its cycles are the smallest self-contained sets of moves: each
leaves every GPU with as many experts as before and every expert with exactly one copy. `stage` applies whole
cycles, hottest first (a cycle's heat is its hottest expert's load), while the bytes every GPU receives stay
within `max_bytes`, and returns the layout reached. The next plan continues from it (the trigger's
"continue"). Layouts with replicas, where an expert may hold several slots, are staged a layer at a time
instead (the hottest layers first), since their changes need not decompose into cycles.
"""

from __future__ import annotations

import numpy as np

from switchyard.solver.placement.payoff import MigrationPrice, migration_bytes

__all__ = ["stage"]


def _one_copy_each(layout: np.ndarray) -> bool:
    """Every expert of every layer sits in exactly one slot."""
    for layer in layout:
        experts = layer[layer >= 0]
        if len(np.unique(experts)) != len(experts):
            return False
    return True


def _cycles(current: np.ndarray, target: np.ndarray) -> list[list[tuple[int, int]]]:
    """One layer's changed slots (gpu, slot), grouped into the cycles (or chains through empty slots) of moves."""
    where = {int(e): (g, s) for (g, s), e in np.ndenumerate(current) if e >= 0}
    changed = {(g, s) for (g, s), e in np.ndenumerate(target) if e != current[g, s]}
    seen: set[tuple[int, int]] = set()
    out = []
    for start in sorted(changed):
        if start in seen:
            continue
        cycle, slot = [], start
        while slot in changed and slot not in seen:  # follow: the expert arriving here, where it comes from
            seen.add(slot)
            cycle.append(slot)
            arriving = int(target[slot])
            if arriving < 0 or arriving not in where:
                break
            slot = where[arriving]
        out.append(cycle)
    return out


def _received(current: np.ndarray, trial: np.ndarray, price: MigrationPrice) -> np.ndarray:
    """`[G]` bytes each GPU receives moving `current` → `trial` (either link)."""
    return migration_bytes(current, trial, price)[1].sum(axis=0)


def stage(
    current: np.ndarray, target: np.ndarray, heat: np.ndarray, price: MigrationPrice, max_bytes: float | None
) -> np.ndarray:
    """The prefix of `current` → `target` that moves the hottest experts within `max_bytes` received per GPU
    (None: the whole target). `heat[L, E]` is the window's load per expert. At least one cycle (or layer) is
    applied whenever the target differs, so staging always progresses."""
    current, target = np.asarray(current), np.asarray(target)
    if max_bytes is None or np.array_equal(current, target):
        return target.copy()
    # (heat, layer, changed slots): a cycle, or a whole layer when layouts hold replicas
    units: list[tuple[float, int, list[tuple[int, int]]]] = []
    if _one_copy_each(current) and _one_copy_each(target):
        for layer in range(current.shape[0]):
            for cycle in _cycles(current[layer], target[layer]):
                experts = [int(target[layer][slot]) for slot in cycle if target[layer][slot] >= 0]
                units.append((max((float(heat[layer, e]) for e in experts), default=0.0), layer, cycle))
    else:
        for layer in range(current.shape[0]):
            slots = [(int(g), int(s)) for g, s in np.argwhere(current[layer] != target[layer])]
            if slots:
                units.append((float(heat[layer].max()), layer, slots))
    units.sort(key=lambda u: (-u[0], u[1], u[2]))
    staged = current.copy()
    received = np.zeros(current.shape[1])
    for i, (_, layer, slots) in enumerate(units):
        before = staged[layer : layer + 1].copy()
        after = before.copy()
        for g, s in slots:
            after[0, g, s] = target[layer, g, s]
        extra = _received(before, after, price)
        if i == 0 or (received + extra).max() <= max_bytes:
            staged[layer] = after[0]
            received += extra
    return staged
