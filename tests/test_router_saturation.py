"""The router exports its fleet's saturation for an autoscaler (issue 42 item 5: "the gateway and router export, on
`/metrics`, the fleet saturation, queue depth per band and the expert-pressure figures"), read from a real
router service's core on a real nats-server with stub engines as real HTTP servers behind a gateway."""

from __future__ import annotations

import asyncio

import httpx

from switchyard.engine_agents.stub import StubConfig
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import deployment, metric, wait_for

BODY = {"model": "stub-model", "prompt": "hello there", "max_tokens": 4}
SATURATION = "switchyard_router_fleet_saturation"


async def test_the_router_exports_its_fleets_saturation(bus: Bus, settings: SwitchyardSettings) -> None:
    async with (
        deployment(settings, bus, [StubConfig("a")], shape="remote") as (gw, engines),
        httpx.AsyncClient(base_url=gw.url, timeout=30) as client,
    ):
        idle = 0.1  # the stub's telemetry says kv_usage 0.1, and no request is outstanding
        await wait_for(lambda: metric(SATURATION, model_name="stub-model") == idle and _exported())
        engine = engines["a"]
        engine.gate = asyncio.Event()
        held = [asyncio.ensure_future(client.post("/v1/completions", json=BODY)) for _ in range(32)]
        try:
            await wait_for(lambda: engine.running == 32)
            # 32 requests outstanding on the one engine of capacity.max_running 256 (the stub's hello): above its KV
            await wait_for(lambda: metric(SATURATION, model_name="stub-model") == 32 / 256)
        finally:
            engine.gate.set()
        assert all(a.status_code == 200 for a in await asyncio.gather(*held))
        await wait_for(lambda: metric(SATURATION, model_name="stub-model") == idle)
    assert metric("switchyard_router_engine_expert_pressure", engine="a") >= 1.0  # the per-engine figure beside it


def _exported() -> bool:
    from prometheus_client import REGISTRY

    return any(
        s.name == SATURATION and s.labels.get("model_name") == "stub-model"
        for f in REGISTRY.collect()
        for s in f.samples
    )
