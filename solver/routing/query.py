"""What a routing decision reads of its request and writes into its own state, and what it returns.

A decision (a `Profile` of filters, scorers and a picker: `solver.routing.framework`) reads

- `snap` (`FleetSnapshot`): per-engine load, KV usage, alive mask (and any other engine column);
- `query` (`RouteQuery`): what is known about the request (its similarity to each ELDR centroid, computed by
  `solver.scoring` from the prefill signature; its domain label, for the oracle baseline; its prompt tokens and
  what each engine holds cached; how well its predicted experts match each engine's recent ones);
- `state` (`RouterState`): the router's mutable state, explicit rather than global (round-robin cursor,
  random generator), one per router replica;
- `tables` (`RoutingTables`, `solver.routing.tables`): per-fleet lookup tables built once per change;

and returns a `Choice`. (The fused ELDR kernel is `solver.routing.eldr_kernel`.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

__all__ = ["Choice", "RouteQuery", "RouterState"]


@dataclass(frozen=True)
class RouteQuery:
    """What a routing decision may know about one request."""

    sims: np.ndarray | None = None  # [K] similarity of the request's signature to each centroid
    label: str | None = None  # domain label (oracle; only the Domain baseline reads it)
    prompt_tokens: int = 0
    #: [D] prompt tokens each engine holds cached (the prefix index's longest match, snapshot order); None when
    #: no index answered (no keys, no index): prefix scorers then see nothing cached anywhere.
    cached: np.ndarray | None = None
    #: [D] the request input ``expert_affinity`` (`solver.routing.affinity`: the predicted signature's centered
    #: cosine with each engine's recent traffic, snapshot order); None: no prediction, pressure alone.
    affinity: np.ndarray | None = None


class Choice(NamedTuple):
    """One pick (a tuple: built on every request, a frozen dataclass costs twice as much to make)."""

    index: int  # type: ignore[assignment]  # into the snapshot's engines (shadows tuple.index, unused here)
    band_size: int = 0  # engines the band filter admitted (0 for load-only profiles)
    fallback: str | None = None


@dataclass
class RouterState:
    """Mutable per-router state: cursors and the generator for random choices."""

    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    rr_next: int = 0  # round robin: the next engine to try
    scan_start: int = 0  # first-minimum scans start here (vLLM's rules)

    @classmethod
    def seeded(cls, seed: int) -> RouterState:
        return cls(rng=np.random.default_rng(seed))
