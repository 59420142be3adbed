"""Uniformly at random among the admitted engines (one draw from the state's generator); ignores cost."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouterState


@dataclass(frozen=True)
class RandomPick:
    name: str = "random"
    needs: frozenset[str] = need()

    def pick(self, cost: np.ndarray | None, mask: np.ndarray, prefer: np.ndarray | None, state: RouterState) -> int:
        live = np.flatnonzero(mask)
        return int(live[state.rng.integers(len(live))])
