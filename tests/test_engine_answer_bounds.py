"""Issue 37, items 1, 4 and 6: what an engine answers is bounded by what an honest engine could answer.

Each attack runs on a real nats-server with the generated per-role configuration: the gateway (deciding
in-process, as `gateway-g1`), honest stub engines and a hostile engine `e0`, each as its own engine user. `e0`'s
hello and telemetry come from the engine-agent core (a stub whose `base_url` names a raw asyncio server), and
that server answers the gateway's hops as a compromised engine would:

- `bigbody`: `200` with `content-length: 2^30`, then junk (issue: the gateway went from 76 MiB to 5-6 GiB RSS);
- `hugeheader`: a header `x-a: aaaa...` that never ends, in 64 KiB writes (issue: 96 % CPU, honest p50 ~21 s);
- `nested`: a prefill answer of 100,000-deep JSON (issue: 12 of 30 clients got a 500 with a traceback).

What must hold: every honest request is answered 200 by an honest engine, the hostile hop fails with its reason
(counted) and ejects `e0`, the hostile connection is closed after at most the bound plus the kernel's socket
buffers (counted on the server's side, not by the gateway's RSS), and an ejected engine whose `/health` answers
is only on trial until a real request succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.services.gateway.service import GatewayService
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.liveness import Liveness
from switchyard.shared.nats_auth import engine_user
from tests import test_nats_permissions
from tests.gateway_helpers import core_knows, metric, wait_for
from tests.test_nats_permissions import SecuredNats

secured = test_nats_permissions.secured  # the real nats-server with the generated per-role configuration

BODY = {"model": "stub-model", "prompt": "hello there", "max_tokens": 2}
#: The gateway's bound on a whole answer in these tests (the default is 16 MiB).
MAX_ANSWER = 1 << 20
#: What the kernel may hold between the hostile server's writes and the gateway's reads (send and receive
#: buffers on loopback, a few MiB each at most): bytes written beyond the bound by the time the gateway closes.
SOCKET_SLACK = 16 << 20
#: The hostile server stops writing here (then waits for the close): far past bound + slack.
HOSTILE_CAP = 64 << 20


class Hostile:
    """A raw HTTP server for `e0`: `/health` answers 200 (as the issue's did), completions as `mode` says.
    Counts completion requests, the most bytes written on one before the gateway closed it, and the most
    completion requests it held at once."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.completions = self.health = self.active = self.most_active = self.most_sent = 0
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.lower().split(b"\r\n")
            lengths = [line.split(b":")[1] for line in lines if line.startswith(b"content-length")]
            length = int(lengths[0]) if lengths else 0
            await reader.readexactly(length)
            if head.startswith(b"GET /health"):
                self.health += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                await writer.drain()
            else:
                self.completions += 1
                self.active += 1
                self.most_active = max(self.most_active, self.active)
                try:
                    await self._answer(writer)
                finally:
                    self.active -= 1
        writer.close()

    async def _answer(self, writer: asyncio.StreamWriter) -> None:
        if self.mode == "honest":
            body = json.dumps({"choices": [{"text": "ok"}], "served_by": "e0"}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()
        elif self.mode == "nested":
            body = b"[" * 100_000 + b"]" * 100_000
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()
        elif self.mode == "bigbody":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1073741824\r\n\r\n")
            await self._junk(writer, b"x" * 65536)
        else:  # hugeheader
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-a: ")
            await self._junk(writer, b"a" * 65536)

    async def _junk(self, writer: asyncio.StreamWriter, piece: bytes) -> None:
        """Write `piece` until the gateway closes the connection (or `HOSTILE_CAP`), counting what went out."""
        writer.transport.set_write_buffer_limits(high=0)  # drain returns once the kernel took it
        sent = 0
        while sent < HOSTILE_CAP:
            writer.write(piece)
            await writer.drain()
            sent += len(piece)
            self.most_sent = max(self.most_sent, sent)
        await asyncio.sleep(30)  # past the gateway's timeouts: it closes


class _Fronted(StubEngine):
    """A stub engine whose hello names another server's URL: `e0`'s agent (hello, telemetry) for `Hostile`."""

    def __init__(self, config: StubConfig, bus: Bus, url: str) -> None:
        super().__init__(config, bus)
        self._url = url

    @property
    def base_url(self) -> str:
        return self._url


def _gateway(**extra: object) -> GatewaySettings:
    return GatewaySettings(
        port=0,
        gateway_id="g1",
        signature_wait_s=0.0,
        max_answer_bytes=MAX_ANSWER,
        first_byte_timeout_s=3.0,
        prefill_timeout_s=3.0,
        health_check_interval_s=0.2,
        **extra,  # type: ignore[arg-type]
    )


@contextlib.asynccontextmanager
async def _fleet(
    secured: SecuredNats, hostile: Hostile, honest: list[StubConfig], role: str = "dp"
) -> AsyncIterator[GatewayService]:
    """The honest stubs and `e0` (role `role`, served by `hostile`), each as its engine user, and an in-process
    gateway as `gateway-g1` that routes all of them."""
    settings = secured.settings()
    await hostile.start()
    buses: list[Bus] = []
    engines: list[StubEngine] = []
    service = GatewayService(settings, _gateway(), RouterSettings(inflight_grace_s=0.0, fresh_load_s=5.0))
    try:
        for config in [*honest, StubConfig("e0", role=role)]:
            bus = await Bus.connect(settings, name=config.engine_id, role=engine_user(config.engine_id))
            buses.append(bus)
            engine = StubEngine(config, bus) if config.engine_id != "e0" else _Fronted(config, bus, hostile.url)
            engines.append(engine)
            await engine.start()
        await service.start()
        ids = [e.config.engine_id for e in engines]
        await wait_for(lambda: len(service.registry.live()) == len(ids))
        assert service.core is not None
        await wait_for(lambda: core_knows(service.core, ids))  # type: ignore[arg-type]
        yield service
    finally:
        await service.stop()
        for engine in engines:
            await engine.stop()
        for bus in buses:
            await bus.close()
        await hostile.stop()


async def _ask(service: GatewayService, n: int, start: int = 0, at_once: int = 1) -> list[str]:
    """`n` requests with distinct prompts, `at_once` at a time, by who answered each (or the status)."""
    async with httpx.AsyncClient(base_url=service.url, timeout=60) as client:

        async def one(i: int) -> str:
            answer = await client.post("/v1/completions", json={**BODY, "prompt": f"hello {i}"})
            if answer.status_code != 200:
                return f"status {answer.status_code}"
            return answer.json().get("served_by", "?")

        served: list[str] = []
        for first in range(start, start + n, at_once):
            served += await asyncio.gather(*(one(i) for i in range(first, min(first + at_once, start + n))))
        return served


def _errors(reason: str, hop: str = "dp") -> float:
    return metric("switchyard_gateway_upstream_errors_total", engine="e0", hop=hop, reason=reason)


@pytest.mark.parametrize(("mode", "reason"), [("bigbody", "too_large"), ("hugeheader", "head_too_large")])
async def test_a_hostile_dp_answer_is_cut_at_its_bound_counted_and_its_engine_ejected(
    secured: SecuredNats, mode: str, reason: str
) -> None:
    """`e0` answers every DP hop with an endless body or an endless header. Each such hop fails as soon as the
    answer passes its bound: the gateway closes the connection after at most the bound plus the sockets'
    buffers (before: it read 64 MiB, all the hostile server sent, until the first-byte timeout), counts the
    reason, ejects `e0` and retries on `e1`, which answers every client."""
    hostile = Hostile(mode)
    errors, ejections = _errors(reason), metric("switchyard_gateway_engine_ejections_total")
    async with _fleet(secured, hostile, [StubConfig("e1")]) as service:
        served = await _ask(service, 12)
        tried = hostile.completions
    assert served == ["e1"] * 12
    assert tried >= 1, "the router never chose e0: nothing was tested"
    assert hostile.most_sent <= MAX_ANSWER + SOCKET_SLACK, f"{hostile.most_sent} bytes went out before the close"
    assert _errors(reason) - errors == tried
    assert metric("switchyard_gateway_engine_ejections_total") > ejections


async def test_a_prefill_answer_nested_100000_deep_is_a_hop_failure_not_a_500(secured: SecuredNats) -> None:
    """`e0`, a prefill engine, answers 100,000-deep JSON: the hop fails (`too_deep`, counted), the other prefill
    engine is tried, `e0` is ejected, and every client gets its answer from the decoder (before: a 500 with a
    traceback for the requests whose prefill went to `e0`)."""
    hostile = Hostile("nested")
    errors, ejections = _errors("too_deep", "prefill"), metric("switchyard_gateway_engine_ejections_total")
    honest = [StubConfig("p0", role="prefill"), StubConfig("d0", role="decode")]
    async with _fleet(secured, hostile, honest, role="prefill") as service:
        served = await _ask(service, 16)
        tried = hostile.completions
    assert served == ["d0"] * 16
    assert tried >= 1, "no prefill hop went to e0: nothing was tested"
    assert _errors("too_deep", "prefill") - errors == tried
    assert metric("switchyard_gateway_engine_ejections_total") > ejections


async def test_an_ejected_engine_whose_health_answers_is_back_only_once_a_real_request_succeeds(
    secured: SecuredNats,
) -> None:
    """`e0` answers `/health` every time but every request with an endless body. After its ejection its health
    checks pass, yet it is only on trial: restorations stay at zero, a request on trial fails and ejects it again
    (counted), and it never holds more than one request at a time. Once it answers honestly, the next request on
    trial puts it fully back. Before: every passing health check put it back in rotation (counted as a
    restoration), and the issue's engine came back every second."""
    hostile = Hostile("bigbody")
    restorations = metric("switchyard_gateway_engine_restorations_total")
    failed = metric("switchyard_gateway_engine_trials_total", outcome="failed")
    async with _fleet(secured, hostile, [StubConfig("e1")]) as service:
        e0 = service.registry.engines["e0"]
        served = await _ask(service, 12)
        assert hostile.completions >= 1, "the router never chose e0: nothing was tested"
        await wait_for(lambda: hostile.health >= 1 and not e0.ejected)  # its /health answered since its ejection
        assert metric("switchyard_gateway_engine_restorations_total") == restorations
        tried = hostile.completions
        served += await _ask(service, 24, start=12, at_once=4)
        assert hostile.completions > tried, "no request went to e0 on trial: nothing was tested"
        assert metric("switchyard_gateway_engine_trials_total", outcome="failed") > failed
        assert metric("switchyard_gateway_engine_restorations_total") == restorations
        assert hostile.most_active == 1
        hostile.mode = "honest"
        await wait_for(lambda: e0.trial and not e0.ejected)
        n = 36
        while metric("switchyard_gateway_engine_restorations_total") == restorations and n < 136:
            served += await _ask(service, 4, start=n)
            n += 4
        assert metric("switchyard_gateway_engine_restorations_total") == restorations + 1
        assert not e0.trial and not e0.ejected
    assert set(served) <= {"e0", "e1"} and "e0" in served  # every client answered 200, e0's honest answer too


def test_the_trial_rule_one_request_at_a_time_and_a_backoff_doubling_per_failed_trial() -> None:
    """The registry's rule itself (pure): a hostile answer ejects at once; a passing health check puts the engine
    on trial, in the live list until a request to it starts; a failed trial ejects it again with its next check
    1 s, then 2 s, 4 s later; an abandoned trial request frees it for the next; a success puts it fully back."""
    from switchyard.services.gateway.registry import GatewayRegistry
    from tests.test_engine_binding import _attacker_hello

    registry = GatewayRegistry(liveness=Liveness(3.0, 1e9))
    registry.on_hello(_attacker_hello("dp", "http://e0", interval_s=60.0), now=0.0)
    e0 = registry.engines["e0"]
    registry.hop_failed(e0, hostile=True, now=1.0)
    assert e0.ejected and registry.due_for_check(now=1.0) == [e0]
    waits = []
    for now in (2.0, 10.0, 20.0):
        registry.put_on_trial(e0)
        assert registry.live(now=now) == [e0]
        registry.hop_begun(e0)
        assert registry.live(now=now) == []  # its one trial request is in flight
        registry.hop_failed(e0, now=now)
        assert e0.ejected and registry.due_for_check(now=now) == []
        waits.append(e0.check_at - now)
    assert waits == [1.0, 2.0, 4.0]
    registry.put_on_trial(e0)
    registry.hop_begun(e0)
    registry.hop_abandoned(e0)  # the client left: no verdict, the next request may try
    assert registry.live(now=30.0) == [e0] and e0.trial
    registry.hop_begun(e0)
    registry.hop_succeeded(e0)
    assert not e0.trial and not e0.ejected and e0.backoff_s == 0.0 and registry.live(now=30.0) == [e0]
