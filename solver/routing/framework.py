"""Routing as a framework: filters, scorers and a picker, composed into a named `Profile`.

One decision, for decode routing (`sy.route.decode`) and data-parallel dispatch (`sy.route.dp`) alike:

1. **Filters** narrow the candidates: each returns a boolean mask over the engines (`Admission`). A hard
   filter (liveness) that leaves nothing means no engine can take the request (`LookupError`); a relaxable
   one (ELDR's τ band, the Domain partition) that leaves nothing is skipped and the decision says so
   (``fallback="band_empty"``). A filter that cannot apply to this request (no signature) is skipped with
   its reason. A *band* filter also reports its size and may hand the picker a preference for ties.
2. **Scorers** turn engine columns into per-engine costs, lower is better, summed with weights (Dynamo's
   kv-router sums lower-is-better costs the same way). A weight of 1 is applied without a multiplication, and
   terms are added in the profile's order, so a profile reproduces a hand-written formula bit for bit.
3. A **picker** chooses one admitted engine from the summed cost (least cost with a tie rule, power of two
   choices, round robin, random).

Every part declares what it reads (`needs`) by registry name (`shared.signals`): engine signals (``load``,
``kv_usage``, ``alive``, or any other column of the `FleetSnapshot`, e.g. ``remaining_prefill``) and request
inputs (``similarity``, ``label``, ``prompt_tokens``), written ``needs = need("kv_usage")`` so that an unknown
name fails at import; a profile checks its parts' needs again when it is built. A profile's `needs` is their
union, so a caller computes only what is used: no signature scoring for JSQ, no prefill columns for vLLM's rule.

Costs are checked finite before the picker sees them, over the admitted engines: +inf means *excluded* (the
engine leaves the admitted set; none left is `no_engine`), and NaN or -inf is a scorer's error
(`NonFiniteCost`, naming the profile, the scorers and the engines). When all is finite this costs one sum.

Parts are small frozen objects with pure methods over numpy columns; the mutable state a picker needs (the
round-robin cursor, the random generator) is the caller's `RouterState`. A profile may carry a *kernel*: a
fused implementation of exactly its default composition (ELDR's per-engine loop for small fleets), which it
runs first and which may decline (return None) so the composition decides. Re-weighting drops the kernel.
Named profiles are in `solver.routing.profiles`; docs/architecture.md shows how to add a scorer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from switchyard.shared.signals import REQUEST_INPUTS as _REQUEST_INPUTS
from switchyard.shared.signals import SIGNALS, UnknownSignal
from switchyard.solver.routing.query import Choice, RouteQuery, RouterState
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables

__all__ = [
    "Admission",
    "Filter",
    "Kernel",
    "NonFiniteCost",
    "Picker",
    "Profile",
    "Scorer",
    "Weighted",
    "no_engine",
]

_SUM = np.add.reduce  # finite iff every term is; the method lookup of `cost.sum()` costs more

#: Request inputs a part may need (`shared.signals.REQUEST_INPUTS`; anything else in `needs` is a signal).
REQUEST_INPUTS = frozenset(_REQUEST_INPUTS)


class Admission(NamedTuple):
    """A filter's answer: the engines it admits, or None with the reason it could not apply."""

    mask: np.ndarray | None  # bool[D]
    fallback: str | None = None
    prefer: np.ndarray | None = None  # float[D]: among equal costs, the picker takes the highest (band filters)


# The parts are frozen dataclasses: their attributes are read-only, so the protocols declare them as properties.


