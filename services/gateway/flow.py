"""Flow control: while a model's fleet is saturated, requests wait here (`admission.FairQueue`) and leave as
engines free up, in priority order and fair across tenants; past the queue's bounds they are shed with 429.

Saturation is read from the pressure the router's core reads: per engine, the requests outstanding (running and
waiting by its telemetry plus every replica's decisions since, the core's count; at least this gateway's own in
flight) against its concurrency limit (`saturation_concurrency`, else its hello's `capacity.max_running`: past
it requests would wait inside the engine, where nothing can reorder them), or its KV cache past
`saturation_kv_usage`. The fleet is saturated when no live engine has a free slot. While it is not, and nothing
is queued, a request costs one scan that stops at the first engine with room: no queue work at all.

A prefill->decode fleet is gated by both of its roles: a request needs a prefill engine, then holds a decoder
for its whole decode, so the fleet is saturated when no prefill engine has room or no decoder has; its free
slots are the lesser of the two roles' (`_Model.roles`: the roles whose engines gate the model's queue).

What a tenant is charged is `settings.fairness`'s policy (`solver/fairness.py`): weighted tokens, or expert load.
A request's expert footprint is known only once its prefill ends and its engine publishes the signature
(`sy.engine.<id>.signature`, carrying the gateway's request id): the queue charges the tenant's recent mean
footprint (else the fleet's, else 1) when the request leaves, and `on_signature` corrects the tenant's attained
service by the difference and updates the means (`observe`: a handoff whose prefill answer carried the
signature itself). Every request on the DP and the prefill->decode path is remembered for that (the latest
`TRACK_REQUESTS`, so bounded memory; an older one's correction is dropped), so a tenant's mean is known before
its requests ever queue.

Nothing admitted is lost: a queued request leaves to be routed, or gets 429 (shed by a higher band, or waited
past `queue_max_wait_s`), 499 when its client left (seen within `relay.WATCH_AFTER_S`), or 503 at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from starlette.requests import Request

from switchyard.services.gateway import metrics
from switchyard.services.gateway.admission import BANDS, Refusal, RequestClass
from switchyard.services.gateway.registry import GatewayRegistry, HttpEngine
from switchyard.services.gateway.relay import ClientGone, until_disconnect
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.gateway.signatures import REQUEST_ID
from switchyard.services.router.core import RouterCore
from switchyard.shared.schemas import PrefillSignature
from switchyard.solver.fairness import FairQueue, Footprints, Full, Waiter, footprint, request_cost

log = logging.getLogger(__name__)

__all__ = ["DISAGG", "DP", "Flow", "Pressure"]

#: The roles whose engines gate a model's queue: a data-parallel fleet's, a prefill->decode fleet's.
DP: tuple[str, ...] = ("dp",)
DISAGG: tuple[str, ...] = ("prefill", "decode")

#: While requests are queued, how often free slots are looked for (telemetry and ends change them).
POLL_S = 0.005
#: Requests whose signature may still correct their tenant's charge (the newest kept): a few seconds of traffic.
TRACK_REQUESTS = 4096


@dataclass(slots=True)
class _Charge:
    """What one request was charged (or, not queued, only whose footprint its signature will tell)."""

    model: str | None
    tenant: str
    weighted: float
    share: float | None  # the footprint estimate charged (None: none known, charged its weighted tokens)
    charged: bool = False


class Pressure:
    """Per-engine load as the router's core counts it (in process), else as the engine's telemetry and this
    gateway's own requests in flight say (the remote shape)."""

    def __init__(self, settings: GatewaySettings, core: RouterCore | None) -> None:
        self.concurrency, self.kv_limit, self.core = settings.saturation_concurrency, settings.saturation_kv_usage, core

    def load(self, engine: HttpEngine) -> tuple[float, int, float]:
        """(requests outstanding, its concurrency limit, its KV cache usage)."""
        entry = engine.entry
        telemetry = entry.telemetry
        outstanding, kv = 0.0, 0.0
        core = self.core
        row = core.fleet.index.get(engine.engine_id) if core is not None else None
        if row is not None:
            fleet = core.fleet  # type: ignore[union-attr]
            outstanding = float(fleet.num_running[row] + fleet.num_waiting[row] + fleet.inflight[row])
            kv = float(fleet.kv_usage[row])
        elif telemetry is not None:
            outstanding, kv = float(telemetry.num_running + telemetry.num_waiting), telemetry.kv_usage
        limit = self.concurrency or (entry.hello.capacity.max_running if entry.hello is not None else 1)
        return max(outstanding, float(engine.inflight)), limit, kv

    def room(self, engine: HttpEngine) -> int:
        """Requests `engine` can take before it is saturated (0 when its KV cache is past the limit)."""
        outstanding, limit, kv = self.load(engine)
        if kv >= self.kv_limit:
            return 0
        return max(0, math.ceil(limit - outstanding))

    def saturated(self, engines: list[HttpEngine]) -> bool:
        """No engine has room (stops at the first that has: the unsaturated request path's whole cost)."""
        return not any(self.room(e) for e in engines)

    def saturation(self, engines: list[HttpEngine]) -> float:
        """The fleet's saturation for an autoscaler: the mean over engines of max(outstanding / limit, KV usage /
        its limit), so 1 means every engine at its limit, above 1 work waiting inside engines. 0: no engine."""
        if not engines:
            return 0.0
        total = 0.0
        for engine in engines:
            outstanding, limit, kv = self.load(engine)
            total += max(outstanding / max(limit, 1), kv / self.kv_limit)
        return total / len(engines)


