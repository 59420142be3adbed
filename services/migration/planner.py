"""Turn a target layout into ordered migrate steps, and applied steps into their rollback. Pure numpy.

Moves mean what `solver.placement.moves` says: executed in order, each copies an expert into an *empty* slot
and frees its source, so the engines keep serving while they migrate. Cycles in a full layer go through
the one scratch slot per GPU that engines reserve as their rearrangement buffer (vLLM's EPLB keeps one
too), i.e. slot index `slots_per_gpu`; every step leaves the buffer empty again.

A step is one layer's moves, sent to the group in one `MigrateRequest` (EPLB rearranges layer by layer).
The rollback of a step is its inverse moves in reverse order, and the rollback of a migration the
rollbacks of its applied steps, last step first.
"""

from __future__ import annotations

import numpy as np

from switchyard.shared.schemas import MOVE_COLUMNS
from switchyard.solver.placement.moves import NO_SLOT, plan_moves

LAYER = MOVE_COLUMNS.index("layer")


def plan_steps(current: np.ndarray, target: np.ndarray) -> list[np.ndarray]:
    """Ordered steps (each `[n, 6]` int32, one layer) that take a group from `current` to `target`.

    Raises `solver.placement.moves.MoveError` when either layout misses an expert or shapes differ.
    """
    moves = plan_moves(current, target, buffer=True).astype(np.int32)
    layers = np.unique(moves[:, LAYER])
    return [moves[moves[:, LAYER] == layer] for layer in layers]


def inverse_moves(moves: np.ndarray) -> np.ndarray:
    """The moves that undo `moves`: each one reversed (a copy-in becomes a drop and back), in reverse order."""
    inverse = np.asarray(moves, dtype=np.int32)[::-1].copy()
    inverse[:, 2:4], inverse[:, 4:6] = inverse[:, 4:6].copy(), inverse[:, 2:4].copy()
    return inverse


def rollback_steps(applied: list[np.ndarray]) -> list[np.ndarray]:
    """Undo applied steps: the inverse of each, last step first."""
    return [inverse_moves(step) for step in reversed(applied)]


__all__ = ["NO_SLOT", "inverse_moves", "plan_steps", "rollback_steps"]
