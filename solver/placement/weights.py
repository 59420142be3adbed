"""Objective weights by term name, and the check every term map passes (names are identifiers, values finite
and >= 0). Apart from `terms.py` so that the problem definition can use them without importing the term
builders, which take a problem."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import numpy as np

from switchyard.shared.placement_terms import BUILTIN_TERMS, RESERVED_NAMES, TERM_NAME_PATTERN, default_weight
from switchyard.solver.placement.errors import PlacementError

__all__ = ["Weights", "check_term_map"]


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
    for name, value in values.items():
        if not isinstance(name, str) or not re.match(TERM_NAME_PATTERN, name) or name in RESERVED_NAMES:
            raise PlacementError(f"{what} name {name!r} is not a term name")
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise PlacementError(f"{what} {name} must be a number, got {value!r}")
        if not np.isfinite(value) or value < 0:
            raise PlacementError(f"{what} {name} must be finite and >= 0, got {value}")
