"""The router service: a thin NATS shell around `RouterCore`.

It subscribes to every engine's hello and telemetry (and KV-cache events, when the DP profile routes by
the precise prefix index: `services.router.prefix`) and to the other replicas' decisions, watches the
routing artifact in the KV bucket (hot reload, no restart), and answers `sy.route.decode` / `sy.route.dp`
in the queue group `<prefix>-router`, so replicas can be added and removed freely. On start it asks every
engine to announce itself, so a restarted replica routes again as soon as the first telemetry arrives
(~100 ms) instead of waiting for the next periodic hello.

Decisions are shared after their replies, in batches (`RouteDecisions`, see `DecisionSharer`): one publish
per request, and one message per decision received by every other replica, would cost each replica more
than the decision itself. The connection is `no_echo`, so a replica never receives its own batches back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from switchyard.services.artifacts import ArtifactError, last_valid_artifact, load_artifact
from switchyard.services.router import metrics
from switchyard.services.router.core import Decided, DpChoice, RouterCore
from switchyard.services.router.settings import RouterSettings
from switchyard.services.runtime import metrics_endpoint, supervised
from switchyard.shared.bus import Bus
from switchyard.shared.codec import WireModel, encode_unchecked
from switchyard.shared.schemas import (
    MAX_SHARED_DECISIONS,
    Announce,
    Hello,
    KvEvents,
    RouteDecisions,
    RouteDecodeRequest,
    RouteDpRequest,
    RouteProgress,
    Telemetry,
)
from switchyard.shared.settings import SwitchyardSettings

log = logging.getLogger(__name__)

HOUSEKEEPING_S = 1.0
ANNOUNCE_INTERVAL_S = 1.0


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux; None elsewhere): how much of a restart was start-up."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            return float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class DecisionSharer:
    """Collects this replica's decisions and publishes them as `RouteDecisions`.

    `idle` runs at the end of each burst of requests (`Bus.serve`'s hook, called once nats-py's flusher has
    written the burst's replies). It never publishes there: it schedules the batch for the loop's next turn,
    so sharing adds nothing to a route round trip (encoding a batch before the replies were written held
    every reply of the burst back by that much). It does so unless the previous batch left less than
    `interval_s` ago; what such bursts leave waits for the next burst end past the interval,
    or, if traffic pauses, for a timer one interval later. So decisions are shared after their replies, at
    most one message per `interval_s`, and none waits more than twice that.
    """

    def __init__(self, bus: Bus, replica_id: str, interval_s: float) -> None:
        self.bus, self.replica_id, self.interval_s = bus, replica_id, interval_s
        self.pending: list[Decided] = []
        self.batches = 0
        self._loop = asyncio.get_running_loop()
        self._last = -math.inf  # loop time of the last publication
        self._timer: asyncio.Handle | None = None  # the scheduled publication, if any
        self._soon = False  # ... scheduled for the loop's next turn (not an interval later)
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, decided: Decided) -> None:
        self.pending.append(decided)

    def idle(self) -> None:
        if not self.pending:
            return
        due = self._last + self.interval_s
        if self._loop.time() >= due:
            if self._timer is not None and not self._soon:  # a later publication: bring it forward
                self._timer.cancel()
                self._timer = None
            if self._timer is None:
                self._timer, self._soon = self._loop.call_soon(self._on_timer), True  # after the flusher's turn
        elif self._timer is None:
            self._timer = self._loop.call_at(due + self.interval_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._soon = None, False
        if self.pending:
            task = self._loop.create_task(self.flush())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Publish everything pending now (values validated on their way in: no re-validation)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._soon = None, False
        self._last = self._loop.time()
        pending, self.pending = self.pending, []
        for start in range(0, len(pending), MAX_SHARED_DECISIONS):
            kinds, request_ids, engine_ids, tokens = zip(*pending[start : start + MAX_SHARED_DECISIONS], strict=True)
            columns = {"kinds": kinds, "request_ids": request_ids, "engine_ids": engine_ids, "prompt_tokens": tokens}
            payload = encode_unchecked(RouteDecisions, {"replica_id": self.replica_id, **columns})
            await self.bus.nc.publish(self.bus.subjects.route_decided, payload)
            self.batches += 1

    async def close(self) -> None:
        """Publish what is pending and stop the timer (the replica is going away)."""
        await self.flush()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class RouterService:
    def __init__(self, settings: SwitchyardSettings, router: RouterSettings | None = None) -> None:
        self.settings = settings
        self.router = router or RouterSettings()
        self.core = RouterCore(self.router, manifest=settings.engine_manifest_entries())
        self.bus: Bus | None = None
        self.ingest: Bus | None = None  # hello and telemetry, on a connection of their own
        self.kv_ingest: Bus | None = None  # engines' KV events (when read), on another
        self.sharer: DecisionSharer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._serving: list[Subscription] = []
        self._asked: dict[str, float] = {}  # engine id -> when we last asked it to announce itself
        self._refresh_due = False  # a re-read of the role views is scheduled
        self.ready = asyncio.Event()

    # ----- bus handlers (sync where possible: no task per message) -----

    def _on_hello(self, hello: Hello, _msg: Msg) -> None:
        self.core.on_hello(hello, time.monotonic())
        self._refresh_soon()

    def _refresh_soon(self) -> None:
        """Re-read the role views once after a burst of hellos and telemetry, off the request path.

        A decision re-reads a view itself when the fleet changed since the last read (`RoleView.refresh`, the
        same result either way); done here, that work (a dozen NumPy calls on tiny arrays, and the columns the
        profiles read: 100+ µs in a process woken cold on a loaded machine) no longer sits between a route
        request and its reply.
        """
        if not self._refresh_due:
            self._refresh_due = True
            asyncio.get_running_loop().call_soon(self._refresh_views)

    def _refresh_views(self) -> None:
        self._refresh_due = False
        self.core.refresh_views(time.monotonic())

    async def _on_telemetry(self, telemetry: Telemetry, _msg: Msg) -> None:
        now = time.monotonic()
        known = self.core.on_telemetry(telemetry, now)
        self._refresh_soon()
        if not known and self.bus is not None:
            # an engine we have no hello from: ask it to introduce itself, at most once a second
            if now - self._asked.get(telemetry.engine_id, -math.inf) < ANNOUNCE_INTERVAL_S:
                return
            if len(self._asked) > 10_000:
                self._asked.clear()
            self._asked[telemetry.engine_id] = now
            await self.bus.publish(
                self.bus.subjects.announce, Announce(requester=self.router.replica_id, engine_id=telemetry.engine_id)
            )

    def _on_kv(self, events: KvEvents, _msg: Msg) -> None:
        self.core.on_kv(events, time.monotonic())

    def _on_decisions(self, decisions: RouteDecisions, _msg: Msg) -> None:
        self.core.on_decisions(decisions, time.monotonic())

    def _on_progress(self, progress: RouteProgress, _msg: Msg) -> None:
        self.core.on_progress(progress)

    def _route_decode(self, request: RouteDecodeRequest) -> WireModel:
        reply, decided = self.core.route_decode(request, time.monotonic())
        if decided is not None and self.sharer is not None:
            self.sharer.add(decided)
        return reply

    def _route_dp(self, request: RouteDpRequest) -> WireModel | bytes:
        reply, decided = self.core.route_dp(request, time.monotonic())
        if decided is not None and self.sharer is not None:
            self.sharer.add(decided)
        return reply.encode() if isinstance(reply, DpChoice) else reply

    # ----- artifact -----

    async def _watch_artifact(self) -> None:
        """Load the current artifact, then apply every update to the KV key as it happens."""
        assert self.bus is not None
        subjects = self.bus.subjects
        signing_key = self.settings.artifact_key()
        kv = await self.bus.ensure_kv(subjects.router_bucket)
        watcher = await kv.watch(subjects.artifact_key)
        try:
            async for entry in watcher:
                if entry is None:  # end of the initial values: ready even without an artifact
                    self.ready.set()
                    continue
                if entry.value is None or entry.operation in ("DEL", "PURGE"):
                    log.warning("routing artifact removed from %s: routing by load only", subjects.router_bucket)
                    self.core.set_artifact(None)
                    continue
                try:
                    artifact = load_artifact(entry.value, self.settings.max_payload_bytes, "KV artifact", signing_key)
                except ArtifactError as exc:
                    metrics.ARTIFACTS_REFUSED.labels(exc.code).inc()
                    log.error("ignoring routing artifact revision %s: %s", entry.revision, exc)
                    if self.core.artifact is not None:
                        continue  # keep the one in use
                    found = await last_valid_artifact(
                        kv, subjects.artifact_key, self.settings.max_payload_bytes, signing_key
                    )
                    if found is None:
                        continue
                    artifact, revision = found
                    log.warning("using the last valid routing artifact, KV revision %s", revision)
                self.core.set_artifact(artifact)
                log.info(
                    "routing artifact v%s (K=%s, tau=%s) in use",
                    artifact.version,
                    artifact.centroids.shape[0],
                    artifact.tau,
                )
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _housekeeping(self) -> None:
        while True:
            try:
                self.core.housekeeping(time.monotonic())
            except Exception:  # never let a bad tick stop the next one (metrics folding, forgetting engines)
                log.exception("router housekeeping failed")
            await asyncio.sleep(HOUSEKEEPING_S)

    # ----- lifecycle -----

    async def start(self, servers: list[str] | None = None) -> None:
        t0 = time.monotonic()
        self.bus = bus = await Bus.connect(
            self.settings, name=self.router.replica_id, servers=servers, no_echo=True, role="router"
        )
        s = bus.subjects
        self.sharer = DecisionSharer(bus, self.router.replica_id, self.router.share_interval_s)
        # Engine ingest (wildcard subjects any engine publishes on) has its own connection: a flood there can
        # make the server cut that connection off as a slow consumer, never the one answering route requests.
        self.ingest = ingest = await Bus.connect(
            self.settings, name=f"{self.router.replica_id}-ingest", servers=servers, role="router"
        )
        t1 = time.monotonic()
        await ingest.subscribe(s.all_hello, Hello, self._on_hello)
        await ingest.subscribe(s.all_telemetry, Telemetry, self._on_telemetry)
        if self.core.ingests_kv:  # the precise prefix index, only when a profile reads it
            # KV events come in bursts of thousands of blocks: a flood cut off as a slow consumer must not take
            # the hellos and telemetry with it.
            self.kv_ingest = await Bus.connect(
                self.settings, name=f"{self.router.replica_id}-kv", servers=servers, role="router"
            )
            await self.kv_ingest.subscribe(s.all_kv_events, KvEvents, self._on_kv)
        await bus.subscribe(s.route_decided, RouteDecisions, self._on_decisions)  # no_echo: not our own
        # the gateway's progress, on the connection its route requests come in on (their order kept)
        await bus.subscribe(s.route_progress, RouteProgress, self._on_progress)
        self._tasks = [
            asyncio.create_task(supervised("routing-artifact watcher", self._watch_artifact)),
            asyncio.create_task(self._housekeeping()),
        ]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ready.wait(), timeout=5)
        t2 = time.monotonic()
        await bus.publish(s.announce, Announce(requester=self.router.replica_id))
        share = self.sharer.idle
        self._serving = [
            await bus.serve(s.route_decode, RouteDecodeRequest, self._route_decode, queue=s.router_queue, idle=share),
            await bus.serve(s.route_dp, RouteDpRequest, self._route_dp, queue=s.router_queue, idle=share),
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
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.bus is not None:
            if self.sharer is not None:  # the last decisions still count on the other replicas
                with contextlib.suppress(Exception):
                    await self.sharer.close()
            await self.bus.close()
        for connection in (self.ingest, self.kv_ingest):
            if connection is not None:
                await connection.close()

    async def run(self, stop: asyncio.Event, servers: list[str] | None = None) -> None:
        with metrics_endpoint(self.router.metrics_port, self.router.metrics_host):
            await self.start(servers)
            try:
                await stop.wait()
            finally:
                await self.stop()
