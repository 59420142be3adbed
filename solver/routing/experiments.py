"""Decode policies as the simulator, the report and the evidence name them: a router profile plus the
experiment-only options a simulation may set.

`eldr-vanilla` (ELDR over a vanilla K-means fit) and `eldr-tau0` (ELDR with τ = 0) are the ELDR profile with
options `fit="vanilla"` and `tau=0.0`; the simulator fits and builds its tables accordingly
(`simulator.offline.scenario`). The router has no such names (`profiles.decode_profile` refuses them): it
routes with the artifact it is given, whose fit and τ are the fit's business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from switchyard.solver.routing.framework import Profile
from switchyard.solver.routing.profiles import DECODE_PROFILES
from switchyard.solver.routing.query import Choice, RouteQuery, RouterState
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables

__all__ = ["DECODE_POLICIES", "DecodePolicy", "PolicyFn", "get_policy"]

PolicyFn = Callable[[FleetSnapshot, RouteQuery, RouterState, RoutingTables], Choice]


@dataclass(frozen=True)
class DecodePolicy:
    """A named simulation policy: its profile, and (ELDR) which fit the artifact comes from and a τ override."""

    name: str
    profile: Profile
    fit: str | None = None  # "balanced" | "vanilla": the K-means the artifact must come from
    tau: float | None = None  # overrides the artifact's τ
    doc: str = ""
    #: The decision function: the profile under this policy's options, unless replaced (tests spy on it).
    fn: PolicyFn | None = None
    #: (tables given, the same with this policy's τ): the override is built once per tables, not per request.
    _retau: list[tuple[RoutingTables, RoutingTables]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        # `dataclasses.replace` hands over the old policy's bound `_decide`: rebind it to this one's options.
        if self.fn is None or getattr(self.fn, "__func__", None) is DecodePolicy._decide:
            object.__setattr__(self, "fn", self._decide)

    @property
    def needs(self) -> frozenset[str]:
        return self.profile.needs

    def _decide(self, snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Choice:
        if self.tau is not None and tables.tau != self.tau:
            if not self._retau or self._retau[0][0] is not tables:
                self._retau[:] = [(tables, replace(tables, tau=self.tau))]
            tables = self._retau[0][1]
        return self.profile(snap, query, state, tables)

    def __call__(self, snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Choice:
        return self.fn(snap, query, state, tables)  # type: ignore[misc]


def _policies() -> dict[str, DecodePolicy]:
    eldr = DECODE_PROFILES["eldr"]
    plain = [
        DecodePolicy(p.name, p, fit="balanced" if p is eldr else None, doc=p.doc) for p in DECODE_PROFILES.values()
    ]
    variants = [
        DecodePolicy("eldr-vanilla", eldr, fit="vanilla", doc="τ-band over vanilla (unbalanced) K-means"),
        DecodePolicy("eldr-tau0", eldr, fit="balanced", tau=0.0, doc="nearest centroid only (τ = 0)"),
    ]
    return {p.name: p for p in (*plain, *variants)}


#: Every name a simulation accepts: the decode profiles, then the experiment variants.
DECODE_POLICIES: dict[str, DecodePolicy] = _policies()


def get_policy(name: str) -> DecodePolicy:
    try:
        return DECODE_POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown decode policy {name!r}; known: {', '.join(DECODE_POLICIES)}") from None
