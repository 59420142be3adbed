"""Expert affinity in the in-process gateway (issue 40 item 3): the gateway's core reads the engines' prefill
signatures as the router service does, so `gimbal-affinity` decides on more than pressure there too.

Real nats-server, a gateway deciding in process, stub engines that publish each DP request's prefill signature
on their own subject (as a vLLM agent with signature capture does). The router service's side, its bounds and its
trust rules: tests/test_affinity_router.py.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np
import pytest

from switchyard.engine_agents.stub import StubConfig
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import deployment, wait_for

SIGNATURE = np.array([[5, 0, 0, 1], [0, 4, 2, 0]], dtype=np.uint16)


def _signature(_body: dict[str, Any]) -> np.ndarray:
    return SIGNATURE


@pytest.mark.parametrize("profile", ["gimbal-affinity", "gimbal"])
async def test_the_in_process_core_learns_each_engines_expert_traffic(
    bus: Bus, settings: SwitchyardSettings, profile: str
) -> None:
    router = RouterSettings(inflight_grace_s=0.0, fresh_load_s=5.0, dp_profile=profile)  # type: ignore[arg-type]
    stubs = [StubConfig("a", dp_signature=_signature), StubConfig("b", dp_signature=_signature)]
    async with (
        deployment(
            settings, bus, stubs, gateway=GatewaySettings(port=0), router_settings=router, shape="inprocess"
        ) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url, timeout=30) as client,
    ):
        core = gw.core
        assert core is not None
        answer = await client.post("/v1/completions", json={"model": "stub-model", "prompt": "hello", "max_tokens": 4})
        assert answer.status_code == 200
        served = answer.json()["served_by"]
        if profile == "gimbal":  # no affinity term: nothing reads the signatures
            assert core.affinity is None
            return
        assert core.affinity is not None
        await wait_for(lambda: core.affinity.traffic_mass(served, time.monotonic()) > 0)  # type: ignore[union-attr]
        other = next(e for e in engines if e != served)
        assert core.affinity.traffic_mass(other, time.monotonic()) == 0
