"""OpenTelemetry tracing across gateway → router → engine (issue 28 item 4): one trace per request.

Real nats-server, the real router service and gateway, stub engines as real HTTP servers. They run in this test's
process, as in the other gateway tests, each with a tracer provider of its own (its own `service.name`), all
exporting into one `InMemorySpanExporter` (`shared.tracing.exporting_to`); what crosses between them is what crosses
between processes: `traceparent` in the NATS headers of a route request and in the HTTP headers of each engine call.
The last test runs the stub engine as a separate process, tracing by the standard `OTEL_*` settings to its console.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from asyncio.subprocess import PIPE
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from switchyard.engine_agents.stub import StubConfig
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.shared import tracing
from switchyard.shared.bus import Bus
from switchyard.shared.errors import ConfigError
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import deployment, wait_for

BODY = {"model": "stub-model", "prompt": "hello there", "max_tokens": 4}
OTEL_SETTINGS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    with tracing.exporting_to(exporter):
        yield exporter


def _service(span: ReadableSpan) -> str:
    return str(span.resource.attributes["service.name"])


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def _traces(exporter: InMemorySpanExporter) -> dict[int, list[ReadableSpan]]:
    by_trace: dict[int, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        by_trace.setdefault(span.context.trace_id, []).append(span)
    return by_trace


def _one(trace: list[ReadableSpan], service: str, name: str, **attributes: str) -> ReadableSpan:
    found = [
        s
        for s in trace
        if _service(s) == service and s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())  # type: ignore[union-attr]
    ]
    assert len(found) == 1, f"{service} {name} {attributes}: {[(_service(s), s.name) for s in trace]}"
    return found[0]


def _traceparent(span: ReadableSpan) -> str:
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _gateway_requests(exporter: InMemorySpanExporter) -> int:
    return sum(
        1 for s in exporter.get_finished_spans() if _service(s) == "switchyard-gateway" and s.kind is SpanKind.SERVER
    )


@pytest.mark.parametrize("shape", ["remote", "inprocess"])
async def test_each_dp_request_is_one_trace_across_gateway_router_and_engine(
    bus: Bus, settings: SwitchyardSettings, spans: InMemorySpanExporter, shape: str
) -> None:
    stubs = [StubConfig("a"), StubConfig("b", waiting_prefill_tokens=50_000)]
    async with (
        deployment(settings, bus, stubs, shape=shape) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        for _ in range(2):
            answer = await client.post("/v1/completions", json=BODY)
            assert answer.status_code == 200, answer.text
        await wait_for(lambda: _gateway_requests(spans) == 2)
        sent = engines["a"].traceparents
    traces = _traces(spans)
    assert len(traces) == 2  # one per request, nothing else traced
    for trace_id, trace in traces.items():
        request = _one(trace, "switchyard-gateway", "POST /v1/completions", **{"http.route": "/v1/completions"})
        assert request.kind is SpanKind.SERVER and _parent(request) is None
        assert request.attributes["http.response.status_code"] == 200  # type: ignore[index]
        route = _one(trace, "switchyard-gateway", "route.dp")
        assert _parent(route) == request.context.span_id
        assert route.attributes["switchyard.engine_id"] == "a"  # type: ignore[index]
        assert route.attributes["switchyard.route.shape"] == shape  # type: ignore[index]
        hop = _one(trace, "switchyard-gateway", "POST /v1/completions", **{"switchyard.hop": "dp"})
        assert hop.kind is SpanKind.CLIENT and _parent(hop) == request.context.span_id
        assert hop.attributes["switchyard.engine_id"] == "a"  # type: ignore[index]
        engine = _one(trace, "switchyard-stub-engine", "POST /v1/completions")
        assert engine.kind is SpanKind.SERVER and _parent(engine) == hop.context.span_id
        assert engine.attributes["engine.id"] == "a"  # type: ignore[index]
        assert _traceparent(hop) in sent  # the header the engine got names the hop as its parent
        if shape == "remote":  # the question went over NATS with the route span's context; the router continued it
            assert route.kind is SpanKind.CLIENT
            router = _one(trace, "switchyard-router", "route.dp")
            assert router.kind is SpanKind.SERVER and _parent(router) == route.context.span_id
            assert router.attributes["switchyard.engine_id"] == "a"  # type: ignore[index]
            assert router.attributes["switchyard.route.profile"] == "switchyard"  # type: ignore[index]
            assert len(trace) == 5
        else:  # decided in the gateway: an internal span naming the profile, no router span
            assert route.kind is SpanKind.INTERNAL
            assert route.attributes["switchyard.route.profile"] == "switchyard"  # type: ignore[index]
            assert len(trace) == 4
        assert all(s.context.trace_id == trace_id for s in trace)
    assert engines["b"].traceparents == []


async def test_a_handoff_is_one_trace_prefill_route_and_decode(
    bus: Bus, settings: SwitchyardSettings, spans: InMemorySpanExporter
) -> None:
    stubs = [StubConfig("p0", role="prefill"), StubConfig("d0", role="decode", tokens=3)]
    gateway = GatewaySettings(port=0, route_timeout_s=0.5, signature_wait_s=2.0)
    async with (
        deployment(settings, bus, stubs, gateway=gateway, shape="remote") as (gw, _engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        answer = await client.post("/v1/completions", json={**BODY, "stream": True})
        assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]"), answer.text
        await wait_for(lambda: _gateway_requests(spans) == 1)
    ((trace_id, trace),) = _traces(spans).items()
    request = _one(trace, "switchyard-gateway", "POST /v1/completions", **{"http.route": "/v1/completions"})
    prefill = _one(trace, "switchyard-gateway", "POST /v1/completions", **{"switchyard.hop": "prefill"})
    route = _one(trace, "switchyard-gateway", "route.decode")
    decode = _one(trace, "switchyard-gateway", "POST /v1/completions", **{"switchyard.hop": "decode"})
    assert {_parent(prefill), _parent(route), _parent(decode)} == {request.context.span_id}
    assert prefill.end_time <= route.start_time and route.end_time <= decode.start_time  # type: ignore[operator]
    router = _one(trace, "switchyard-router", "route.decode")
    assert _parent(router) == route.context.span_id and router.attributes["switchyard.engine_id"] == "d0"  # type: ignore[index]
    on_prefill = _one(trace, "switchyard-stub-engine", "POST /v1/completions", **{"engine.id": "p0"})
    on_decode = _one(trace, "switchyard-stub-engine", "POST /v1/completions", **{"engine.id": "d0"})
    assert _parent(on_prefill) == prefill.context.span_id and _parent(on_decode) == decode.context.span_id
    assert decode.attributes["switchyard.outcome"] == "ok"  # type: ignore[index]  # ended with the stream
    assert len(trace) == 7 and all(s.context.trace_id == trace_id for s in trace)


async def test_a_clients_traceparent_is_the_gateways_parent(
    bus: Bus, settings: SwitchyardSettings, spans: InMemorySpanExporter
) -> None:
    theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with (
        deployment(settings, bus, [StubConfig("a")], router=False, shape="inprocess") as (gw, _),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        answer = await client.post("/v1/completions", json=BODY, headers={"traceparent": theirs})
        assert answer.status_code == 200
        await wait_for(lambda: _gateway_requests(spans) == 1)
    ((trace_id, trace),) = _traces(spans).items()
    assert trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert _parent(_one(trace, "switchyard-gateway", "POST /v1/completions", **{"http.route": "/v1/completions"})) == (
        0xB7AD6B7169203331
    )


async def test_tracing_is_off_by_default(
    bus: Bus, settings: SwitchyardSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in OTEL_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    questions: list[dict[str, str] | None] = []

    async def on_route(msg: object) -> None:
        questions.append(msg.headers)  # type: ignore[attr-defined]

    await bus.nc.subscribe(bus.subjects.route_dp, cb=on_route)  # a copy of every question the router gets
    async with (
        deployment(settings, bus, [StubConfig("a")], shape="remote") as (gw, engines),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        answer = await client.post(
            "/v1/completions", json=BODY, headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
        )
        assert answer.status_code == 200
        assert gw.tracing is None and gw.ctx is not None and gw.ctx.tracing is None and engines["a"].tracing is None
        await wait_for(lambda: len(questions) == 1)
        sent = engines["a"].traceparents
    assert sent == [None]  # the client's traceparent is not passed on, and none is made
    assert questions == [None]  # the route request went without headers


def test_the_otel_settings_decide_whether_tracing_is_on() -> None:
    on = tracing.enabled_exporters
    assert on({}) == []
    assert on({"OTEL_SERVICE_NAME": "x"}) == []  # naming the service turns nothing on
    assert on({"OTEL_TRACES_EXPORTER": "console"}) == ["console"]
    assert on({"OTEL_TRACES_EXPORTER": "otlp,console"}) == ["otlp", "console"]
    assert on({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == []
    assert on({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ["otlp"]
    assert on({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == ["otlp"]
    assert on({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}) == []
    assert on({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "console"}) == ["console"]


def test_an_unknown_exporter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ConfigError, match="unknown exporter 'zipkin'"):
        tracing.start("switchyard-gateway")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match="http/json"):
        tracing.start("switchyard-gateway")


def test_an_otlp_endpoint_turns_tracing_on_with_the_service_name(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # never reached: nothing is exported
    on = tracing.start("switchyard-router")
    assert on is not None
    try:
        assert on.provider.resource.attributes["service.name"] == "switchyard-router"
    finally:
        on.close()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "router-eu-1")
    renamed = tracing.start("switchyard-router")
    assert renamed is not None
    try:
        assert renamed.provider.resource.attributes["service.name"] == "router-eu-1"
    finally:
        renamed.close()


def _console_spans(text: str) -> list[dict[str, object]]:
    """The JSON objects the console exporter printed (one indented object per span), skipping other lines."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while (at := text.find("{", at)) >= 0:
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError:
            at += 1
            continue
        found.append(value)
        at = end
    return found


async def test_an_engine_in_another_process_joins_the_trace(
    bus: Bus, settings: SwitchyardSettings, spans: InMemorySpanExporter
) -> None:
    """The stub engine as its own process (`python -m switchyard.engine_agents.stub`), tracing by the standard
    settings (`OTEL_TRACES_EXPORTER=console`): its span carries the gateway's trace id and the hop as parent."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHYARD_", "OTEL_"))}
    env |= {
        "SWITCHYARD_SUBJECT_PREFIX": settings.subject_prefix,
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_SERVICE_NAME": "engine-x1",
    }
    command = [sys.executable, "-m", "switchyard.engine_agents.stub", "--engine-id", "x1"]
    process = await asyncio.create_subprocess_exec(
        *command, "--nats-url", settings.nats_servers[0], stdout=PIPE, stderr=PIPE, env=env
    )
    try:
        async with (
            deployment(settings, bus, [], router=False, shape="inprocess") as (gw, _),
            httpx.AsyncClient(base_url=gw.url) as client,
        ):
            await wait_for(lambda: [e.engine_id for e in gw.registry.live()] == ["x1"], 60)
            await wait_for(lambda: gw.core is not None and "x1" in gw.core.fleet.index, 30)
            answer = await client.post("/v1/completions", json=BODY)
            assert answer.status_code == 200 and answer.json()["served_by"] == "x1", answer.text
            await wait_for(lambda: _gateway_requests(spans) == 1)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            out, err = await asyncio.wait_for(process.communicate(), 30)
        except TimeoutError:
            process.kill()
            out, err = await process.communicate()
    assert process.returncode == 0, err.decode()[-2000:]
    hop = _one(
        next(iter(_traces(spans).values())), "switchyard-gateway", "POST /v1/completions", **{"switchyard.hop": "dp"}
    )
    (engine,) = (s for s in _console_spans(out.decode()) if s.get("kind") == "SpanKind.SERVER")
    assert engine["context"]["trace_id"] == f"0x{hop.context.trace_id:032x}"  # type: ignore[index]
    assert engine["parent_id"] == f"0x{hop.context.span_id:016x}"
    assert engine["resource"]["attributes"]["service.name"] == "engine-x1"  # type: ignore[index]
