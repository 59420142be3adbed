"""Fairness between tenants while a fleet is saturated: what a request costs its tenant, and the order in which
queued requests leave. Pure (no I/O, no clock of its own), so the gateway (`services/gateway/flow.py`) and the
simulator (`simulator/offline/fairness.py`) run the very same policy.

Two named cost policies (`POLICIES`):

- `tokens`: weighted tokens, prompt + `output_weight` x expected output (a generated token costs a decode step,
  a prompt token a share of one prefill), as llm-d's flow control counts service.
- `expert-load`: weighted tokens x the request's expert footprint, the share of the model's routed experts its
  tokens touch (`footprint`: distinct experts per MoE layer over the experts per layer, mean over layers, read
  from its prefill signature). ELDR's premise: a decode step's time grows with the distinct experts the batch
  activates, so two tenants with equal tokens can cost the fleet very different amounts; a tenant whose
  requests keep to a few experts is charged less per token than one that touches them all. A request whose
  footprint is unknown is charged at 1 (every expert: exactly its weighted tokens), so on a dense fleet, or an
  engine that publishes no signatures, `expert-load` *is* `tokens`.

The footprint is known only after the request's prefill; the queue charges an estimate when the request
leaves (`Footprints.estimate`: the tenant's recent mean, else the fleet's, else 1) and the caller corrects the
tenant's attained service when the signature arrives (`FairQueue.charge`).

The order (`FairQueue.pop`): the highest band with anything queued; inside it, the tenant with the least
attained service (least-attained-service fairness), each tenant's requests first come first served. Service
is charged when a request leaves, so two tenants backlogged in one band stay within one request's cost of each
other. A tenant that starts queueing again is lifted to the least service among the band's queued tenants:
credit saved while idle cannot buy a burst.

Bounds: `max_queued` requests in all, `max_per_tenant` per tenant; a full queue sheds the newest request of the
lowest band below the newcomer's, else refuses the newcomer (lower bands are shed first). Attained service and
footprints are remembered for at most `max_tenants` tenants (the least recently seen idle ones forgotten
first), so thousands of tenant ids cost bounded memory.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = [
    "POLICIES",
    "FairQueue",
    "Footprints",
    "Full",
    "Policy",
    "Waiter",
    "footprint",
    "request_cost",
    "weighted_tokens",
]

Policy = Literal["tokens", "expert-load"]
POLICIES: tuple[Policy, ...] = ("tokens", "expert-load")


def weighted_tokens(prompt_tokens: int, output_tokens: int, output_weight: float) -> float:
    """Prompt + `output_weight` x output: the `tokens` policy's cost, and the `expert-load` one's basis."""
    return float(prompt_tokens) + output_weight * float(output_tokens)


def footprint(signature: np.ndarray) -> float:
    """A prefill signature's (`[L, E]` counts) share of the routed experts it touches: mean over layers of the
    distinct experts selected, over E. In (0, 1]; 1 for an empty signature (nothing known: every expert)."""
    counts = np.asarray(signature)
    if counts.ndim != 2 or counts.size == 0 or not counts.any():
        return 1.0
    return float(np.count_nonzero(counts, axis=1).mean() / counts.shape[1])


def request_cost(policy: Policy, weighted: float, share: float | None) -> float:
    """A request's charge: `weighted` tokens under `tokens`; times its footprint `share` (None: unknown, 1)
    under `expert-load`."""
    if policy == "tokens" or share is None:
        return weighted
    return weighted * share


class Footprints:
    """Each tenant's recent mean footprint (an exponential moving average over its signatures, weight `alpha`
    for the newest) and the fleet's, for the estimate charged before a request's own signature is known.
    At most `max_tenants` tenants, least recently updated forgotten first."""

    def __init__(self, max_tenants: int, alpha: float = 0.2) -> None:
        self.max_tenants, self.alpha = max_tenants, alpha
        self.tenants: OrderedDict[str, float] = OrderedDict()
        self.fleet: float | None = None

    def observe(self, tenant: str, share: float) -> None:
        a = self.alpha
        old = self.tenants.pop(tenant, None)
        self.tenants[tenant] = share if old is None else (1 - a) * old + a * share
        self.fleet = share if self.fleet is None else (1 - a) * self.fleet + a * share
        while len(self.tenants) > self.max_tenants:
            self.tenants.popitem(last=False)

    def estimate(self, tenant: str) -> float | None:
        """The tenant's mean, else the fleet's, else None (no signature seen: charge weighted tokens)."""
        share = self.tenants.get(tenant)
        return share if share is not None else self.fleet


@dataclass(eq=False, slots=True)
class Waiter:
    """One queued request; `ticket` is the caller's (the gateway keeps the request's future there)."""

    band: int
    tenant: str
    cost: float
    arrived: float
    ticket: Any = None
    queued: bool = field(default=False)


class Full(Exception):
    """The queue cannot take the request: `reason` is `queue_full` or `tenant_full`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class FairQueue:
    """Per band, per tenant FIFO queues; see the module docstring for the order and bounds."""

    def __init__(self, max_queued: int, max_per_tenant: int, max_tenants: int, bands: int = 3) -> None:
        self.max_queued, self.max_per_tenant, self.max_tenants = max_queued, max_per_tenant, max_tenants
        #: band -> tenant -> its queued requests (oldest first); a tenant with none queued leaves the band.
        self.bands: list[dict[str, deque[Waiter]]] = [{} for _ in range(bands)]
        self.depth = [0] * bands
        self.size = 0
        #: Service each tenant was charged, in the order tenants were last seen (oldest first).
        self.attained: dict[str, float] = {}
        self._per_tenant: dict[str, int] = {}

    def __len__(self) -> int:
        return self.size

    def push(self, waiter: Waiter) -> Waiter | None:
        """Queue `waiter`; returns the request shed to make room (a lower band's newest), if any. Raises `Full`."""
        if self._per_tenant.get(waiter.tenant, 0) >= self.max_per_tenant:
            raise Full("tenant_full")
        shed = None
        if self.size >= self.max_queued:
            shed = self._newest_below(waiter.band)
            if shed is None:
                raise Full("queue_full")
            self.remove(shed)
        band = self.bands[waiter.band]
        queue = band.get(waiter.tenant)
        if queue is None:  # the tenant starts queueing in this band: no credit saved while it was idle
            floor = min((self.attained.get(t, 0.0) for t in band), default=0.0)
            self._seen(waiter.tenant, max(self.attained.get(waiter.tenant, 0.0), floor))
            queue = band[waiter.tenant] = deque()
        queue.append(waiter)
        waiter.queued = True
        self.size += 1
        self.depth[waiter.band] += 1
        self._per_tenant[waiter.tenant] = self._per_tenant.get(waiter.tenant, 0) + 1
        return shed

    def pop(self) -> Waiter | None:
        """The next request to leave: highest band, least attained tenant, its oldest; charged to its tenant."""
        for band in reversed(self.bands):
            if band:
                attained = self.attained
                tenant = min(band, key=lambda t: attained.get(t, 0.0))
                waiter = band[tenant][0]
                self.remove(waiter)
                self._seen(tenant, attained.get(tenant, 0.0) + waiter.cost)
                return waiter
        return None

    def charge(self, tenant: str, delta: float) -> None:
        """Correct `tenant`'s attained service by `delta` (its request's real cost minus the estimate it was
        charged); a tenant already forgotten is not brought back."""
        if tenant in self.attained:
            self.attained[tenant] = max(0.0, self.attained[tenant] + delta)

    def remove(self, waiter: Waiter) -> None:
        """Take `waiter` out (it left: dispatched, shed, expired, or its client went); no-op if not queued."""
        if not waiter.queued:
            return
        band = self.bands[waiter.band]
        queue = band[waiter.tenant]
        queue.remove(waiter)  # usually the head: O(1); a disconnect mid-queue scans one tenant's requests
        if not queue:
            del band[waiter.tenant]
        waiter.queued = False
        self.size -= 1
        self.depth[waiter.band] -= 1
        left = self._per_tenant[waiter.tenant] - 1
        if left:
            self._per_tenant[waiter.tenant] = left
        else:
            del self._per_tenant[waiter.tenant]

    def expired(self, before: float) -> list[Waiter]:
        """Requests queued since before `before` (each tenant's are oldest first: only heads are looked at)."""
        old = []
        for band in self.bands:
            for queue in band.values():
                for waiter in queue:
                    if waiter.arrived >= before:
                        break
                    old.append(waiter)
        return old

    def _newest_below(self, band: int) -> Waiter | None:
        for lower in range(band):
            queues = self.bands[lower]
            if queues:
                return max((q[-1] for q in queues.values()), key=lambda w: w.arrived)
        return None

    def _seen(self, tenant: str, attained: float) -> None:
        """Record `tenant`'s service as most recently seen; past `max_tenants`, forget the longest-unseen idle."""
        self.attained.pop(tenant, None)
        self.attained[tenant] = attained
        if len(self.attained) > self.max_tenants:
            for old in list(self.attained):
                if old not in self._per_tenant and old != tenant:
                    del self.attained[old]
                    if len(self.attained) <= self.max_tenants:
                        break
