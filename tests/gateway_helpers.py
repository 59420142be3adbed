"""A gateway, a router and stub engines on one real nats-server, for the gateway tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import httpx
import uvicorn
from prometheus_client import REGISTRY

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.services.gateway.service import GatewayService
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.router.core import RouterCore
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.embedded import free_port
from switchyard.shared.settings import SwitchyardSettings
from tests.helpers import eventually


def metric(name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (a series may carry more, such as `model_name`)."""
    return sum(
        s.value
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


async def read_body(receive: Callable[[], Awaitable[dict]]) -> bytes:
    """A test ASGI app's whole request body, however many messages it came in."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """`eventually(condition)` with the gateway tests' finer poll and shorter bound."""
    await eventually(condition, timeout_s, every=0.01)


@contextlib.asynccontextmanager
async def serving_asgi(app: Any, timeout_s: float = 30.0, **config: Any) -> AsyncIterator[int]:
    """A test ASGI app served by uvicorn on a free local port (yielded) until the block ends; `config` adds
    `uvicorn.Config` options (`http=` a protocol class, say). `timeout_s` only stops a broken test hanging."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", lifespan="off", **config))
    task = asyncio.ensure_future(server.serve())
    try:
        await wait_for(lambda: server.started, timeout_s)
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout_s)


def router_knows(router: RouterService, engine_ids: Iterable[str]) -> bool:
    """The router has each engine's hello (its role) and telemetry (its load): it can route it."""
    return core_knows(router.core, engine_ids)


def core_knows(core: RouterCore, engine_ids: Iterable[str]) -> bool:
    """A router core (a router's, or an in-process gateway's) can route each engine."""
    fleet = core.fleet
    return all(
        e in fleet.index and fleet.role[fleet.index[e]] >= 0 and fleet.last_seq[fleet.index[e]] >= 0 for e in engine_ids
    )


@contextlib.asynccontextmanager
async def deployment(
    settings: SwitchyardSettings,
    bus: Bus,
    stubs: list[StubConfig],
    *,
    router: bool = True,
    gateway: GatewaySettings | None = None,
    router_settings: RouterSettings | None = None,
    shape: str = "remote",
) -> AsyncIterator[tuple[GatewayService, dict[str, StubEngine]]]:
    """Stub engines (hello + telemetry on the bus), a router service (optional) and a gateway on port 0, which asks
    the router (`shape` "remote") or decides in-process with the same router settings ("inprocess")."""
    engines = {c.engine_id: StubEngine(c, bus) for c in stubs}
    for engine in engines.values():
        await engine.start()
    # Stale after 5 s (not 1 s): on a loaded test machine the stubs' telemetry can lag by seconds, and a router
    # that drops an engine mid-test turns a routing check into a fallback. No test here relies on staleness.
    default_router = RouterSettings(inflight_grace_s=0.0, fresh_load_s=5.0)
    replica = RouterService(settings, router_settings or default_router) if router else None
    if replica is not None:
        await replica.start()
    gateway = (gateway or GatewaySettings(port=0, route_timeout_s=0.5)).model_copy(update={"router": shape})
    service = GatewayService(settings, gateway, router_settings or default_router)
    await service.start()
    try:
        await wait_for(lambda: len(service.registry.live()) == len(engines))
        if service.core is not None:  # the in-process core, likewise
            await wait_for(lambda: core_knows(service.core, engines))
        if replica is not None:  # the router routes only engines whose telemetry it has
            await wait_for(lambda: router_knows(replica, engines))
        yield service, engines
    finally:
        await service.stop()
        if replica is not None:
            await replica.stop()
        for engine in engines.values():
            await engine.stop()


# ----- flow control (tests/test_gateway_flow*.py) -----

#: A small completion the stub engines answer.
FLOW_BODY = {"model": "stub-model", "prompt": "hello there", "max_tokens": 4}


def send(client: httpx.AsyncClient, prompt: str, **headers: str) -> asyncio.Task[httpx.Response]:
    """Post `FLOW_BODY` with `prompt` in the background."""
    return asyncio.ensure_future(client.post("/v1/completions", json={**FLOW_BODY, "prompt": prompt}, headers=headers))


def queued(gw: GatewayService) -> int:
    """Requests waiting in the gateway's flow-control queues."""
    assert gw.ctx is not None and gw.ctx.flow is not None
    return sum(len(m.queue) for m in gw.ctx.flow.models.values())


def prompts(*engines: StubEngine) -> list[str]:
    """The prompts the engines received: each engine's in arrival order, one engine after another."""
    return [body["prompt"] for engine in engines for _path, _id, body in engine.received]


async def leave_queue(gw: GatewayService, prompt: str = "gone") -> None:
    """A client whose request is queued disconnects; returns once the queue is empty again."""
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as leaving:
        gone = send(leaving, prompt)
        await wait_for(lambda: queued(gw) == 1)
        gone.cancel()
    await wait_for(lambda: queued(gw) == 0)
