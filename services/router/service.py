"""The router service: a thin NATS shell around `RouterCore`.

Its `CoreFeed` (`services.router.feed`) gives the core every engine's hello and telemetry (and KV-cache events,
when the DP profile routes by the precise prefix index: `services.router.prefix`), the other replicas' decisions
and the routing artifact in the KV bucket (watched: hot reload, no restart); the service answers
`sy.route.decode` / `sy.route.dp` in the queue group `<prefix>-router`, so replicas can be added and removed
freely. On start it asks every engine to announce itself, so a restarted replica routes again as soon as the
first telemetry arrives (~100 ms) instead of waiting for the next periodic hello.

Decisions are shared after their replies, in batches (`RouteDecisions`, see `DecisionSharer`): one publish
per request, and one message per decision received by every other replica, would cost each replica more
than the decision itself. Each replica publishes under its own subject (`sy.route.decided.router.<id>`); the
connection is `no_echo`, so a replica never receives its own batches back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from switchyard.services.router.core import Decided, DpChoice, RouterCore
from switchyard.services.router.feed import HOUSEKEEPING_S, CoreFeed, DecisionSharer
from switchyard.services.router.settings import RouterSettings
from switchyard.services.runtime import metrics_endpoint
from switchyard.shared.bus import Bus
from switchyard.shared.codec import WireModel
from switchyard.shared.schemas import Announce, PrefillSignature, RouteDecodeRequest, RouteDpRequest, RouteProgress
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.tracing import Tracing
from switchyard.shared.tracing import start as start_tracing

log = logging.getLogger(__name__)

__all__ = ["HOUSEKEEPING_S", "DecisionSharer", "RouterService"]


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux; None elsewhere): how much of a restart was start-up."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            return float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class RouterService:
    def __init__(self, settings: SwitchyardSettings, router: RouterSettings | None = None) -> None:
        self.settings = settings
        self.router = router or RouterSettings()
        self.core = RouterCore(self.router, manifest=settings.engine_manifest_entries())
        self.bus: Bus | None = None
        self.ingest: Bus | None = None  # hello and telemetry, on a connection of their own
        self.kv_ingest: Bus | None = None  # engines' KV events (when read), on another
        self.peers: Bus | None = None  # the other replicas' decisions, on a third
        self.sharer: DecisionSharer | None = None
        self._serving: list[Subscription] = []
        #: Hellos, telemetry, KV events, the other replicas' decisions, the artifact (`services.router.feed`).
        self.feed = CoreFeed(self.core, settings, self.router.replica_id)
        self.ready = self.feed.ready
        #: OpenTelemetry (`shared.tracing`; None: off, the default): a server span per route request.
        self.tracing: Tracing | None = None

    def _on_progress(self, progress: RouteProgress, msg: Msg) -> None:
        """A gateway's report on `sy.route.progress.<reporter>` (only that user may publish there): it settles
        only the requests asked in that reporter's name."""
        reporter = self.bus.subjects.reporter_of(msg.subject) if self.bus is not None else None
        if reporter is not None:
            self.core.on_progress(progress, reporter, time.monotonic())

    def _on_signature(self, message: PrefillSignature, msg: Msg) -> None:
        """An engine's prefill signature, for expert affinity: believed only as its subject's engine (which only
        that engine's NATS user may publish under) and only for a request this replica sent it."""
        sender = self.ingest.subjects.engine_of(msg.subject) if self.ingest is not None else None
        if sender is not None:
            self.core.on_signature(message, sender, time.monotonic())

    def _route_decode(self, request: RouteDecodeRequest) -> WireModel:
        reply, decided = self.core.route_decode(request, time.monotonic())
        if decided is not None and self.sharer is not None:
            self.sharer.add(decided)
        if self.tracing is not None:
            self._annotate(request.request_id, decided, self.router.policy, reply)
        return reply

    def _route_dp(self, request: RouteDpRequest) -> WireModel | bytes:
        reply, decided = self.core.route_dp(request, time.monotonic())
        if decided is not None and self.sharer is not None:
            self.sharer.add(decided)
        if self.tracing is not None:
            self._annotate(request.request_id, decided, self.router.dp_rule, reply)
        return reply.encode() if isinstance(reply, DpChoice) else reply

    def _annotate(self, request_id: str, decided: Decided | None, profile: str, reply: object) -> None:
        """The route request's server span: what was chosen, by which profile (or the error replied)."""
        attributes = {"switchyard.request_id": request_id, "switchyard.route.profile": profile}
        if decided is not None:
            attributes["switchyard.engine_id"] = decided.engine_id
        else:
            error = getattr(reply, "error", None)
            attributes["switchyard.route.error"] = getattr(error, "code", "none")
        self.tracing.annotate(attributes)  # type: ignore[union-attr]

    # ----- lifecycle -----

    async def start(self, servers: list[str] | None = None) -> None:
        t0 = time.monotonic()
        self.tracing = start_tracing("switchyard-router")
        self.bus = bus = await Bus.connect(
            self.settings, name=self.router.replica_id, servers=servers, no_echo=True, role="router"
        )
        s = bus.subjects
        decided = s.decided("router", self.router.replica_id)
        self.sharer = DecisionSharer(bus, self.router.replica_id, self.router.share_interval_s, decided)
        # Engine ingest (wildcard subjects any engine publishes on) has its own connection: a flood there can
        # make the server cut that connection off as a slow consumer, never the one answering route requests.
        self.ingest = ingest = await Bus.connect(
            self.settings, name=f"{self.router.replica_id}-ingest", servers=servers, role="router"
        )
        if self.core.ingests_kv:  # the precise prefix index, only when a profile reads it
            # KV events come in bursts of thousands of blocks: a flood cut off as a slow consumer must not take
            # the hellos and telemetry with it.
            self.kv_ingest = await Bus.connect(
                self.settings, name=f"{self.router.replica_id}-kv", servers=servers, role="router"
            )
        # Other replicas' decisions come in bursts too (and a leaked replica password can flood them): their own
        # connection, so a flood cut off as a slow consumer never takes the route requests with it.
        self.peers = await Bus.connect(
            self.settings, name=f"{self.router.replica_id}-peers", servers=servers, role="router"
        )
        t1 = time.monotonic()
        # the gateways' progress (each on its own subject), on the connection their route requests come in on
        await bus.subscribe(s.route_progress, RouteProgress, self._on_progress)
        await self.feed.start(bus, ingest, self.kv_ingest, self.peers)
        if self.core.affinity is not None:  # the engines' prefill signatures, only when the DP profile reads them
            await ingest.subscribe(s.all_signatures, PrefillSignature, self._on_signature)
        t2 = time.monotonic()
        await bus.publish(s.announce, Announce(requester=self.router.replica_id))
        serving = {"queue": s.router_queue, "idle": self.sharer.idle, "tracing": self.tracing}
        self._serving = [
            await bus.serve(
                s.route_decode, RouteDecodeRequest, self._route_decode, span_name="route.decode", **serving
            ),
            await bus.serve(s.route_dp, RouteDpRequest, self._route_dp, span_name="route.dp", **serving),
        ]
        await bus.nc.flush()
        t3 = time.monotonic()
        age = _process_age_s()
        log.info(
            "router %s serving %s and %s (policy %s); process up %s s (connect %.2f s, artifact %.2f s, serve %.2f s)",
            self.router.replica_id,
            s.route_decode,
            s.route_dp,
            self.router.policy,
            f"{age:.2f}" if age is not None else "?",
            t1 - t0,
            t2 - t1,
            t3 - t2,
        )

    async def stop(self) -> None:
        for sub in self._serving:  # answer what has arrived, take nothing more
            with contextlib.suppress(Exception):
                await sub.drain()
        await self.feed.stop()
        if self.bus is not None:
            if self.sharer is not None:  # the last decisions still count on the other replicas
                with contextlib.suppress(Exception):
                    await self.sharer.close()
            await self.bus.close()
        for connection in (self.ingest, self.kv_ingest, self.peers):
            if connection is not None:
                await connection.close()
        if self.tracing is not None:
            self.tracing.close()
            self.tracing = None

    async def run(self, stop: asyncio.Event, servers: list[str] | None = None) -> None:
        with metrics_endpoint(self.router.metrics_port, self.router.metrics_host):
            await self.start(servers)
            try:
                await stop.wait()
            finally:
                await self.stop()
