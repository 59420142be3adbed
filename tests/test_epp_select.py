"""`POST /v1/select` on the picker's HTTP port: AIBrix's external routing request (`routing.aibrix.ai/v1alpha1`)
answered from the engines the picker knows (stub engines saying hello on a real nats-server), over real HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import httpx
import pytest

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.services.epp.picker import endpoint_of
from switchyard.services.epp.select import API_VERSION, MAX_REQUEST_BYTES, MEDIA_TYPE, owns
from switchyard.shared.bus import Bus
from switchyard.shared.embedded import free_port
from switchyard.shared.settings import SwitchyardSettings
from tests.epp_helpers import picker
from tests.gateway_helpers import metric
from tests.helpers import eventually


def port_of(engine: StubEngine) -> int:
    return int(endpoint_of(engine.base_url).rsplit(":", 1)[1])


def selection(candidates: list[dict[str, Any]], mode: str = "Authoritative", model: str = "stub-model") -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "ReplicaSelectionRequest",
        "metadata": {"requestId": "req-1"},
        "spec": {"model": model, "policyMode": mode, "candidates": candidates},
    }


def candidate(engine: StubEngine, pod: str | None = None, extra_ports: tuple[int, ...] = ()) -> dict[str, Any]:
    """AIBrix's view of a pod: `namespace/pod-name`, its ports, labels and metrics (the last two ignored here)."""
    return {
        "id": f"default/{pod or engine.config.engine_id}",
        "ports": sorted({port_of(engine), *extra_ports}),
        "attributes": {"topology.kubernetes.io/zone": "a"},
        "metrics": {"runningRequests": 0},
    }


