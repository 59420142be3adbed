"""Routing defaults, each with exactly one owner: this module.

The router's settings (`services.router.settings`), the ELDR fit (`solver.eldr_fit`), the simulators and the
benchmarks import these names rather than repeating the numbers, so a change here is a change everywhere.
"""

from __future__ import annotations

from switchyard.shared.schemas import RoutingArtifact

#: ELDR's band width τ (ELDR §4.3, Fig. 16): centroids within τ of the best similarity form the band. The
#: number itself is the wire contract's default for an artifact's τ (`shared.schemas.RoutingArtifact.tau`,
#: the lower layer), read from there so the two cannot disagree.
DEFAULT_TAU: float = RoutingArtifact.model_fields["tau"].default

#: A routing decision stops counting as in flight once a telemetry report received this long after it arrives
#: (the router's `SWITCHYARD_ROUTER_INFLIGHT_GRACE_S`; the DP simulator's dispatcher uses the same rule).
DEFAULT_INFLIGHT_GRACE_S = 0.05
