"""The linear part of the placement objective, built once from named terms and weights.

Per layer the objective is w_load·load(x) + Σ_t w_t·(Σ_{e,g} T_t[e, g]·x[e, g] + c_t): the load term is
quadratic in the host matrix x and every other term is linear in it once each expert's copy count r_e is
fixed (which the greedy, the swap refinement and the MINLP all do). `linear_terms` builds each linear
term's cost of one copy, T_t[L, E, G], and `linear_cost` weighs and sums them; the greedy (times its
multipliers), the refinement and the MINLP all call these two, so a term is defined in one place.

Built-in linear terms (shapes: L layers, E experts, G GPUs, S source DP ranks):

    comm:  T = C[l, e, g] / r[l, e]        C = Σ_s A[l, s, e]·D[s, g]  (an expert's traffic splits over its copies)
    mig:   T = M[l, e, g]·(1 − 2·x⁰)       c = Σ_{e,g} M·x⁰             (= M·|x − x⁰| for binary x)

Any other term is `PlacementProblem.extra_terms[name]`: the cost of hosting one copy of expert e on GPU g,
broadcastable to [L, E, G], weighted by `Weights[name]` (docs/architecture.md, "How to add a placement
objective term").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from switchyard.solver.placement.problem import PlacementProblem


def linear_cost(terms: Mapping[str, np.ndarray], weights: Mapping[str, float]) -> np.ndarray:
    """The weighted linear cost of one copy: Σ_t weights[t]·terms[t], summed in the order of `terms`.

    terms:   name → T_t, each [L, E, G] or broadcastable to it: the cost of hosting one copy of expert e
             on GPU g (see `linear_terms`)
    weights: name → w_t >= 0, one for every name in `terms`
    returns: [L, E, G] float64 (the broadcast of the terms' shapes)
    """
    total: np.ndarray | None = None
    for name, cost in terms.items():
        part = weights[name] * np.asarray(cost, dtype=np.float64)
        total = part if total is None else total + part
    if total is None:
        raise ValueError("linear_cost needs at least one term")
    return total


def linear_terms(problem: PlacementProblem, copies: np.ndarray) -> dict[str, np.ndarray]:
    """The linear terms of `problem` for fixed copy counts: name → T[L, E, G] (or broadcastable to it).

    problem: its comm_cost() C[L, E, G], migration_cost M[L, E, G], current layout x⁰ and extra_terms
    copies:  r[L, E] >= 1, copies of each expert
    returns: `comm` always (zeros without source counts), `mig` when there is a current layout, then every
             extra term in the problem's order
    """
    terms = {"comm": problem.comm_cost() / copies[..., None]}
    current = problem.current_hosts()
    if current is not None:
        terms["mig"] = problem.migration_cost * (1 - 2 * current)
    terms.update(problem.extra_terms)
    return terms


def linear_constants(problem: PlacementProblem, layer: int) -> dict[str, float]:
    """The constants c_t of one layer that make the linear terms equal the objective's: mig's Σ M·x⁰."""
    current = problem.current_hosts()
    if current is None:
        return {}
    return {"mig": float((problem.mig[layer] * current[layer]).sum())}