async def post(client: httpx.AsyncClient, port: int, body: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await client.post(
        f"http://127.0.0.1:{port}/v1/select", content=content, headers={"content-type": MEDIA_TYPE}
    )


def test_an_engine_is_the_pods_when_named_after_it() -> None:
    assert owns("vllm-7f9-x2", "vllm-7f9-x2")
    assert owns("vllm-7f9-x2-dp0", "vllm-7f9-x2") and owns("vllm-7f9-x2-dp12", "vllm-7f9-x2")
    assert not owns("vllm-7f9-x2-dpx", "vllm-7f9-x2")
    assert not owns("vllm-7f9-x20", "vllm-7f9-x2")
    assert not owns("vllm-7f9-x2-dp0", "vllm-7f9")  # another pod's prefix is not the pod


async def test_the_choice_is_among_the_candidates_sent(bus: Bus, settings: SwitchyardSettings) -> None:
    # two pods' engines named as the vLLM agent names them (<hostname>-dp<rank>), one named after its pod
    configs = [StubConfig(engine_id="pod-a-dp0"), StubConfig(engine_id="pod-b-dp0"), StubConfig(engine_id="pod-c")]
    engines = {c.engine_id: StubEngine(c, bus) for c in configs}
    for engine in engines.values():
        await engine.start()
    http = free_port()
    try:
        async with picker(settings, list(engines), epp_id="sel1", metrics_port=http), httpx.AsyncClient() as client:
            a, b, c = engines["pod-a-dp0"], engines["pod-b-dp0"], engines["pod-c"]
            allowed = [candidate(b, "pod-b"), candidate(c)]
            targets = []
            for _ in range(6):
                answer = await post(client, http, selection(allowed))
                assert answer.status_code == 200, answer.text
                assert answer.headers["content-type"] == MEDIA_TYPE  # AIBrix accepts no other
                document = answer.json()
                assert document["apiVersion"] == API_VERSION and document["kind"] == "ReplicaSelectionResponse"
                assert document["metadata"]["requestId"] == "req-1"
                assert document["metadata"]["decisionId"].startswith("syepp-")
                assert document["status"]["decision"] == "Selected"
                targets.append((document["status"]["target"]["id"], document["status"]["target"]["port"]))
            # only the candidates sent, each with its own engine's port; counted in flight, so both get some
            assert set(targets) == {("default/pod-b", port_of(b)), ("default/pod-c", port_of(c))}, targets
            # the whole fleet as candidates: the core decides (its own decisions spread by load too)
            everyone = [candidate(a, "pod-a"), candidate(b, "pod-b"), candidate(c)]
            chosen = set()
            for _ in range(9):
                answer = await post(client, http, selection(everyone, "Advisory"))
                chosen.add(answer.json()["status"]["target"]["id"])
            assert chosen == {"default/pod-a", "default/pod-b", "default/pod-c"}
            # a candidate port that is not the engine's own is never chosen
            other = free_port()
            answer = await post(client, http, selection([candidate(a, "pod-a", (other,))]))
            assert answer.json()["status"]["target"] == {"id": "default/pod-a", "port": port_of(a)}
            assert metric("switchyard_epp_selections_total", outcome="selected") >= 16
    finally:
        for engine in engines.values():
            await engine.stop()


async def test_no_live_candidate_is_denied_or_no_decision_by_policy_mode(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    engine = StubEngine(StubConfig(engine_id="live0"), bus)
    await engine.start()
    http = free_port()
    try:
        async with picker(settings, ["live0"], epp_id="sel2", metrics_port=http), httpx.AsyncClient() as client:
            gone = {"id": "default/gone", "ports": [port_of(engine)]}  # no engine of that pod
            wrong_port = {"id": "default/live0", "ports": [free_port()]}
            denied_before = metric("switchyard_epp_selections_total", outcome="denied")
            for candidates in ([gone], [wrong_port]):
                answer = await post(client, http, selection(candidates, "Authoritative"))
                assert answer.status_code == 200
                assert answer.json()["status"] == {"decision": "Denied", "reason": "NoLiveCandidate"}
            # Advisory mode may not answer Denied (AIBrix counts it a protocol failure): NoDecision, its fallback runs
            answer = await post(client, http, selection([gone], "Advisory"))
            assert answer.json()["status"] == {"decision": "NoDecision", "reason": "NoLiveCandidate"}
            # a model no engine serves: nobody is its candidate
            answer = await post(client, http, selection([candidate(engine)], model="other-model"))
            assert answer.json()["status"]["decision"] == "Denied"
            assert metric("switchyard_epp_selections_total", outcome="denied") == denied_before + 3
            assert not engine.received  # a selection sends nothing to the engine itself
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    ("body", "reason", "field"),
    [
        (b'{"apiVersion": ', "not_json", "not valid JSON"),
        (b"[1, 2]", "not_object", "JSON object"),
        (b'{"spec": ' + b"[" * 300 + b"]" * 300 + b"}", "too_deep", "nested"),
        ({**selection([]), "apiVersion": "routing.aibrix.ai/v9"}, "invalid", "apiVersion"),
        ({**selection([]), "kind": "ReplicaSelectionResponse"}, "invalid", "kind"),
        (selection([]), "invalid", "spec.candidates"),
        (selection([{"id": "default/x", "ports": [0]}]), "invalid", "spec.candidates.0.ports.0"),
        (selection([{"id": "default/x", "ports": [8000]}], mode="Sometimes"), "invalid", "spec.policyMode"),
        ({**selection([{"id": "default/x", "ports": [8000]}]), "metadata": {}}, "invalid", "metadata.requestId"),
    ],
)
async def test_bad_input_is_400_with_a_reason_and_counted(
    bus: Bus, settings: SwitchyardSettings, body: object, reason: str, field: str
) -> None:
    engine = StubEngine(StubConfig(engine_id="b0"), bus)
    await engine.start()
    http = free_port()
    try:
        async with picker(settings, ["b0"], epp_id="sel3", metrics_port=http), httpx.AsyncClient() as client:
            before = metric("switchyard_epp_select_bad_requests_total", reason=reason)
            answer = await post(client, http, body)
            assert answer.status_code == 400
            error = answer.json()["error"]
            assert error["reason"] == reason and field in error["message"], error
            assert metric("switchyard_epp_select_bad_requests_total", reason=reason) == before + 1
            # too large: 413, counted; and the picker still answers, its metrics on the same port
            too_big = metric("switchyard_epp_selections_total", outcome="too_large")
            answer = await post(client, http, b"{" + b" " * MAX_REQUEST_BYTES + b"}")
            assert answer.status_code == 413 and answer.json()["error"]["reason"] == "too_large"
            assert metric("switchyard_epp_selections_total", outcome="too_large") == too_big + 1
            ok = await post(client, http, selection([candidate(engine)]))
            assert ok.json()["status"]["decision"] == "Selected"
            scraped = (await client.get(f"http://127.0.0.1:{http}/metrics")).text
            assert 'switchyard_epp_selections_total{outcome="selected"}' in scraped
    finally:
        await engine.stop()


async def test_the_picker_process_serves_select_and_health(bus: Bus, settings: SwitchyardSettings) -> None:
    """`switchyard epp` as its own process (the CLI's path: the service made inside the event loop) answers gRPC
    health and `/v1/select`, and exits cleanly on SIGTERM."""
    from grpc import aio
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    engine = StubEngine(StubConfig(engine_id="cli0"), bus)
    await engine.start()
    grpc_port, http = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env |= {"SWITCHYARD_SUBJECT_PREFIX": settings.subject_prefix, "SWITCHYARD_EPP_METRICS_PORT": str(http)}
    args = ["-m", "switchyard.cli", "epp", "--nats-url", settings.nats_servers[0], "--port", str(grpc_port)]
    process = await asyncio.create_subprocess_exec(sys.executable, *args, env=env)
    try:
        async with aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel, httpx.AsyncClient() as client:
            health = health_pb2_grpc.HealthStub(channel)

            async def ready() -> bool:
                if process.returncode is not None:
                    raise AssertionError(f"switchyard epp exited with {process.returncode}")
                try:
                    answer = await health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                except aio.AioRpcError:
                    return False
                return answer.status == health_pb2.HealthCheckResponse.SERVING

            await eventually(ready, 60)  # the bound only stops a broken test (a cold start imports a lot)
            answer = await post(client, http, selection([candidate(engine)]))
            assert answer.json()["status"]["target"] == {"id": "default/cli0", "port": port_of(engine)}
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0  # the bound only stops a broken test
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await engine.stop()