class _Model:
    """One model's queue and its dispatcher task."""

    def __init__(self, queue: FairQueue, roles: tuple[str, ...]) -> None:
        self.queue = queue
        #: The roles whose engines gate it (the fleet's mode as the latest request found it).
        self.roles = roles
        #: Requests let out but not yet routed: counted against free slots so a burst of releases cannot overshoot.
        self.pending = 0
        self.task: asyncio.Task[None] | None = None


class _Routed:
    """Called once the released request's engine is chosen (the core now counts it): its slot stops being
    pending. Idempotent, so the request path may also call it when it ends without routing."""

    def __init__(self, state: _Model) -> None:
        self.state: _Model | None = state

    def __call__(self) -> None:
        if self.state is not None:
            self.state.pending -= 1
            self.state = None


class Flow:
    """The gateway's flow control (`settings.admission`): `admit` before routing, on the DP path and the
    prefill->decode path."""

    def __init__(self, settings: GatewaySettings, registry: GatewayRegistry, core: RouterCore | None) -> None:
        self.settings, self.registry = settings, registry
        self.pressure = Pressure(settings, core)
        self.models: dict[str | None, _Model] = {}
        self.closed = False
        self.expert_load = settings.fairness == "expert-load"
        self.footprints = Footprints(settings.max_tenants)
        self.tracked: OrderedDict[str, _Charge] = OrderedDict()

    def _model(self, model: str | None, roles: tuple[str, ...] = DP) -> _Model:
        state = self.models.get(model)
        if state is None:  # only models with live engines get here (their fleet is saturated): few
            s = self.settings
            queue = FairQueue(s.queue_max_requests, s.queue_max_per_tenant, s.max_tenants)
            state = self.models[model] = _Model(queue, roles)
        state.roles = roles  # a fleet that changed mode gates its queue by its new roles
        return state

    def depth(self, band: int) -> int:
        return sum(m.queue.depth[band] for m in self.models.values())

    async def admit(
        self,
        request: Request | None,
        model: str | None,
        klass: RequestClass,
        cost: Callable[[], float],
        engines: list[HttpEngine],
        request_id: str = "",
        decoders: list[HttpEngine] | None = None,
    ) -> tuple[Refusal | None, Callable[[], None] | None]:
        """(None, routed) to go on and route now, calling `routed()` once the choice is made (None when it did not
        queue); or (a `Refusal`, None) to answer instead: 429 shed, 499 the client left, 503 at shutdown.
        `cost()`: the request's weighted tokens; `request_id`: the id its engine's signature will carry.
        `engines`: the DP fleet's, or with `decoders` a prefill->decode fleet's prefill engines."""
        entry = self._track(request_id, model, klass.tenant, cost) if self.expert_load and request_id else None
        state = self.models.get(model)
        if (state is None or not state.queue) and not self._saturated(engines, decoders):
            return None, None
        state, band = self._model(model, DP if decoders is None else DISAGG), klass.band
        charge = cost() if entry is None else request_cost("expert-load", entry.weighted, entry.share)
        waiter = Waiter(band, klass.tenant, charge, time.monotonic(), asyncio.get_running_loop().create_future())
        try:
            shed = state.queue.push(waiter)
        except Full as exc:
            metrics.SHED.labels(BANDS[band], exc.reason).inc()
            return Refusal.shed(exc.reason, self.settings.retry_after_s), None
        metrics.QUEUED.labels(BANDS[band]).inc()
        self._depths(state)
        if shed is not None:
            metrics.SHED.labels(BANDS[shed.band], "shed").inc()
            shed.ticket.set_result("shed")
        if state.task is None or state.task.done():
            state.task = asyncio.ensure_future(self._dispatch(model, state))
        try:
            ticket = asyncio.shield(waiter.ticket)  # None: a caller whose client leaving cancels it (the picker)
            verdict = await (ticket if request is None else until_disconnect(request, ticket))
        except (ClientGone, asyncio.CancelledError) as exc:
            state.queue.remove(waiter)
            self._depths(state)
            if waiter.ticket.done() and waiter.ticket.result() == "go":  # let out as the client left
                state.pending -= 1
            if isinstance(exc, asyncio.CancelledError):
                raise
            metrics.QUEUE_LEFT.labels(BANDS[band]).inc()
            metrics.CLIENT_ABORTS.labels("dp" if decoders is None else "disagg").inc()
            return Refusal(499), None
        metrics.QUEUE_WAIT.labels(BANDS[band]).observe(time.monotonic() - waiter.arrived)
        if verdict == "go":
            if entry is not None:
                entry.charged = True
            return None, _Routed(state)
        if verdict == "closed":
            return Refusal(503, "the gateway is stopping", "ServiceUnavailableError"), None
        return Refusal.shed(verdict, self.settings.retry_after_s), None

    def _saturated(self, engines: list[HttpEngine], decoders: list[HttpEngine] | None) -> bool:
        """No engine has room; on a prefill->decode fleet, no prefill engine or no decoder has (one request
        holds both in turn, the decoder for its whole decode)."""
        saturated = self.pressure.saturated
        return saturated(engines) or (decoders is not None and saturated(decoders))

    def _free(self, model: str | None, roles: Sequence[str]) -> int:
        """Requests the model's fleet can take now: the engines' free slots, the least over the roles gating it."""
        room = self.pressure.room
        return min(sum(room(e) for e in self.registry.live(role, model)) for role in roles)

    def _track(self, request_id: str, model: str | None, tenant: str, cost: Callable[[], float]) -> _Charge:
        entry = self.tracked[request_id] = _Charge(model, tenant, cost(), self.footprints.estimate(tenant))
        if len(self.tracked) > TRACK_REQUESTS:
            self.tracked.popitem(last=False)
        return entry

    def on_signature(self, message: PrefillSignature) -> None:
        """A request's prefill signature: its tenant's footprint mean learns it, and, if the request was charged
        an estimate, the tenant's attained service is corrected to its real cost."""
        match = REQUEST_ID.search(message.request_id)
        if match is not None:
            self.observe(match.group(0), message.signature)

    def observe(self, request_id: str, signature: np.ndarray | None) -> None:
        """`request_id`'s signature however it arrived (on the bus, or in a prefill answer's KV parameters)."""
        entry = self.tracked.pop(request_id, None)
        if entry is None:
            return
        share = 1.0 if signature is None else footprint(signature)  # none: every expert, as footprint says
        self.footprints.observe(entry.tenant, share)
        state = self.models.get(entry.model)
        if entry.charged and state is not None:
            estimate = 1.0 if entry.share is None else entry.share
            state.queue.charge(entry.tenant, entry.weighted * (share - estimate))

    def _depths(self, state: _Model) -> None:
        for band, name in enumerate(BANDS):
            metrics.QUEUE_DEPTH.labels(name).set(self.depth(band))

    async def _dispatch(self, model: str | None, state: _Model) -> None:
        """Let queued requests out as engines free up, until the queue is empty; expire those waiting too long."""
        queue, s = state.queue, self.settings
        try:
            while queue and not self.closed:
                for old in queue.expired(time.monotonic() - s.queue_max_wait_s):
                    queue.remove(old)
                    metrics.SHED.labels(BANDS[old.band], "expired").inc()
                    old.ticket.set_result("expired")
                free = self._free(model, state.roles) - state.pending
                while free > 0 and queue:
                    waiter = queue.pop()
                    assert waiter is not None
                    state.pending += 1
                    free -= 1
                    waiter.ticket.set_result("go")
                self._depths(state)
                if queue:
                    await asyncio.sleep(POLL_S)
        except Exception:  # never leave requests waiting on a dispatcher that died
            log.exception("the gateway's admission dispatcher failed; releasing its queue")
            while (waiter := queue.pop()) is not None:
                state.pending += 1
                waiter.ticket.set_result("go")

    def close(self) -> None:
        """Shutdown: every queued request is answered 503."""
        self.closed = True
        for state in self.models.values():
            while (waiter := state.queue.pop()) is not None:
                waiter.ticket.set_result("closed")
            if state.task is not None:
                state.task.cancel()
            self._depths(state)
