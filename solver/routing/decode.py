"""Decode-routing policies: which decode engine takes a request at the prefill→decode handoff.

Every policy is a pure function ``policy(snap, query, state, tables) -> Decision`` over

- `snap` (`FleetSnapshot`): per-engine load, KV usage, alive mask;
- `query` (`RouteQuery`): what is known about the request (its similarity to each ELDR centroid, computed by
  `solver.scoring` from the prefill signature; its domain label, for the oracle baseline);
- `state` (`RouterState`): the router's mutable state, explicit rather than global (round-robin cursor,
  random generator), one per router replica;
- `tables` (`RoutingTables`): per-snapshot lookup tables built once per change (centroid → engines for
  ELDR, label → engines for Domain).

Each `DecodePolicy` declares the inputs it reads (`needs`), so a router only computes what is used (no
signature scoring for JSQ). The simulator and the router service both use `DECODE_POLICIES` unchanged.

ELDR (seed 000): a *filter* and a *picker*. The filter keeps the band of centroids whose similarity is
within τ of the best, ``{k : sim_k ≥ max_j sim_j − τ}``, and the live engines serving them; the picker takes
the least-loaded engine of the band (ties: the engine whose centroid is most similar). If the band has no
live engine the request goes to the least-loaded live engine (``fallback="band_empty"``); a request without
a signature likewise (``fallback="no_signature"``).

Centroid → engine mapping (`centroid_members`):

- the artifact names `decoder_ids` (one per centroid): centroid k is served by the engine of that id. An
  engine the artifact does not name (added after the fit) serves every band, so new capacity takes traffic
  at once (it is then picked only when it is the least loaded); a named engine that is dead or gone leaves
  its centroid's band to the band's other members.
- no `decoder_ids`: centroids and engines (sorted ids) are paired modulo the smaller count: with D ≥ K
  decoders, engine j serves centroid ``j mod K``; with D < K, centroid k is served by engine ``k mod D``.
  Equal counts give the identity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from switchyard.solver.routing.snapshot import FleetSnapshot

__all__ = [
    "DECODE_POLICIES",
    "DEFAULT_TAU",
    "Decision",
    "DecodePolicy",
    "RouteQuery",
    "RouterState",
    "RoutingTables",
    "centroid_members",
    "domain_partition",
    "get_policy",
]

#: The seed's default band width (ELDR §4.3, Fig. 16).
DEFAULT_TAU = 0.1


@dataclass(frozen=True)
class RouteQuery:
    """What a policy may know about one request."""

    sims: np.ndarray | None = None  # [K] similarity of the request's signature to each centroid
    label: str | None = None  # domain label (oracle; only the Domain baseline reads it)
    prompt_tokens: int = 0


@dataclass(frozen=True)
class Decision:
    index: int  # into the snapshot's engines
    band_size: int = 0  # engines the filter admitted (0 for load-only policies)
    fallback: str | None = None


@dataclass
class RouterState:
    """Mutable per-router state: the round-robin cursor and the generator for random choices."""

    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    rr_next: int = 0

    @classmethod
    def seeded(cls, seed: int) -> RouterState:
        return cls(rng=np.random.default_rng(seed))


@dataclass(frozen=True)
class RoutingTables:
    """Lookup tables derived from a snapshot's engine list (rebuild when the engine list changes).

    - `members[K, D]`: engine j serves centroid k (see `centroid_members`); None without an artifact.
    - `engine_centroid[D]`: when every engine serves exactly one centroid, that centroid (a gather then
      replaces a [K, D] reduction on the request path); else None.
    - `domains`: label → bool[D] engines of that label's partition (see `domain_partition`).
    - `tau`: the ELDR band width.
    """

    members: np.ndarray | None = None
    domains: Mapping[str, np.ndarray] = field(default_factory=dict)
    tau: float = DEFAULT_TAU
    engine_centroid: np.ndarray | None = None
    #: `engine_centroid` as a tuple of ints, for the ELDR pick's per-engine loop.
    centroid_of: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.engine_centroid is not None:
            object.__setattr__(self, "centroid_of", tuple(int(k) for k in self.engine_centroid))

    @classmethod
    def build(
        cls,
        engine_ids: Sequence[str],
        num_centroids: int = 0,
        decoder_ids: Sequence[str] | None = None,
        tau: float = DEFAULT_TAU,
        label_shares: Mapping[str, float] | None = None,
        unnamed_serve_all: bool = True,
    ) -> RoutingTables:
        """Tables for the engines of a snapshot (sorted ids), an artifact's centroids, and label shares."""
        members = centroid_members(num_centroids, engine_ids, decoder_ids, unnamed_serve_all) if num_centroids else None
        engine_centroid = None
        if members is not None and len(engine_ids) and (members.sum(axis=0) == 1).all():
            engine_centroid = np.argmax(members, axis=0)
        domains = domain_partition(label_shares, engine_ids) if label_shares else {}
        return cls(members=members, domains=domains, tau=tau, engine_centroid=engine_centroid)


PolicyFn = Callable[[FleetSnapshot, RouteQuery, RouterState, RoutingTables], Decision]


