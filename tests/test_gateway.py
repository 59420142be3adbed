"""The gateway end to end: real nats-server, the real router service, stub engines as real HTTP servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest
from prometheus_client import REGISTRY

from switchyard.engine_agents.stub import StubConfig
from switchyard.services.gateway.choice import rendezvous_order
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode, encode
from switchyard.shared.embedded import free_port
from switchyard.shared.schemas import RouteDecisions, RouteDecodeRequest, RouteDpReply
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.signature_json import SIGNATURE_KEY
from tests.gateway_helpers import deployment, metric, router_knows, wait_for

BODY = {"model": "stub-model", "prompt": "hello there", "max_tokens": 4}


async def _decisions(bus: Bus) -> dict[str, str]:
    """request id -> engine id, from the router's shared decisions."""
    seen: dict[str, str] = {}

    def on_decided(message: RouteDecisions, _msg: object) -> None:
        seen.update(zip(message.request_ids, message.engine_ids, strict=True))

    await bus.subscribe(bus.subjects.route_decided, RouteDecisions, on_decided)
    return seen


@pytest.mark.parametrize("shape", ["remote", "inprocess"])
async def test_dp_dispatch_goes_to_the_routers_choice(bus: Bus, settings: SwitchyardSettings, shape: str) -> None:
    decided = await _decisions(bus)
    stubs = [
        StubConfig("a", waiting_prefill_tokens=50_000),
        StubConfig("b"),
        StubConfig("c", waiting_prefill_tokens=9_000),
    ]
    async with (
        deployment(settings, bus, stubs, shape=shape) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        for _ in range(6):
            answer = await client.post("/v1/completions", json=BODY)
            assert answer.status_code == 200, answer.text
        served = {rid: eid for eid, e in engines.items() for _path, rid, _body in e.received}
        await wait_for(lambda: all(rid in decided for rid in served))
    assert len(served) == 6
    assert all(decided[rid] == eid for rid, eid in served.items())
    assert set(served.values()) == {"b"}  # the least-pressured engine, as Gimbal's rule says
    assert engines["b"].received[0][2] == BODY  # the body as sent


async def test_the_clients_authorization_reaches_the_engine(bus: Bus, settings: SwitchyardSettings) -> None:
    """vLLM started with `--api-key` checks it: the gateway forwards the client's header as it came, and sends
    none for a client that sent none, streamed or whole."""
    async with (
        deployment(settings, bus, [StubConfig("a", tokens=3)]) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        for stream in (False, True):
            sent = await client.post(
                "/v1/completions", json={**BODY, "stream": stream}, headers={"Authorization": "Bearer k1"}
            )
            assert sent.status_code == 200, sent.text
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    assert engines["a"].authorizations == ["Bearer k1", "Bearer k1", None]


async def test_sse_streaming_passes_chunks_and_done(bus: Bus, settings: SwitchyardSettings) -> None:
    async with (
        deployment(settings, bus, [StubConfig("a", tokens=5)]) as (gw, _),
        httpx.AsyncClient(base_url=gw.url) as client,
        client.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1]] == [f"t{i}" for i in range(5)]
    assert metric("switchyard_gateway_time_to_first_token_seconds_count", engine="a", kind="dp") >= 1


async def _handoff(bus: Bus, settings: SwitchyardSettings, via: str, shape: str) -> None:
    decided = await _decisions(bus)
    asked: list[RouteDecodeRequest] = []

    async def on_route(msg: object) -> None:
        asked.append(decode(msg.data, RouteDecodeRequest))  # type: ignore[attr-defined]

    await bus.nc.subscribe(bus.subjects.route_decode, cb=on_route)  # a copy of every question the router gets
    signature = np.arange(8, dtype=np.uint16).reshape(2, 4)
    stubs = [
        StubConfig("p0", role="prefill", signature_via=via, signature=signature),
        StubConfig("d0", role="decode", tokens=3),
        StubConfig("d1", role="decode", tokens=3),
    ]
    gateway = GatewaySettings(port=0, route_timeout_s=0.5, signature_wait_s=2.0)
    async with (
        deployment(settings, bus, stubs, gateway=gateway, shape=shape) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        answer = await client.post("/v1/completions", json={**BODY, "stream": True})
        assert answer.status_code == 200, answer.text
        assert answer.text.rstrip().endswith("data: [DONE]")
        ((path, rid, prefill),) = engines["p0"].received
        decoder = next(e for e in ("d0", "d1") if engines[e].received)
        ((_, decode_rid, decode_body),) = engines[decoder].received
        await wait_for(lambda: rid in decided and len(asked) == (shape == "remote"))
    assert path == "/v1/completions" and decode_rid == rid
    assert (
        prefill["max_tokens"] == 1 and prefill["stream"] is False and prefill["kv_transfer_params"]["do_remote_decode"]
    )
    if shape == "remote":
        assert np.array_equal(asked[0].signature, signature) and asked[0].prefill_engine_id == "p0"
    else:  # decided in the gateway: no question on the bus, the decision shared under the gateway's own subject
        assert asked == [] and gw.core is not None and gw.core.decode.snap.engine_ids == ("d0", "d1")
    assert decided[rid] == decoder  # the decoder the router (or the gateway's core) chose served the decode
    kv = decode_body["kv_transfer_params"]
    assert kv["remote_engine_id"] == "p0" and kv["remote_block_ids"] == [1, 2, 3]
    assert SIGNATURE_KEY not in kv and decode_body["stream"] is True and decode_body["max_tokens"] == 4


async def test_n_above_one_is_refused_plainly_on_a_disaggregated_fleet(bus: Bus, settings: SwitchyardSettings) -> None:
    """A prefill->decode handoff carries one sequence: `n > 1` gets a 400 naming `n`, and no engine sees it; a
    data-parallel fleet passes `n` to the engine, which serves (or refuses) it itself."""
    stubs = [StubConfig("p0", role="prefill"), StubConfig("d0", role="decode", tokens=3)]
    async with (
        deployment(settings, bus, stubs) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        answer = await client.post("/v1/completions", json={**BODY, "n": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n", answer.text
    assert "one request per choice" in answer.json()["error"]["message"]
    assert engines["p0"].received == [] and engines["d0"].received == []
    async with (
        deployment(settings, bus, [StubConfig("a")]) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        answer = await client.post("/v1/completions", json={**BODY, "n": 2})
    assert answer.status_code == 200 and engines["a"].received[0][2]["n"] == 2


@pytest.mark.parametrize("shape", ["remote", "inprocess"])
async def test_handoff_with_the_signature_in_the_prefill_response(
    bus: Bus, settings: SwitchyardSettings, shape: str
) -> None:
    await _handoff(bus, settings, "response", shape)


async def test_handoff_with_the_signature_on_the_bus(bus: Bus, settings: SwitchyardSettings) -> None:
    await _handoff(bus, settings, "bus", "remote")


async def test_a_failure_before_the_first_byte_is_retried_once(bus: Bus, settings: SwitchyardSettings) -> None:
    stubs = [StubConfig("a", fail_first=1), StubConfig("b", waiting_prefill_tokens=50_000, fail_first=0)]
    before = metric("switchyard_gateway_retries_total", hop="dp")
    async with deployment(settings, bus, stubs) as (gw, engines), httpx.AsyncClient(base_url=gw.url) as client:
        answer = await client.post("/v1/completions", json=BODY)
        assert answer.status_code == 200 and answer.json()["served_by"] == "b"
        assert len(engines["a"].received) == 1
        engines["b"].config.fail_first = 10**6
        engines["a"].config.fail_first = 10**6
        answer = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert answer.status_code == 502 and answer.json()["error"]["code"] == 502
    assert metric("switchyard_gateway_retries_total", hop="dp") == before + 2
    assert metric("switchyard_gateway_upstream_errors_total", engine="a", hop="dp", reason="http_500") >= 2


async def test_client_disconnect_aborts_upstream(bus: Bus, settings: SwitchyardSettings) -> None:
    stubs = [StubConfig("a", tokens=10_000, token_interval_s=0.01)]
    async with deployment(settings, bus, stubs) as (gw, engines):
        async with (
            httpx.AsyncClient(base_url=gw.url) as client,
            client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response,
        ):
            async for _chunk in response.aiter_raw():
                break  # the client reads one chunk and goes away
        await wait_for(lambda: len(engines["a"].aborted) == 1)
        await wait_for(lambda: gw.registry.engines["a"].inflight == 0)  # nothing leaks
        assert engines["a"].finished == []
        assert engines["a"].received[0][1] == engines["a"].aborted[0]


async def test_handoff_survives_a_failed_prefill_and_a_missing_router(bus: Bus, settings: SwitchyardSettings) -> None:
    ranked = rendezvous_order(BODY["prompt"].encode(), ["p0", "p1"])  # the prompt's affinity order
    stubs = [
        StubConfig(f"p{ranked[0]}", role="prefill", fail_first=1),
        StubConfig(f"p{ranked[1]}", role="prefill"),
        StubConfig("d0", role="decode"),
    ]
    before = metric("switchyard_gateway_routing_fallbacks_total", kind="decode", reason="no_responders")
    retries = metric("switchyard_gateway_retries_total", hop="prefill")
    async with (
        deployment(settings, bus, stubs, router=False) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        first = await client.post("/v1/completions", json=BODY)  # the first-ranked prefill engine fails once
        second = await client.post("/v1/completions", json=BODY)
        scraped = (await client.get("/metrics")).text
    assert first.status_code == 200 and second.status_code == 200
    assert first.json()["served_by"] == "d0"
    # the first-ranked engine failed once (retried on the other), then took the second request: affinity
    assert len(engines[f"p{ranked[0]}"].received) == 2 and len(engines[f"p{ranked[1]}"].received) == 1
    assert metric("switchyard_gateway_retries_total", hop="prefill") == retries + 1
    assert metric("switchyard_gateway_routing_fallbacks_total", kind="decode", reason="no_responders") == before + 2
    assert "switchyard_gateway_time_to_first_token_seconds_bucket" in scraped and 'kind="disagg"' in scraped


async def test_engine_refusals_pass_through_and_unknown_models_get_404(bus: Bus, settings: SwitchyardSettings) -> None:
    retries = metric("switchyard_gateway_retries_total", hop="dp")
    async with (
        deployment(settings, bus, [StubConfig("a"), StubConfig("b")]) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        refused = await client.post("/v1/completions", json={**BODY, "max_tokens": 10**6})
        streamed = await client.post("/v1/completions", json={**BODY, "max_tokens": 10**6, "stream": True})
        unknown = await client.post("/v1/completions", json={**BODY, "model": "nope"})
    for answer in (refused, streamed):
        assert answer.status_code == 400 and "exceeds the context" in answer.json()["error"]["message"]
    assert sum(len(e.received) for e in engines.values()) == 2  # each tried once: a refusal is not retried
    assert metric("switchyard_gateway_retries_total", hop="dp") == retries
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


async def test_each_model_is_served_only_by_its_engines(bus: Bus, settings: SwitchyardSettings) -> None:
    """Two models in one fleet: the router, asked with the model, chooses among that model's engines only
    (no local fallbacks), in DP dispatch and at the handoff; an unknown model gets vLLM's 404."""
    decided = await _decisions(bus)
    fallbacks = {
        kind: metric("switchyard_gateway_routing_fallbacks_total", kind=kind, reason="unknown_engine")
        for kind in ("dp", "decode")
    }
    stubs = [  # the model-b engines are the least loaded: a model-blind router would send model-a there
        StubConfig("a0", model="model-a", waiting_prefill_tokens=50_000),
        StubConfig("a1", model="model-a", waiting_prefill_tokens=40_000),
        StubConfig("b0", model="model-b"),
        StubConfig("pc", role="prefill", model="model-c"),
        StubConfig("dc", role="decode", model="model-c", tokens=2),
        StubConfig("pd", role="prefill", model="model-d"),
        StubConfig("dd", role="decode", model="model-d", tokens=2),
    ]
    async with deployment(settings, bus, stubs) as (gw, engines), httpx.AsyncClient(base_url=gw.url) as client:
        for model in ("model-a", "model-b", "model-a", "model-c", "model-d", "model-a", "model-c"):
            answer = await client.post("/v1/completions", json={**BODY, "model": model})
            assert answer.status_code == 200, answer.text
        unknown = await client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user"}]})
        served = {
            rid: eid for eid, e in engines.items() for _path, rid, _body in e.received if e.config.role != "prefill"
        }
        await wait_for(lambda: all(rid in decided for rid in served))
    by_model: dict[str, set[str]] = {}
    for engine in engines.values():
        for _path, _rid, body in engine.received:
            by_model.setdefault(body["model"], set()).add(engine.config.engine_id)
    assert by_model == {"model-a": {"a1"}, "model-b": {"b0"}, "model-c": {"pc", "dc"}, "model-d": {"pd", "dd"}}
    assert all(decided[rid] == eid for rid, eid in served.items())  # the router's choice, every time
    for kind, before in fallbacks.items():
        assert metric("switchyard_gateway_routing_fallbacks_total", kind=kind, reason="unknown_engine") == before
    assert unknown.status_code == 404
    assert unknown.json() == {
        "error": {"message": "The model `nope` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_before_the_first_byte_aborts_upstream(
    bus: Bus, settings: SwitchyardSettings, stream: bool
) -> None:
    stubs = [StubConfig("a", tokens=2, token_interval_s=60.0)]  # nothing for a minute
    before = metric("switchyard_gateway_client_aborts_total", kind="dp")
    async with deployment(settings, bus, stubs) as (gw, engines):
        async with httpx.AsyncClient(base_url=gw.url) as client:
            task = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "stream": stream}))
            await wait_for(lambda: len(engines["a"].received) == 1)
            task.cancel()  # the client gives up and closes its connection
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await wait_for(lambda: len(engines["a"].aborted) == 1)
        await wait_for(lambda: metric("switchyard_gateway_client_aborts_total", kind="dp") == before + 1)
        await wait_for(lambda: gw.registry.engines["a"].inflight == 0)
    assert engines["a"].finished == []


async def test_router_down_falls_back_locally_and_counts_it(
    bus: Bus, settings: SwitchyardSettings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="switchyard.services.gateway.routing")
    before = metric("switchyard_gateway_routing_fallbacks_total", kind="dp", reason="no_responders")
    stubs = [StubConfig("a"), StubConfig("b", waiting_prefill_tokens=50_000)]
    async with (
        deployment(settings, bus, stubs, router=False) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        answers = [await client.post("/v1/completions", json=BODY) for _ in range(4)]
        assert all(len(e.received) == 2 for e in engines.values())  # least loaded, ties rotating
        router = RouterService(settings, RouterSettings(inflight_grace_s=0.0, fresh_load_s=5.0))  # it comes back
        await router.start()
        try:
            await wait_for(lambda: router_knows(router, engines))
            answers += [await client.post("/v1/completions", json=BODY) for _ in range(3)]
        finally:
            await router.stop()
    assert all(a.status_code == 200 for a in answers)
    assert all(e.inflight == 0 for e in gw.registry.engines.values())
    assert metric("switchyard_gateway_routing_fallbacks_total", kind="dp", reason="no_responders") == before + 4
    assert len(engines["a"].received) == 5  # the router's choice again: b reports a long prefill backlog
    lines = [r.getMessage() for r in caplog.records if r.name == "switchyard.services.gateway.routing"]
    assert len(lines) == 2 and "router unavailable" in lines[0] and "after 4 local choices" in lines[1]


async def test_a_malformed_router_reply_is_a_local_choice(bus: Bus, settings: SwitchyardSettings) -> None:
    """Whatever answers on `sy.route.dp` cannot make the gateway fail a request or send it nowhere."""
    good = msgpack.unpackb(encode(RouteDpReply(request_id="r", engine_id="a", priority=1, decision_us=1.0)))
    replies = [
        (b"\xc1", "bad_reply"),  # not msgpack
        (msgpack.packb({**good, "engine_id": 7}), "bad_reply"),  # an engine id that is not a string
        (msgpack.packb({**good, "v": good["v"] + 1}), "bad_reply"),  # a version this build does not speak
        (msgpack.packb({**good, "engine_id": "nobody"}), "unknown_engine"),  # not a live candidate
    ]
    queue = list(replies)

    async def answer(msg) -> None:  # type: ignore[no-untyped-def]
        await msg.respond(queue.pop(0)[0])

    async with (
        deployment(settings, bus, [StubConfig("a"), StubConfig("b")], router=False) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        await bus.nc.subscribe(bus.subjects.route_dp, cb=answer)
        await bus.nc.flush()
        for _payload, reason in replies:
            before = metric("switchyard_gateway_routing_fallbacks_total", kind="dp", reason=reason)
            answer_ = await client.post("/v1/completions", json=BODY)
            assert answer_.status_code == 200
            assert metric("switchyard_gateway_routing_fallbacks_total", kind="dp", reason=reason) == before + 1
    assert sum(len(e.received) for e in engines.values()) == len(replies)


async def test_bad_bodies_get_openai_errors_with_400(bus: Bus, settings: SwitchyardSettings) -> None:
    bad = [
        b"{not json",
        b"[1, 2]",
        b'{"model": "stub-model"}',
        b'{"prompt": "x", "stream": "yes"}',
        b'{"prompt": "x", "max_tokens": -1}',
        b"\xff\xfe",
    ]
    async with (
        deployment(settings, bus, [StubConfig("a")]) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        answers = [await client.post("/v1/completions", content=body) for body in bad]
        chat = await client.post("/v1/chat/completions", json={"model": "stub-model", "messages": []})
        wrong_method = await client.get("/v1/completions")  # POSTs skip Starlette; the rest still routes there
        wrong_path = await client.post("/v1/completion", json=BODY)
    assert (wrong_method.status_code, wrong_path.status_code) == (405, 404)
    for answer in [*answers, chat]:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    assert engines["a"].received == []


async def test_the_surface_vllm_clients_probe(bus: Bus, settings: SwitchyardSettings) -> None:
    """What a client of `vllm serve` probes answers as there: /health 200 with no body, /version, and every error
    the gateway makes (404, 405, 501 for an OpenAI endpoint it does not serve) in OpenAI's error JSON."""
    from importlib.metadata import version

    async with (
        deployment(settings, bus, [StubConfig("a")]) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        health, ver = await client.get("/health"), await client.get("/version")
        missing, wrong_method = await client.get("/v1/nothing"), await client.delete("/v1/models")
        embeddings = await client.post("/v1/embeddings", json={"model": "stub-model", "input": "x"})
    assert (health.status_code, health.content) == (200, b"")
    assert ver.status_code == 200 and ver.json() == {"version": version("switchyard")}
    assert "GET" in wrong_method.headers["allow"]
    for answer, status, kind in (
        (missing, 404, "NotFoundError"),
        (wrong_method, 405, "MethodNotAllowedError"),
        (embeddings, 501, "NotImplementedError"),
    ):
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert (error["code"], error["type"]) == (status, kind) and error["message"]
    assert "/v1/embeddings" in embeddings.json()["error"]["message"]
    assert engines["a"].received == []


async def test_an_engine_that_stops_saying_hello_leaves(bus: Bus, settings: SwitchyardSettings) -> None:
    """An engine leaves after `hello_misses` of its own intervals without a hello. The engine that must stay
    says hello every 2 s (it stays through 6 s of scheduler lag on a loaded machine); only when it is its turn
    to leave does it announce a 0.1 s interval, so the test waits for events, never for a lucky instant."""
    stubs = [StubConfig("a", hello_interval_s=0.1), StubConfig("b", hello_interval_s=2.0)]
    async with (
        deployment(settings, bus, stubs, router=False) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "stub-model"
        engines["a"].saying_hello = False
        await wait_for(lambda: [e.engine_id for e in gw.registry.live()] == ["b"])
        for _ in range(3):
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert len(engines["a"].received) == 0 and len(engines["b"].received) == 3
        engines["b"].config.hello_interval_s = 0.1
        await wait_for(lambda: gw.registry.engines["b"].hello_interval_s == 0.1)
        engines["b"].saying_hello = False
        await wait_for(lambda: not gw.registry.live())
        assert (await client.get("/v1/models")).json()["data"] == []
        assert (await client.get("/readyz")).status_code == 503
        answer = await client.post("/v1/completions", json=BODY)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == 503
    await asyncio.sleep(0)


def test_gateway_command_deploys_alone_and_stops_on_sigterm(
    bus: Bus, settings: SwitchyardSettings, tmp_path: Path
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env["SWITCHYARD_SUBJECT_PREFIX"] = settings.subject_prefix
    cli = [sys.executable, "-m", "switchyard.cli", "gateway", "--nats-url", settings.nats_servers[0]]
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        process = subprocess.Popen([*cli, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        health = None
        for _ in range(300):
            if process.poll() is not None:
                break
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert health is not None and health.status_code == 200, log.read_text()[-2000:]
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz")
        assert ready.status_code == 503 and ready.json()["live_engines"] == 0  # no engine said hello
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    assert process.returncode == 0, log.read_text()[-2000:]


def _fallbacks() -> float:
    """Local choices made because the router did not answer, over all kinds and reasons."""
    return sum(
        s.value
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name == "switchyard_gateway_routing_fallbacks_total"
    )


async def test_engine_ingest_has_its_own_connection(bus: Bus, settings: SwitchyardSettings) -> None:
    """Finding 3: a flood on the engines' wildcard subjects made nats-server cut services off as slow consumers.
    The gateway's hellos and prefill signatures are on a connection of their own: losing it leaves the route
    requests (and so the completions) going through the router. The engines say hello rarely, so the registry
    keeps them while the test runs however slow the machine."""
    stubs = [
        StubConfig("a", waiting_prefill_tokens=50_000, hello_interval_s=60.0),
        StubConfig("b", hello_interval_s=60.0),
    ]
    async with deployment(settings, bus, stubs) as (gw, engines), httpx.AsyncClient(base_url=gw.url) as client:
        assert gw.ingest is not None and gw.bus is not None and gw.ingest.nc is not gw.bus.nc
        assert gw.ingest.nc.is_connected
        before = _fallbacks()
        await gw.ingest.nc.close()  # what the server does to a slow consumer
        answers = [await client.post("/v1/completions", json=BODY) for _ in range(3)]
        ready = await client.get("/readyz")
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    assert {a.json()["served_by"] for a in answers} == {"b"}  # the router's choice: a has a long prefill backlog
    assert len(engines["b"].received) == 3
    assert _fallbacks() == before  # the router answered every question
    assert ready.status_code == 200


async def test_a_near_limit_hello_flood_does_not_break_routing(bus: Bus, settings: SwitchyardSettings) -> None:
    """Near-`max_payload` messages on an engine's hello subject (refused by size by every subscriber, but carried
    to each of them by the server) while completions go on: each is served where the router says, whether or
    not the server cuts the gateway's or the router's ingest connection meanwhile."""
    stubs = [
        StubConfig("a", waiting_prefill_tokens=50_000, hello_interval_s=60.0),
        StubConfig("b", hello_interval_s=60.0),
    ]
    flood = b"\x00" * (bus.nc.max_payload - 4096)
    async with deployment(settings, bus, stubs) as (gw, engines), httpx.AsyncClient(base_url=gw.url) as client:
        assert gw.bus is not None
        control = gw.bus.nc
        before = _fallbacks()
        answers = []
        for _ in range(4):
            for _ in range(2):
                await bus.nc.publish(bus.subjects.hello("flood"), flood)
            answers.append(await client.post("/v1/completions", json=BODY))
        await bus.nc.flush()
        answers.append(await client.post("/v1/completions", json=BODY))
        assert gw.bus.nc is control and control.is_connected and control.stats["reconnects"] == 0
    assert [a.status_code for a in answers] == [200] * 5, [a.text for a in answers]
    assert {a.json()["served_by"] for a in answers} == {"b"} and len(engines["b"].received) == 5
    assert _fallbacks() == before
    assert "flood" not in gw.registry.engines
