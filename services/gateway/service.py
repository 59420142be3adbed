"""The gateway service: the bus side (hellos, signatures) and the HTTP side (uvicorn) in one process.

By default it also decides (`services.gateway.local_route`): the router's core, fed from the same connections,
sharing its decisions under its own subject. With `--router remote` it asks `switchyard router` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import uvicorn
from nats.aio.msg import Msg

from switchyard.services.engine_book import EngineBook
from switchyard.services.gateway import metrics
from switchyard.services.gateway.app import build_app
from switchyard.services.gateway.body import openai_error
from switchyard.services.gateway.flow import Flow, Pressure
from switchyard.services.gateway.kv_ingest import KvIngest
from switchyard.services.gateway.local_route import InProcessRouter
from switchyard.services.gateway.prefix import PrefillPrefix
from switchyard.services.gateway.prompt_keys import PromptKeyer
from switchyard.services.gateway.registry import GatewayRegistry
from switchyard.services.gateway.relay import Context
from switchyard.services.gateway.routing import Router, Routes
from switchyard.services.gateway.sessions import Sessions
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.gateway.signatures import SignatureBox
from switchyard.services.gateway.upstream import Upstream
from switchyard.services.http_limits import HttpLimits
from switchyard.services.http_server import front_protocol
from switchyard.services.router.core import RouterCore
from switchyard.services.router.feed import CoreFeed, DecisionSharer, join_replicas
from switchyard.services.router.kv_trust import KvRate
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.errors import ConfigError
from switchyard.shared.liveness import LivenessSettings
from switchyard.shared.nats_auth import gateway_user, replica_role
from switchyard.shared.schemas import Announce, Hello, PrefillSignature, Telemetry
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.subjects import check_token
from switchyard.shared.tracing import Tracing
from switchyard.shared.tracing import start as start_tracing

log = logging.getLogger(__name__)

HOUSEKEEPING_S = 10.0
#: How often the scaling signals (fleet saturation per model) are refreshed for `/metrics`.
SIGNALS_S = 0.5


def bus_role(settings: SwitchyardSettings, gateway_id: str) -> tuple[str, bool]:
    """The NATS role this gateway connects as, and whether it may publish its decisions: its own user
    (`gateway-<id>`) when the per-role credentials file has one, else the shared `gateway` user, which may not
    (no replica can publish under another's id). Without per-role credentials, `gateway`, sharing."""
    return replica_role(settings.nats_credentials, gateway_user(gateway_id))


class GatewayService:
    def __init__(
        self,
        settings: SwitchyardSettings,
        gateway: GatewaySettings | None = None,
        router: RouterSettings | None = None,
    ) -> None:
        self.settings = settings
        self.gateway = gateway or GatewaySettings()
        g = self.gateway
        try:
            check_token(g.gateway_id, "gateway id")
        except ValueError as exc:
            raise ConfigError(f"SWITCHYARD_GATEWAY_GATEWAY_ID: {exc}") from None
        #: One engine book for the process (`services.engine_book`): the registry's URLs, in-flight counts and
        #: ejections and, in process, the router core's columns are projections of it, fed each message once.
        self.book = EngineBook(LivenessSettings().rule(), settings.engine_manifest_entries(), claims=False)
        self.registry = GatewayRegistry(self.book, g.eject_after_failures)
        #: In-process: the router's core (the same `SWITCHYARD_ROUTER_*` settings as `switchyard router`), its
        #: replica id this gateway's, over the same book. None: the remote shape.
        self.core: RouterCore | None = None
        self.feed: CoreFeed | None = None
        if g.router == "inprocess":
            routing = (router or RouterSettings()).model_copy(update={"replica_id": g.gateway_id})
            self.core = RouterCore(routing, book=self.book)
            self.feed = CoreFeed(self.core, settings, g.gateway_id, artifact_poll_s=g.artifact_poll_s)
        self.sharer: DecisionSharer | None = None
        # Tokenizers load here, before anything connects: a bad path is one line at startup (ConfigError).
        self.keyer = PromptKeyer.from_settings(g) if g.prefix_keys else None
        self.prefix = (
            PrefillPrefix(self.registry, g.prefix_index_blocks, g.prefix_routed_blocks, g.prefix_routed_ttl_s)
            if g.prefix_keys
            else None
        )
        self.registry.on_forget = self._forget  # its latency and error label sets, and its blocks, go with it
        self.signatures = SignatureBox()
        self.bus: Bus | None = None  # route requests and announces
        self.ingest: Bus | None = None  # hellos, telemetry and prefill signatures, on a connection of their own
        self.peers: Bus | None = None  # other replicas' decisions (in-process core), on another
        self.kv: KvIngest | None = None  # engines' KV events, on another
        self.ctx: Context | None = None
        self.server: uvicorn.Server | None = None
        self.port: int | None = None
        self._serving: asyncio.Task[None] | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self._health: asyncio.Task[None] | None = None
        self._signals: asyncio.Task[None] | None = None
        self.tracing: Tracing | None = None

    @property
    def url(self) -> str:
        return f"http://{self.gateway.host}:{self.port}"

    def _on_hello(self, hello: Hello, _msg: object) -> None:
        """Into the one book (through the core's feed in process, which also re-reads its views)."""
        if self.feed is not None:
            self.feed.on_hello(hello)
        else:
            self.registry.on_hello(hello)

    def _forget(self, engine_id: str) -> None:
        metrics.forget_engine(engine_id)
        if self.prefix is not None:
            self.prefix.forget(engine_id)

    def _on_telemetry(self, telemetry: Telemetry, _msg: object) -> None:
        if self.feed is not None:
            self.feed.on_telemetry(telemetry)
        else:
            self.registry.on_telemetry(telemetry)

    def _on_signature(self, message: PrefillSignature, msg: Msg) -> None:
        """To the handoffs and the flow control; in process, also to the core's expert affinity, believed only as
        its subject's engine (which only that engine's NATS user may publish under), as the router service does."""
        self.signatures.on_signature(message, msg)
        sender = self.ingest.subjects.engine_of(msg.subject) if self.ingest is not None else None
        if self.core is not None and sender is not None:
            self.core.on_signature(message, sender, time.monotonic())

    async def _tidy(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            self.registry.forget_dead()

    async def _scaling_signals(self) -> None:
        """Each served model's fleet saturation on `/metrics` (`switchyard_gateway_fleet_saturation{model_name}`),
        read off the request path every `SIGNALS_S`; models no engine serves any more leave the gauge."""
        pressure = Pressure(self.gateway, self.core)
        shown: set[str] = set()
        while True:
            models = set(self.registry.models())
            for model in models:
                engines = self.registry.live(None, model)
                metrics.FLEET_SATURATION.labels(model).set(pressure.saturation(engines))
            for gone in shown - models:
                with contextlib.suppress(KeyError):
                    metrics.FLEET_SATURATION.remove(gone)
            shown = models
            await asyncio.sleep(SIGNALS_S)

    async def _check_ejected(self) -> None:
        """Put an ejected engine on trial when its own health check passes (never on a hello alone): `/health`
        answering says little (an engine sending hostile answers may answer it every second), so it is fully back
        only once a real request on trial succeeds, and a failed trial backs its next check off
        (`GatewayRegistry.hop_failed`)."""
        g = self.gateway
        while True:
            await asyncio.sleep(g.health_check_interval_s)
            if self.ctx is None:
                continue
            for engine in self.registry.due_for_check():
                if await self.ctx.upstream.healthy(engine, g.health_timeout_s):
                    self.registry.put_on_trial(engine)

    def _listen(self) -> socket.socket:
        """Bind the listening socket first: a busy port is one plain error before anything else starts."""
        g = self.gateway
        # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP; with
        # proto 0, Nagle plus delayed ACKs add ~40 ms to every answer written in two parts.
        sock = socket.socket(
            socket.AF_INET6 if ":" in g.host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
        )
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((g.host, g.port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"the gateway cannot listen on {g.host}:{g.port}: {exc.strerror or exc}") from None
        self.port = sock.getsockname()[1]
        return sock

    async def start(self, servers: list[str] | None = None) -> None:
        g = self.gateway
        sock = self._listen()
        try:
            self.tracing = start_tracing("switchyard-gateway")  # None unless the OTEL_* settings turn it on
        except BaseException:
            sock.close()
            raise
        role, shares = bus_role(self.settings, g.gateway_id)
        try:
            self.bus = bus = await Bus.connect(
                self.settings, name=g.gateway_id, servers=servers, role=role, no_echo=True
            )
            # Engine ingest (hellos, telemetry, prefill signatures: wildcard subjects any engine publishes on) has a
            # connection of its own: a flood there can make the server cut it off as a slow consumer, never the one
            # that asks the router where each request goes.
            self.ingest = ingest = await Bus.connect(
                self.settings, name=f"{g.gateway_id}-ingest", servers=servers, role=role
            )
        except BaseException:
            sock.close()
            if self.bus is not None:
                await self.bus.close()
            if self.tracing is not None:
                self.tracing.close()
                self.tracing = None
            raise
        s = bus.subjects
        await ingest.subscribe(s.all_hello, Hello, self._on_hello)
        # Telemetry keeps an engine live as it does for the router and the fleet view (one liveness rule).
        await ingest.subscribe(s.all_telemetry, Telemetry, self._on_telemetry)
        await ingest.subscribe(s.all_signatures, PrefillSignature, self._on_signature)
        # KV events: the prefill choice's index (prefill engines), and the in-process core's when a profile reads it;
        # on a connection of their own, rate-bounded before decoding (`kv_ingest`: a flood cuts off only that one)
        prefill_index = self.prefix if self.prefix is not None and g.mode != "dp" else None
        core_kv = self.feed if self.core is not None and self.core.ingests_kv else None
        if prefill_index is not None or core_kv is not None:
            rs = self.core.settings if self.core is not None else RouterSettings()
            if self.core is not None and rs.prefix_confirm:  # this gateway sees the answers: claims must confirm
                self.core.prefix.confirm(rs.claims())
            self.kv = KvIngest(prefill_index, core_kv, KvRate(rs.kv_rate_keys_per_s, rs.kv_rate_burst_keys))
            try:
                await self.kv.start(self.settings, f"{g.gateway_id}-kv", servers, role)
            except BaseException:
                sock.close()
                await ingest.close()
                await bus.close()
                raise
        await ingest.nc.flush()  # subscribed at the server before the announce asks engines for their hellos
        router: Routes = Router(bus, g.route_timeout_s, self.tracing, reporter=role)
        if self.core is not None and self.feed is not None:
            # engine messages come through this service's handlers
            self.sharer, self.peers = await join_replicas(
                self.feed,
                bus,
                self.settings,
                servers,
                role,
                g.gateway_id,
                shares,
                f"switchyard nats-config --gateways {g.gateway_id}",
            )
            router = InProcessRouter(self.feed, self.sharer, self.registry)
        await bus.publish(s.announce, Announce(requester=g.gateway_id))
        await bus.nc.flush()
        flow = Flow(g, self.registry, self.core) if g.admission else None
        sessions = None
        if g.session_affinity and isinstance(router, InProcessRouter):
            peer_rate = self.core.settings.peer_decisions_per_s  # type: ignore[union-attr]  # in process: a core
            sessions = Sessions(
                Pressure(g, self.core).room, g.max_sessions, g.session_ttl_s, self.registry.engines, peer_rate
            )
            if self.feed is not None:
                self.feed.on_sessions = sessions.learn  # other replicas' decisions teach it their sessions' engines
        if flow is not None and flow.expert_load:  # signatures tell the queue each request's expert footprint
            self.signatures.listeners.append(flow.on_signature)
        self.ctx = Context(
            g,
            self.registry,
            router,
            Upstream(g),
            self.signatures,
            self.keyer,
            self.prefix,
            self.tracing,
            flow,
            sessions,
        )
        app = HttpLimits(
            build_app(self.ctx, lambda: bus.nc.is_connected), g.max_body_bytes, g.body_timeout_s, openai_error
        )
        # No proxy-header middleware: the gateway reads no client address, and it cost every request a pass.
        refusal = openai_error(503, "too many connections", "ServiceUnavailableError")
        config = uvicorn.Config(
            app,
            http=front_protocol(g.header_timeout_s, g.max_client_connections, refusal),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
            proxy_headers=False,
        )
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # ours handle signals
        self._serving = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._serving.done():
                await self._serving  # raises what stopped it
                raise RuntimeError("the gateway's HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        self._housekeeping = asyncio.create_task(self._tidy())
        self._signals = asyncio.create_task(self._scaling_signals())
        self._health = asyncio.create_task(self._check_ejected())
        log.info("gateway %s serving OpenAI endpoints on %s (routing %s)", g.gateway_id, self.url, g.router)

    async def stop(self) -> None:
        if self.server is not None and self._serving is not None:
            self.server.should_exit = True
            with contextlib.suppress(Exception):
                await self._serving
        for task in (self._housekeeping, self._health, self._signals):
            if task is not None:
                task.cancel()
        if self.ctx is not None and self.ctx.flow is not None:
            self.ctx.flow.close()
        if self.ctx is not None:
            await self.ctx.upstream.close()
            if self.ctx.router.progress is not None:
                await self.ctx.router.progress.close()
        if self.feed is not None:
            await self.feed.stop()
        if self.sharer is not None and self.bus is not None:  # the last decisions still count elsewhere
            with contextlib.suppress(Exception):
                await self.sharer.close()
        if self.bus is not None:
            await self.bus.close()
        for connection in (self.ingest, self.peers):
            if connection is not None:
                await connection.close()
        if self.kv is not None:
            await self.kv.close()
        if self.keyer is not None:
            self.keyer.close()
        if self.tracing is not None:
            self.tracing.close()  # exports what is buffered
            self.tracing = None

    async def run(self, stop: asyncio.Event, servers: list[str] | None = None) -> None:
        await self.start(servers)
        try:
            await stop.wait()
        finally:
            await self.stop()
