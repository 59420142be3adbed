"""Round robin: the first admitted engine at or after `state.rr_next` (wrapping); ignores cost."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouterState


@dataclass(frozen=True)
class RoundRobin:
    name: str = "round-robin"
    needs: frozenset[str] = need()

    def pick(self, cost: np.ndarray | None, mask: np.ndarray, prefer: np.ndarray | None, state: RouterState) -> int:
        d = len(mask)
        for step in range(d):
            i = (state.rr_next + step) % d
            if mask[i]:
                state.rr_next = i + 1
                return i
        raise LookupError(f"no admitted engine among {d}")
