"""Who a request is (priority band, tenant, session) and, while the fleet is saturated, the order in which queued
requests leave: a pure module (no I/O, no clock of its own), so the order can be tested and reasoned about alone.

Why a queue in the gateway at all: past saturation an engine queues requests itself, first come first served,
where nothing can reorder them. Holding the excess here instead lets an interactive product overtake batch jobs
(bands) and keeps one tenant from starving the others (fairness), and sheds what cannot be served in time with a
clear 429 rather than a timeout.

The order (`FairQueue.pop`): the highest band with anything queued; inside it, the tenant with the least
attained service (least-attained-service fairness, as llm-d's flow control), each tenant's requests first come
first served. Service is counted in weighted tokens when a request leaves (prompt + `output_weight` x expected
output: output tokens cost a decode step each, a prompt token a fraction of a prefill), so two tenants
backlogged in one band stay within one request's cost of each other. A tenant that starts queueing again is
lifted to the least service among the band's queued tenants: credit saved while idle cannot buy a burst.

Bounds: `max_queued` requests in all, `max_per_tenant` per tenant; a full queue sheds the newest request of the
lowest band below the newcomer's, else refuses the newcomer (lower bands are shed first). Attained service is
remembered for at most `max_tenants` tenants (the least recently seen idle ones forgotten first), so thousands of
tenant ids cost bounded memory.
"""

from __future__ import annotations

import hashlib
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BANDS",
    "PRIORITY_HEADER",
    "SESSION_HEADERS",
    "TENANT_HEADER",
    "BadClass",
    "FairQueue",
    "Full",
    "RequestClass",
    "Waiter",
    "classify",
    "request_cost",
]

#: The priority bands, lowest first: a header names one (or its number, 0 to 2).
BANDS = ("low", "normal", "high")
PRIORITY_HEADER = b"x-switchyard-priority"
TENANT_HEADER = b"x-switchyard-tenant"
#: Session id headers, the first present wins: Switchyard's own, then what agents and other routers send
#: (`x-session-id`: vLLM's router's consistent-hash key and many agent SDKs; `x-session-affinity`; `session_id`
#: and `session-id`: Codex-style clients). Without one, OpenAI's `prompt_cache_key` body field names the session.
SESSION_HEADERS = (b"x-switchyard-session", b"x-session-id", b"x-session-affinity", b"session_id", b"session-id")
#: Longest tenant or session id kept as given; ids are printable ASCII without spaces.
MAX_ID_CHARS = 128
_ID = re.compile(r"[!-~]{1,128}")


class BadClass(ValueError):
    """A priority, tenant or session header the gateway refuses (400), naming the header."""

    def __init__(self, message: str, header: str) -> None:
        super().__init__(message)
        self.header = header


@dataclass(frozen=True, slots=True)
class RequestClass:
    band: int
    tenant: str
    session: str | None = None


def _id(raw: bytes, header: str) -> str:
    """A header's id: printable ASCII, at most `MAX_ID_CHARS`; anything else is refused."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise BadClass(f"header {header} must be printable ASCII", header) from None
    if not _ID.fullmatch(text):
        raise BadClass(f"header {header} must be 1 to {MAX_ID_CHARS} printable ASCII characters, no spaces", header)
    return text


def _user(value: Any) -> str:
    """OpenAI's `user` field as a tenant: kept as given when it is a short printable id, else (an e-mail in another
    script, a long string) a stable digest of it, so any valid OpenAI body is served and memory stays bounded."""
    if not isinstance(value, str) or not value:
        return ""
    if len(value) <= MAX_ID_CHARS and _ID.fullmatch(value):
        return value
    return "user#" + hashlib.blake2b(value.encode("utf-8", "replace"), digest_size=12).hexdigest()


def _band(raw: bytes) -> int:
    text = raw.decode("latin-1").strip().lower()
    if text in BANDS:
        return BANDS.index(text)
    if text.isdigit() and len(text) == 1 and int(text) < len(BANDS):
        return int(text)
    header = PRIORITY_HEADER.decode()
    raise BadClass(f"header {header} must be one of {', '.join(BANDS)} (or 0 to 2)", header)


def classify(headers: list[tuple[bytes, bytes]], body: dict[str, Any], default_band: int) -> RequestClass:
    """The request's band, tenant (its header, else the body's `user`, else "") and session id, from the ASGI
    scope's headers (names already lower case): one pass, no mapping built. Raises `BadClass`."""
    band, tenant, session, rank = default_band, None, None, len(SESSION_HEADERS)
    for name, value in headers:
        if not name.startswith((b"x-", b"session")):
            continue
        if name == PRIORITY_HEADER:
            band = _band(value)
        elif name == TENANT_HEADER:
            tenant = _id(value, "x-switchyard-tenant")
        elif name in SESSION_HEADERS:
            at = SESSION_HEADERS.index(name)
            if at < rank:
                session, rank = _id(value, name.decode("ascii")), at
    if tenant is None:
        tenant = _user(body.get("user"))
    if session is None:
        key = body.get("prompt_cache_key")
        if isinstance(key, str) and key:
            session = _user(key)
    return RequestClass(band, tenant, session)


def request_cost(prompt_tokens: int, body: dict[str, Any], output_weight: float, default_output: int) -> float:
    """What a request costs its tenant in weighted tokens: its prompt plus `output_weight` x its expected output
    (`max_completion_tokens` or `max_tokens`, else `default_output`)."""
    output = body.get("max_completion_tokens") or body.get("max_tokens") or default_output
    if not isinstance(output, int) or isinstance(output, bool):
        output = default_output
    return float(prompt_tokens) + output_weight * float(output)


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

    def __init__(self, max_queued: int, max_per_tenant: int, max_tenants: int, bands: int = len(BANDS)) -> None:
        self.max_queued, self.max_per_tenant, self.max_tenants = max_queued, max_per_tenant, max_tenants
        #: band -> tenant -> its queued requests (oldest first); a tenant with none queued leaves the band.
        self.bands: list[dict[str, deque[Waiter]]] = [{} for _ in range(bands)]
        self.depth = [0] * bands
        self.size = 0
        #: Weighted tokens each tenant was admitted with, in the order tenants were last seen (oldest first).
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
