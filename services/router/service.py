"""The router service: a thin NATS shell around `RouterCore`.

It subscribes to every engine's hello and telemetry and to the other replicas' decisions, watches the
routing artifact in the KV bucket (hot reload, no restart), and answers `sy.route.decode` / `sy.route.dp`
in the queue group `<prefix>-router`, so replicas can be added and removed freely. On start it asks every
engine to announce itself, so a restarted replica routes again as soon as the first telemetry arrives
(~100 ms) instead of waiting for the next periodic hello.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.msg import Msg

from services.artifacts import ArtifactError, load_artifact
from services.router.core import Routed, RouterCore
from services.router.settings import RouterSettings
from services.runtime import metrics_endpoint
from shared.bus import Bus
from shared.codec import WireModel, encode
from shared.schemas import Announce, Hello, RouteDecision, RouteDecodeRequest, RouteDpRequest, Telemetry
from shared.settings import SwitchyardSettings

log = logging.getLogger(__name__)

HOUSEKEEPING_S = 1.0


class RouterService:
    def __init__(self, settings: SwitchyardSettings, router: RouterSettings | None = None) -> None:
        self.settings = settings
        self.router = router or RouterSettings()
        self.core = RouterCore(self.router)
        self.bus: Bus | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.ready = asyncio.Event()

    # ----- bus handlers (sync where possible: no task per message) -----

    def _on_hello(self, hello: Hello, _msg: Msg) -> None:
        self.core.on_hello(hello, time.monotonic())

    async def _on_telemetry(self, telemetry: Telemetry, _msg: Msg) -> None:
        if not self.core.on_telemetry(telemetry, time.monotonic()) and self.bus is not None:
            await self.bus.publish(
                self.bus.subjects.announce, Announce(requester=self.router.replica_id, engine_id=telemetry.engine_id)
            )

    def _on_decision(self, decision: RouteDecision, _msg: Msg) -> None:
        self.core.on_decision(decision, time.monotonic())

    async def _share(self, routed: Routed) -> WireModel:
        if routed.decision is not None and self.bus is not None:
            await self.bus.nc.publish(self.bus.subjects.route_decided, encode(routed.decision))
        return routed.reply

    async def _route_decode(self, request: RouteDecodeRequest) -> WireModel:
        return await self._share(self.core.route_decode(request, time.monotonic()))

    async def _route_dp(self, request: RouteDpRequest) -> WireModel:
        return await self._share(self.core.route_dp(request, time.monotonic()))

    # ----- artifact -----

    async def _watch_artifact(self) -> None:
        """Load the current artifact, then apply every update to the KV key as it happens."""
        assert self.bus is not None
        subjects = self.bus.subjects
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
                    artifact = load_artifact(entry.value, self.settings.max_payload_bytes, "KV artifact")
                except ArtifactError as exc:
                    log.error("ignoring routing artifact revision %s: %s", entry.revision, exc)
                    continue
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
            self.core.housekeeping(time.monotonic())
            await asyncio.sleep(HOUSEKEEPING_S)

    # ----- lifecycle -----

    async def start(self, servers: list[str] | None = None) -> None:
        self.bus = bus = await Bus.connect(self.settings, name=self.router.replica_id, servers=servers)
        s = bus.subjects
        await bus.subscribe(s.all_hello, Hello, self._on_hello)
        await bus.subscribe(s.all_telemetry, Telemetry, self._on_telemetry)
        await bus.subscribe(s.route_decided, RouteDecision, self._on_decision)
        self._tasks = [asyncio.create_task(self._watch_artifact()), asyncio.create_task(self._housekeeping())]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ready.wait(), timeout=5)
        await bus.publish(s.announce, Announce(requester=self.router.replica_id))
        await bus.serve(s.route_decode, RouteDecodeRequest, self._route_decode, queue=s.router_queue)
        await bus.serve(s.route_dp, RouteDpRequest, self._route_dp, queue=s.router_queue)
        await bus.nc.flush()
        log.info(
            "router %s serving %s and %s (policy %s)",
            self.router.replica_id,
            s.route_decode,
            s.route_dp,
            self.router.policy,
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.bus is not None:
            await self.bus.close()

    async def run(self, stop: asyncio.Event, servers: list[str] | None = None) -> None:
        with metrics_endpoint(self.router.metrics_port, self.router.metrics_host):
            await self.start(servers)
            try:
                await stop.wait()
            finally:
                await self.stop()
