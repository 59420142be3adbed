"""Power of two choices: two distinct admitted engines drawn uniformly, the cheaper kept (the first on a tie).

Two draws from the state's generator per pick (none with one candidate)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouterState


@dataclass(frozen=True)
class PowerOfTwo:
    name: str = "power-of-two"
    needs: frozenset[str] = need()

    def pick(self, cost: np.ndarray | None, mask: np.ndarray, prefer: np.ndarray | None, state: RouterState) -> int:
        live = np.flatnonzero(mask)
        if len(live) == 1:
            return int(live[0])
        x, y = state.rng.integers(len(live), size=2)
        y = (x + 1 + y % (len(live) - 1)) % len(live)  # a second, distinct engine
        a, b = int(live[x]), int(live[y])
        if cost is None:
            return a
        return a if cost[a] <= cost[b] else b