@runtime_checkable
class Filter(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def needs(self) -> frozenset[str]: ...
    @property
    def relaxable(self) -> bool:  # leaving no engine skips the filter (fallback "band_empty") instead of failing
        ...
    @property
    def band(self) -> bool:  # the admitted count is the decision's band_size
        ...

    def admit(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> Admission: ...


@runtime_checkable
class Scorer(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def needs(self) -> frozenset[str]: ...

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        """float[D], lower is better; the caller must not write into it (it may be a snapshot column)."""
        ...


@runtime_checkable
class Picker(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def needs(self) -> frozenset[str]: ...

    def pick(self, cost: np.ndarray | None, mask: np.ndarray, prefer: np.ndarray | None, state: RouterState) -> int: ...


Kernel = Callable[[FleetSnapshot, RouteQuery, RouterState, RoutingTables], Choice | None]


class Weighted(NamedTuple):
    scorer: Scorer
    weight: float


def no_engine(snap: FleetSnapshot) -> LookupError:
    return LookupError(f"no live engine among {snap.size}")


class NonFiniteCost(ValueError):
    """A profile's summed cost is NaN or -inf on an admitted engine: a scorer's error, never a choice."""


@dataclass(frozen=True)
class Profile:
    """A named composition: filters in order, weighted scorers summed, one picker."""

    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[Weighted, ...]
    picker: Picker
    kernel: Kernel | None = field(default=None, compare=False)
    doc: str = ""

    def __post_init__(self) -> None:
        """Every part's needs are registry names (`shared.signals`): checked once, when the profile is built."""
        for part in self._parts():
            unknown = sorted(n for n in part.needs if n not in SIGNALS and n not in REQUEST_INPUTS)
            if unknown:
                raise UnknownSignal(
                    f"profile {self.name!r}: part {part.name!r} needs {', '.join(map(repr, unknown))}, not in the "
                    "signal registry (shared/signals.py); declare needs with shared.signals.need(...)"
                )

    def _parts(self) -> tuple[Filter | Scorer | Picker, ...]:
        return (*self.filters, *(w.scorer for w in self.scorers), self.picker)

    @cached_property
    def needs(self) -> frozenset[str]:
        return frozenset().union(*(p.needs for p in self._parts()))

    @cached_property
    def columns(self) -> frozenset[str]:
        """The engine columns the profile reads (its needs less the request inputs)."""
        return self.needs - REQUEST_INPUTS

    @property
    def weights(self) -> dict[str, float]:
        return {w.scorer.name: w.weight for w in self.scorers}

    def weighted(self, weights: Mapping[str, float]) -> Profile:
        """The same profile with some scorers re-weighted (by scorer name); unknown names are an error.

        Any change drops the kernel (it fuses the default weights); a weight of 0 removes the scorer, and so
        its needs."""
        known = self.weights
        unknown = sorted(set(weights) - set(known))
        if unknown:
            raise ValueError(
                f"profile {self.name!r} has no scorer {', '.join(map(repr, unknown))}; its scorers: {', '.join(known)}"
            )
        if all(float(weights[n]) == known[n] for n in weights):
            return self
        scorers = tuple(
            Weighted(w.scorer, float(weights.get(w.scorer.name, w.weight)))
            for w in self.scorers
            if float(weights.get(w.scorer.name, w.weight)) != 0.0
        )
        return replace(self, scorers=scorers, kernel=None)

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray | None:
        """Σ weight·cost over the scorers, in order (None without scorers)."""
        total: np.ndarray | None = None
        for scorer, weight in self.scorers:
            term = scorer.cost(snap, query, tables)
            if weight != 1.0:
                term = weight * term
            total = term if total is None else total + term
        return total

    def __call__(self, snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Choice:
        if self.kernel is not None:
            decision = self.kernel(snap, query, state, tables)
            if decision is not None:
                return decision
        return self.compose(snap, query, state, tables)

    decide = __call__

    def compose(self, snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Choice:
        """The decision by definition: filters, then the summed cost, then the picker."""
        mask: np.ndarray | None = None
        prefer: np.ndarray | None = None
        fallback: str | None = None
        band = 0
        for f in self.filters:
            admitted, why, preference = f.admit(snap, query, tables)
            if admitted is None:
                fallback = fallback or why
                continue
            narrowed = admitted if mask is None else mask & admitted
            if not narrowed.any():
                if not f.relaxable:
                    raise no_engine(snap)
                fallback = fallback or "band_empty"
                continue
            mask = narrowed
            if f.band:
                band, prefer = int(np.count_nonzero(narrowed)), preference
        if mask is None:
            mask = np.ones(snap.size, dtype=bool)
            if snap.size == 0:
                raise no_engine(snap)
        cost = self.cost(snap, query, tables)
        if cost is not None and not math.isfinite(_SUM(cost)):  # a finite sum: every cost finite (~0.6 µs)
            mask = self._finite(cost, mask, snap, query, tables)
        index = self.picker.pick(cost, mask, prefer, state)
        return Choice(index, band_size=band, fallback=fallback)

    def _finite(
        self, cost: np.ndarray, mask: np.ndarray, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables
    ) -> np.ndarray:
        """The admitted engines less those of cost +inf (excluded); NaN or -inf on an admitted engine raises
        `NonFiniteCost` naming the scorers that gave it. Off the fast path: only when some cost is not finite."""
        wrong = mask & (np.isnan(cost) | (cost == -np.inf))
        if wrong.any():
            engines = [snap.engine_ids[i] for i in np.flatnonzero(wrong)]
            culprits = [
                w.scorer.name
                for w in self.scorers
                if not np.all(np.isfinite(np.asarray(w.scorer.cost(snap, query, tables))[wrong]))
            ]
            raise NonFiniteCost(
                f"profile {self.name!r}: cost NaN or -inf on engine(s) {', '.join(engines)}"
                f" from scorer(s) {', '.join(culprits) or '(the weighted sum)'}"
            )
        admitted = mask & (cost != np.inf)
        if not admitted.any():
            raise no_engine(snap)
        return admitted
