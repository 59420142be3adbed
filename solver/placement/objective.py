"""The placement objective of DESIGN.md, per layer (it separates by layer), for any placement.

    load = Σ_g (L_g − L̄)²            L_g = Σ_e (B_e / r_e) x_{e,g},  L̄ = Σ_e B_e / G
    comm = Σ_{s,e,g} (A_{s,e} / r_e) D_{s,g} x_{e,g}
    mig  = Σ_{e,g} M_{e,g} |x_{e,g} − x⁰_{e,g}|
    t    = Σ_{e,g} T_t[e,g] x_{e,g}          for each extra term t (`PlacementProblem.extra_terms`)
    total = w_load·load + w_comm·comm + w_mig·mig + Σ_t w_t·t

x is the host matrix and r_e = Σ_g x_{e,g} the copies of expert e: an engine spreads an expert's tokens
evenly over its replicas (vLLM's and SGLang's EPLB dispatch do), so each copy carries B_e / r_e tokens,
from every source in proportion. Without a current placement the migration term is 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from switchyard.solver.placement.problem import PlacementError, PlacementProblem, Weights, hosts_from_slots


@dataclass(frozen=True)
class Objective:
    """Per-layer terms [L] of one placement, and their weighted total."""

    load: np.ndarray
    comm: np.ndarray
    mig: np.ndarray
    weights: Weights
    #: extra term name → its per-layer value [L]
    extra: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def terms(self) -> dict[str, np.ndarray]:
        """Every term's per-layer value [L], by name, in the order the total sums them."""
        return {"load": self.load, "comm": self.comm, "mig": self.mig, **self.extra}

    @property
    def per_layer(self) -> np.ndarray:
        total = self.weights.load * self.load + self.weights.comm * self.comm + self.weights.mig * self.mig
        for name, value in self.extra.items():
            total = total + self.weights[name] * value
        return total

    @property
    def total(self) -> float:
        return float(self.per_layer.sum())

    def totals(self) -> dict[str, float]:
        """Each term summed over layers, and "total" (what a plan carries: `shared.schemas.ObjectiveTerms`)."""
        return {**{name: float(value.sum()) for name, value in self.terms.items()}, "total": self.total}


def gpu_loads(problem: PlacementProblem, hosts: np.ndarray) -> np.ndarray:
    """L[l, g]: tokens each GPU computes, each expert's load split evenly over its copies."""
    return np.einsum("le,leg->lg", problem.load / _copies(hosts), hosts)


def objective(problem: PlacementProblem, slot_map: np.ndarray) -> Objective:
    """The objective terms of a slot map [L, G, slots]."""
    return objective_of_hosts(problem, hosts_from_slots(np.asarray(slot_map), problem.num_experts))


def objective_of_hosts(problem: PlacementProblem, hosts: np.ndarray) -> Objective:
    """The objective terms of a host matrix [L, E, G]."""
    loads = gpu_loads(problem, hosts)
    mean = problem.load.sum(axis=1, keepdims=True) / problem.num_gpus
    load = ((loads - mean) ** 2).sum(axis=1)
    comm = np.einsum("leg,leg->l", problem.comm_cost(), hosts / _copies(hosts)[..., None])
    current = problem.current_hosts()
    mig = np.zeros(problem.num_layers)
    if current is not None:
        mig = (problem.migration_cost * np.abs(hosts - current)).sum(axis=(1, 2))
    extra = {name: np.einsum("leg,leg->l", cost, hosts) for name, cost in problem.extra_terms.items()}
    return Objective(load=load, comm=comm, mig=mig, weights=problem.weights, extra=extra)


def _copies(hosts: np.ndarray) -> np.ndarray:
    copies = hosts.sum(axis=2)
    if (copies == 0).any():
        layer, expert = np.argwhere(copies == 0)[0]
        raise PlacementError(f"layer {layer}: expert {expert} is not placed")
    return copies
