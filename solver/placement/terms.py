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

import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np

from switchyard.shared.placement_terms import BUILTIN_TERMS, RESERVED_NAMES, TERM_NAME_PATTERN, default_weight

if TYPE_CHECKING:
    from switchyard.solver.placement.problem import PlacementProblem


class Weights(Mapping[str, float]):
    """Objective weight of each term, by name: `Weights(load=50, hot=2)` or `Weights({"load": 50})`.

    Terms not given take `shared.placement_terms.default_weight` (load 50, comm 1, mig 1, others 1). They only
    matter relative to each other and to the units of B, A and M. In the canonical units of
    `PlacementProblem.from_counts` (mean GPU load = 1) the marginal cost of moving load off a GPU that is
    a fraction δ above the mean is 2·δ·w_load, against w_comm for making the same load remote: balance and
    locality are priced equally at δ* = w_comm / (2·w_load). The default, 50, puts δ* at 1 %: balance
    first (an MoE layer waits for its slowest GPU), locality wherever it costs less than 1 % of balance.
    With all three weights at 1 the objective is DESIGN.md's formula literally (δ* = 50 %).
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, float] | None = None, /, **named: float) -> None:
        merged = {name: default_weight(name) for name in BUILTIN_TERMS}
        merged.update(values or {})
        merged.update(named)
        check_term_map(merged, "weight")
        self._values = {name: float(value) for name, value in merged.items()}

    def __getitem__(self, name: str) -> float:
        return self._values[name] if name in self._values else default_weight(name)

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    def __hash__(self) -> int:
        return hash(frozenset(self._values.items()))

    def __repr__(self) -> str:
        return f"Weights({self._values})"

    @property
    def load(self) -> float:
        return self["load"]

    @property
    def comm(self) -> float:
        return self["comm"]

    @property
    def mig(self) -> float:
        return self["mig"]


def check_term_map(values: Mapping[str, float], what: str) -> None:
    """Refuse term names that are not identifiers and values that are not finite and >= 0 (a negative
    weight rewards the cost it weighs)."""
    from switchyard.solver.placement.problem import PlacementError

    for name, value in values.items():
        if not isinstance(name, str) or not re.match(TERM_NAME_PATTERN, name) or name in RESERVED_NAMES:
            raise PlacementError(f"{what} name {name!r} is not a term name")
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise PlacementError(f"{what} {name} must be a number, got {value!r}")
        if not np.isfinite(value) or value < 0:
            raise PlacementError(f"{what} {name} must be finite and >= 0, got {value}")


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
    return {"mig": float((problem.migration_cost[layer] * current[layer]).sum())}
