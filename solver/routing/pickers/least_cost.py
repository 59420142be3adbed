"""The admitted engine of least cost. Ties: the highest preference (a band filter's, e.g. ELDR's similarity;
the first of equals), or without one, uniformly at random (one draw from the state's generator)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouterState


@dataclass(frozen=True)
class LeastCost:
    name: str = "least-cost"
    needs: frozenset[str] = need()

    def pick(self, cost: np.ndarray | None, mask: np.ndarray, prefer: np.ndarray | None, state: RouterState) -> int:
        masked = np.where(mask, cost if cost is not None else 0.0, np.inf)
        ties = np.flatnonzero(masked == masked.min())
        if len(ties) == 1:
            return int(ties[0])
        if prefer is not None:
            return int(ties[int(np.argmax(prefer.take(ties)))])
        return int(ties[state.rng.integers(len(ties))])
