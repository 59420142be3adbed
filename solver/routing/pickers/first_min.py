"""The first admitted engine of least cost scanning from `state.scan_start` (wrapping), as vLLM's balancers
scan; from 0 it is Gimbal's argmin. `rotate`: the scan start moves on by one after each pick (vLLM main)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouterState


@dataclass(frozen=True)
class FirstMin:
    rotate: bool = False
    name: str = "first-min"
    needs: frozenset[str] = need()

    def pick(self, cost: np.ndarray | None, mask: np.ndarray, prefer: np.ndarray | None, state: RouterState) -> int:
        n = len(mask)
        values = cost if cost is not None else np.zeros(n)
        start = state.scan_start % n
        if start == 0:
            index = int(np.argmin(np.where(mask, values, np.inf)))
        else:
            scan = (start + np.arange(n)) % n
            index = int(scan[int(np.argmin(np.where(mask[scan], values[scan], np.inf)))])
        if self.rotate:
            state.scan_start = (start + 1) % n
        return index
