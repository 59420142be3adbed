"""Small random placement instances shared by the placement tests (synthetic: unit tests of the method)."""

from __future__ import annotations

import numpy as np

from switchyard.solver.placement import PlacementProblem, Weights, contiguous_slots, locality_distance


def random_current(
    rng: np.random.Generator, num_layers: int, num_experts: int, num_gpus: int, slots: int
) -> np.ndarray:
    """A random complete slot map: a random permutation of experts laid out contiguously, slots shuffled."""
    base = contiguous_slots(num_layers, num_experts, num_gpus, slots)
    out = base.copy()
    for layer in range(num_layers):
        perm = rng.permutation(num_experts)
        out[layer] = np.where(base[layer] >= 0, perm[np.maximum(base[layer], 0)], -1)
        out[layer] = out[layer][:, rng.permutation(slots)]
    return out


def random_problem(
    rng: np.random.Generator,
    *,
    layers: int = 2,
    experts: int = 8,
    gpus: int = 4,
    sources: int = 2,
    spare_slots: int = 0,
    redundant: int = 0,
    migration: float = 0.05,
    weights: Weights | None = None,
) -> PlacementProblem:
    """Skewed source-aware counts, node locality, a random current placement (if migration > 0)."""
    slots = -(-(experts + redundant) // gpus) + spare_slots
    counts = rng.gamma(0.6, 1.0, (layers, sources, experts)) * rng.gamma(1.0, 1.0, (layers, 1, experts))
    distance = locality_distance(
        np.arange(sources) * min(sources, gpus) // sources, np.arange(gpus) * min(sources, gpus) // gpus
    )
    current = random_current(rng, layers, experts, gpus, slots) if migration > 0 else None
    return PlacementProblem.from_counts(
        counts,
        gpus,
        slots,
        distance=distance,
        current=current,
        migration_cost=migration,
        redundant_slots=redundant,
        weights=weights or Weights(),
    )