@dataclass(frozen=True)
class DecodePolicy:
    """A named policy: its function, the inputs it reads, and (ELDR variants) which fit and τ it uses."""

    name: str
    fn: PolicyFn
    needs: frozenset[str]
    fit: str | None = None  # "balanced" | "vanilla": the K-means the artifact must come from
    tau: float | None = None  # overrides the artifact's τ
    doc: str = ""

    def __call__(self, snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Decision:
        return self.fn(snap, query, state, tables)


# -- mapping helpers (pure; the router service reuses them) ---------------------------------------------------


def centroid_members(
    num_centroids: int,
    engine_ids: Sequence[str],
    decoder_ids: Sequence[str] | None = None,
    unnamed_serve_all: bool = True,
) -> np.ndarray:
    """bool[K, D]: engine j serves centroid k. `engine_ids` in snapshot (sorted) order; rules in the module doc.

    `unnamed_serve_all=False`: an engine the artifact does not name serves no band (it takes a request only
    when the band has no live engine). The router service does this unless configured otherwise: on a bus
    where anyone could say hello, a phantom decoder reporting no load drew 555 of 600 requests.
    """
    k, d = num_centroids, len(engine_ids)
    if k <= 0 or d == 0:
        return np.zeros((max(k, 0), d), dtype=bool)
    if decoder_ids is not None:
        if len(decoder_ids) != k:
            raise ValueError(f"{len(decoder_ids)} decoder ids for {k} centroids")
        eng = np.asarray(list(engine_ids), dtype=object)
        members = np.asarray(list(decoder_ids), dtype=object)[:, None] == eng[None, :]
        named = members.any(axis=0)
        members[:, ~named] = unnamed_serve_all  # engines the artifact does not know: every band, or none
        return members
    ks = np.arange(k)[:, None]
    js = np.arange(d)[None, :]
    return (ks % d == js) if k > d else (js % k == ks)


def domain_partition(label_shares: Mapping[str, float], engine_ids: Sequence[str]) -> dict[str, np.ndarray]:
    """Split decoders among domain labels in proportion to each label's traffic share (oracle baseline).

    Largest-remainder apportionment with at least one engine per label; engines are handed out in sorted
    order, labels in sorted order. With fewer engines than labels, labels share engines round robin.
    """
    labels = sorted(label_shares)
    d = len(engine_ids)
    if not labels or d == 0:
        return {}
    if d < len(labels):
        return {lab: np.arange(d) == (i % d) for i, lab in enumerate(labels)}
    shares = np.array([max(float(label_shares[lab]), 0.0) for lab in labels])
    shares = shares / shares.sum() if shares.sum() > 0 else np.full(len(labels), 1 / len(labels))
    counts = np.ones(len(labels), dtype=np.int64)
    spare = d - len(labels)
    quota = shares * d - counts
    extra = np.floor(np.clip(quota, 0, None)).astype(np.int64)
    while extra.sum() > spare:  # floor of clipped quotas can exceed the spare engines; trim largest
        extra[np.argmax(extra)] -= 1
    counts += extra
    remainder = quota - extra
    for i in np.argsort(-remainder, kind="stable")[: d - counts.sum()]:
        counts[i] += 1
    bounds = np.concatenate([[0], np.cumsum(counts)])
    idx = np.arange(d)
    return {lab: (idx >= bounds[i]) & (idx < bounds[i + 1]) for i, lab in enumerate(labels)}


# -- pickers ---------------------------------------------------------------------------------------------


def _least_loaded(snap: FleetSnapshot, mask: np.ndarray, state: RouterState) -> int:
    """Least-loaded engine under `mask` (ties broken at random). Caller guarantees mask.any()."""
    load = np.where(mask, snap.load, np.inf)
    ties = np.flatnonzero(load == load.min())
    return int(ties[0]) if len(ties) == 1 else int(ties[state.rng.integers(len(ties))])


def _no_engine(snap: FleetSnapshot) -> Decision:
    raise LookupError(f"no live decode engine among {snap.size}")


# -- policies ---------------------------------------------------------------------------------------------


def route_random(snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Decision:
    live = np.flatnonzero(snap.alive)
    if len(live) == 0:
        return _no_engine(snap)
    return Decision(int(live[state.rng.integers(len(live))]))


def route_round_robin(snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Decision:
    d = snap.size
    for step in range(d):
        i = (state.rr_next + step) % d
        if snap.alive[i]:
            state.rr_next = i + 1
            return Decision(i)
    return _no_engine(snap)


def route_jsq(snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Decision:
    if not snap.alive.any():
        return _no_engine(snap)
    return Decision(_least_loaded(snap, snap.alive, state))


def route_p2c(snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Decision:
    live = np.flatnonzero(snap.alive)
    if len(live) == 0:
        return _no_engine(snap)
    if len(live) == 1:
        return Decision(int(live[0]))
    x, y = state.rng.integers(len(live), size=2)
    y = (x + 1 + y % (len(live) - 1)) % len(live)  # a second, distinct engine
    a, b = int(live[x]), int(live[y])
    return Decision(a if snap.load[a] <= snap.load[b] else b)


def route_domain(snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Decision:
    """Oracle Domain: least loaded among the engines of the request's label partition."""
    if not snap.alive.any():
        return _no_engine(snap)
    part = tables.domains.get(query.label) if query.label is not None else None
    if part is None:
        return Decision(_least_loaded(snap, snap.alive, state), fallback="no_label")
    mask = part & snap.alive
    if not mask.any():
        return Decision(_least_loaded(snap, snap.alive, state), fallback="band_empty")
    return Decision(_least_loaded(snap, mask, state), band_size=int(mask.sum()))


#: Up to this many engines the ELDR pick is one Python pass over the engines; beyond, numpy over arrays. For
#: small fleets the pass costs less than the dozen numpy calls (far less when the caches are cold, as on a
#: router woken by each request); both give the same pick (tests/test_routing_decode.py).
LOOP_MAX_ENGINES = 64


def _eldr_loop(snap: FleetSnapshot, sims: np.ndarray, centroid_of: tuple[int, ...], tau: float) -> Decision | None:
    # The threshold exactly as the array path compares it, in the similarities' dtype (as a double, exactly).
    threshold = float(sims.dtype.type(sims.max() - tau))
    sim, alive, load = sims.tolist(), snap.alive.tolist(), snap.load.tolist()
    band, best, best_load, best_sim = 0, -1, math.inf, -math.inf
    for i, k in enumerate(centroid_of):
        if alive[i] and sim[k] >= threshold:
            band += 1
            if load[i] < best_load or (load[i] == best_load and sim[k] > best_sim):
                best, best_load, best_sim = i, load[i], sim[k]
    return Decision(best, band_size=band) if best_load != math.inf else None


def _eldr_arrays(snap: FleetSnapshot, sims: np.ndarray, tables: RoutingTables, tau: float) -> Decision | None:
    # An engine is in the band iff its most similar centroid is: one gather (or [K, D] max) gives both the
    # band and the tie-break key.
    if tables.engine_centroid is not None:
        engine_sim = sims.take(tables.engine_centroid)
    else:
        engine_sim = np.where(tables.members, sims[:, None], -np.inf).max(axis=0)
    mask = engine_sim >= sims.max() - tau
    mask &= snap.alive
    band = mask.nonzero()[0]
    loads = snap.load.take(band).tolist()
    best = min(loads, default=math.inf)
    if best == math.inf:
        return None
    ties = [k for k, load in enumerate(loads) if load == best]
    if len(ties) > 1:  # the most similar of the least loaded (the first of equals)
        band_sims = engine_sim.take(band).tolist()
        ties = [max(ties, key=band_sims.__getitem__)]
    return Decision(int(band[ties[0]]), band_size=len(band))


def _eldr(snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables, tau: float) -> Decision:
    sims = query.sims
    if sims is None or tables.members is None:
        return replace(route_jsq(snap, query, state, tables), fallback="no_signature")
    if tables.centroid_of is not None and snap.size <= LOOP_MAX_ENGINES:
        decision = _eldr_loop(snap, sims, tables.centroid_of, tau)
    else:
        decision = _eldr_arrays(snap, sims, tables, tau)
    if decision is None:  # no live engine in the band (or none with a finite load)
        return replace(route_jsq(snap, query, state, tables), fallback="band_empty")
    return decision


def route_eldr(snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Decision:
    return _eldr(snap, query, state, tables, tables.tau)


def route_eldr_tau0(snap: FleetSnapshot, query: RouteQuery, state: RouterState, tables: RoutingTables) -> Decision:
    return _eldr(snap, query, state, tables, 0.0)


_LOAD = frozenset({"load", "alive"})
_ELDR = frozenset({"load", "alive", "similarity"})

DECODE_POLICIES: dict[str, DecodePolicy] = {
    p.name: p
    for p in (
        DecodePolicy("random", route_random, frozenset({"alive"}), doc="uniform over live engines"),
        DecodePolicy("rr", route_round_robin, frozenset({"alive"}), doc="round robin over live engines"),
        DecodePolicy("jsq", route_jsq, _LOAD, doc="join the shortest queue (least load)"),
        DecodePolicy("p2c", route_p2c, _LOAD, doc="power of two choices"),
        DecodePolicy(
            "domain", route_domain, _LOAD | {"label"}, doc="oracle: least loaded in the label's engine partition"
        ),
        DecodePolicy("eldr", route_eldr, _ELDR, fit="balanced", doc="τ-band over balanced K-means centroids"),
        DecodePolicy("eldr-vanilla", route_eldr, _ELDR, fit="vanilla", doc="τ-band over vanilla (unbalanced) K-means"),
        DecodePolicy("eldr-tau0", route_eldr_tau0, _ELDR, fit="balanced", tau=0.0, doc="nearest centroid only (τ = 0)"),
    )
}


def get_policy(name: str) -> DecodePolicy:
    try:
        return DECODE_POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown decode policy {name!r}; known: {', '.join(DECODE_POLICIES)}") from None
