"""Dynamo's worker picker (`lib/kv-router/src/scheduling/selector/default.rs`): at temperature 0 the least cost,
ties uniformly at random; above 0 a softmax sample over the admitted costs normalised by their range,
``p_i ∝ exp(−(c_i − min) / ((max − min) · T))`` (uniform when all are equal). One draw from the state's
generator per random choice."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouterState


@dataclass(frozen=True)
class SoftmaxSample:
    temperature: float = 0.0
    name: str = "softmax"
    needs: frozenset[str] = need()

    def probabilities(self, cost: np.ndarray | None, mask: np.ndarray) -> np.ndarray:
        """float[D]: each engine's chance (0 off the mask); at temperature 0, uniform over the least."""
        values = np.where(mask, cost if cost is not None else 0.0, np.inf)
        admitted = values[mask]
        low, high = float(admitted.min()), float(admitted.max())
        p = np.zeros(len(mask))
        if self.temperature <= 0.0 or high == low:
            least = mask & (values == low) if self.temperature <= 0.0 else mask
            p[least] = 1.0
        else:
            p[mask] = np.exp(-(admitted - low) / ((high - low) * self.temperature))
        return p / p.sum()

    def pick(self, cost: np.ndarray | None, mask: np.ndarray, prefer: np.ndarray | None, state: RouterState) -> int:
        if self.temperature <= 0.0:
            values = np.where(mask, cost if cost is not None else 0.0, np.inf)
            ties = np.flatnonzero(values == values.min())
            return int(ties[0]) if len(ties) == 1 else int(ties[state.rng.integers(len(ties))])
        p = self.probabilities(cost, mask)
        return min(int(np.searchsorted(np.cumsum(p), state.rng.random(), side="left")), len(p) - 1)
