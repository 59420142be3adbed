"""The one table builder: per-fleet lookup tables the routing parts read (centroid → engine membership for
ELDR's τ band, label → engine partition for the oracle Domain baseline).

Built once per change of the engine list or the artifact, never per request, by the router
(`services.router.core`), the simulator (`simulator.offline.scenario`) and the benchmarks alike.

Centroid → engine mapping (`centroid_members`):

- the artifact names `decoder_ids` (one per centroid): centroid k is served by the engine of that id. An
  engine the artifact does not name (added after the fit) serves every band (`unnamed_serve_all`), so new
  capacity takes traffic at once (it is then picked only when it is the least loaded), or no band; a named
  engine that is dead or gone leaves its centroid's band to the band's other members.
- no `decoder_ids`: centroids and engines (sorted ids) are paired modulo the smaller count: with D ≥ K
  decoders, engine j serves centroid ``j mod K``; with D < K, centroid k is served by engine ``k mod D``.
  Equal counts give the identity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from switchyard.solver.routing.defaults import DEFAULT_TAU

__all__ = ["RoutingTables", "centroid_members", "domain_partition"]


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
    #: `engine_centroid` as a tuple of ints, for the ELDR kernel's per-engine loop.
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
