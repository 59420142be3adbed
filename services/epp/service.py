"""`switchyard epp`: the endpoint picker's process: the bus side (hellos, telemetry, KV events, other replicas'
decisions, the routing artifact) feeding the router's core, and the ext_proc gRPC server asking it.

It is wired as the in-process gateway is (`services.gateway.service`), from the same pieces, without the HTTP
front door: Envoy (or any GIE gateway) moves the bytes, the picker only decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from aiohttp import web

from switchyard.services.engine_book import EngineBook
from switchyard.services.epp.http import start_http
from switchyard.services.epp.picker import EndpointPicker
from switchyard.services.epp.select import Selector
from switchyard.services.epp.server import ExternalProcessor, GrpcHealth, build_server
from switchyard.services.epp.settings import EppSettings
from switchyard.services.gateway.flow import Flow
from switchyard.services.gateway.kv_ingest import KvIngest
from switchyard.services.gateway.local_route import InProcessRouter
from switchyard.services.gateway.prompt_keys import PromptKeyer
from switchyard.services.gateway.registry import GatewayRegistry
from switchyard.services.gateway.upstream import Upstream
from switchyard.services.router.core import RouterCore
from switchyard.services.router.feed import CoreFeed, DecisionSharer, join_replicas
from switchyard.services.router.kv_trust import KvRate
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.errors import ConfigError
from switchyard.shared.liveness import LivenessSettings
from switchyard.shared.nats_auth import epp_user, replica_role
from switchyard.shared.schemas import Announce, Hello, Telemetry
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.subjects import check_token

log = logging.getLogger(__name__)

TICK_S = 1.0
#: The subject kind of the picker's decisions: it decides in-process as a gateway replica does.
DECIDER_KIND = "gateway"


def bus_role(settings: SwitchyardSettings, epp_id: str) -> tuple[str, bool]:
    """The NATS user the picker connects as, and whether it may publish its decisions: its own `epp-<id>` when the
    per-role credentials file has one (`switchyard nats-config --epps`), else the shared `gateway` user, which may
    not (its decisions then go unshared). Without per-role credentials: `gateway`, sharing."""
    return replica_role(settings.nats_credentials, epp_user(epp_id))


class EppService:
    def __init__(
        self, settings: SwitchyardSettings, epp: EppSettings | None = None, router: RouterSettings | None = None
    ) -> None:
        self.settings = settings
        self.epp = e = epp or EppSettings()
        try:
            check_token(e.epp_id, "picker id")
        except ValueError as exc:
            raise ConfigError(f"SWITCHYARD_EPP_EPP_ID: {exc}") from None
        g = e.gateway()
        routing = (router or RouterSettings()).model_copy(update={"replica_id": e.epp_id})
        #: One engine book: the registry and the router core project it, fed each message once (`_on_hello`).
        self.book = EngineBook(LivenessSettings().rule(), settings.engine_manifest_entries(), claims=False)
        self.registry = GatewayRegistry(self.book, e.eject_after_failures)
        self.core = RouterCore(routing, book=self.book)
        self.feed = CoreFeed(self.core, settings, e.epp_id, artifact_poll_s=e.artifact_poll_s)
        # Tokenizers load before anything connects: a bad path is one line at startup (ConfigError).
        self.keyer = PromptKeyer.from_settings(g) if e.prefix_keys else None
        self.bus: Bus | None = None
        self.ingest: Bus | None = None
        self.peers: Bus | None = None  # other replicas' decisions, on a connection of their own
        self.kv: KvIngest | None = None
        self.sharer: DecisionSharer | None = None
        self.picker: EndpointPicker | None = None
        self.server: grpc.aio.Server | None = None
        self.health = GrpcHealth(self.ready)
        self.upstream = Upstream(g)  # ejected engines' health checks only
        self.port: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.http: web.AppRunner | None = None  # /metrics and POST /v1/select

    def ready(self) -> bool:
        """Readiness (gRPC health): the bus is up, the artifact was read once, and the fleet has a live engine."""
        bus = self.bus
        return bus is not None and bus.nc.is_connected and self.feed.ready.is_set() and bool(self.registry.live())

    def _on_hello(self, hello: Hello, _msg: object) -> None:
        self.feed.on_hello(hello)  # into the one book: registry and core both see it

    def _on_telemetry(self, telemetry: Telemetry, _msg: object) -> None:
        self.feed.on_telemetry(telemetry)

    async def start(self, servers: list[str] | None = None) -> None:
        e = self.epp
        role, shares = bus_role(self.settings, e.epp_id)
        self.bus = bus = await Bus.connect(self.settings, name=e.epp_id, servers=servers, role=role, no_echo=True)
        try:
            # Engine ingest on a connection of its own (a flood there cannot cut off the one sharing decisions).
            self.ingest = ingest = await Bus.connect(
                self.settings, name=f"{e.epp_id}-ingest", servers=servers, role=role
            )
            s = bus.subjects
            await ingest.subscribe(s.all_hello, Hello, self._on_hello)
            await ingest.subscribe(s.all_telemetry, Telemetry, self._on_telemetry)
            if self.core.ingests_kv:
                rs = self.core.settings
                if rs.prefix_confirm:
                    self.core.prefix.confirm(rs.claims())
                self.kv = KvIngest(None, self.feed, KvRate(rs.kv_rate_keys_per_s, rs.kv_rate_burst_keys))
                await self.kv.start(self.settings, f"{e.epp_id}-kv", servers, role)
            await ingest.nc.flush()
            self.sharer, self.peers = await join_replicas(
                self.feed,
                bus,
                self.settings,
                servers,
                role,
                e.epp_id,
                shares,
                f"switchyard nats-config --epps {e.epp_id}",
            )
            router = InProcessRouter(self.feed, self.sharer, self.registry)
            flow = Flow(e.gateway(), self.registry, self.core) if e.admission else None  # the gateway's queues
            self.picker = EndpointPicker(e, self.registry, self.feed, router, self.sharer, self.keyer, flow)
            await bus.publish(s.announce, Announce(requester=e.epp_id))
            await bus.nc.flush()
            processor = ExternalProcessor(self.picker, e.max_body_bytes)
            self.server, self.port = build_server(e, processor, self.health)
            await self.server.start()
            await self.health.start()
            if e.metrics_port:
                self.http = await start_http(Selector(self.picker), e.host, e.metrics_port)
        except BaseException:
            await self.stop()
            raise
        self._tasks = [asyncio.create_task(self._tick()), asyncio.create_task(self._check_ejected())]
        tls = " (TLS)" if e.tls_cert is not None else ""
        log.info("endpoint picker %s serving ext_proc on %s:%s%s", e.epp_id, e.host, self.port, tls)

    async def _tick(self) -> None:
        """Readiness follows the fleet; dead engines leave the registry (bounded memory)."""
        while True:
            try:
                await self.health.update()
                self.registry.forget_dead()
            except Exception:
                log.exception("endpoint picker housekeeping failed")
            await asyncio.sleep(TICK_S)

    async def _check_ejected(self) -> None:
        """An ejected engine goes on trial when its own `/health` answers (never on a hello alone), as the
        gateway's prober does."""
        e = self.epp
        while True:
            await asyncio.sleep(e.health_check_interval_s)
            for engine in self.registry.due_for_check():
                if await self.upstream.healthy(engine, e.health_timeout_s):
                    self.registry.put_on_trial(engine)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop answering (Envoy's open streams get `grace_s` to end), then leave the bus."""
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        if self.picker is not None and self.picker.flow is not None:
            self.picker.flow.close()  # queued requests are answered 503 before the streams are cut
        if self.server is not None:
            with contextlib.suppress(Exception):
                await self.health.stopping()
            await self.server.stop(grace_s)
            self.server = None
        if self.http is not None:
            await self.http.cleanup()
            self.http = None
        await self.feed.stop()
        if self.sharer is not None:
            with contextlib.suppress(Exception):
                await self.sharer.close()
            self.sharer = None
        for connection in (self.kv, self.ingest, self.peers, self.bus):
            if connection is not None:
                with contextlib.suppress(Exception):
                    await connection.close()
        self.kv = self.ingest = self.peers = self.bus = None
        await self.upstream.close()
        if self.keyer is not None:
            self.keyer.close()

    async def run(self, stop: asyncio.Event, servers: list[str] | None = None) -> None:
        await self.start(servers)
        try:
            await stop.wait()
        finally:
            await self.stop()
