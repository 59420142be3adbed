"""Issue 28, item 2: one of two router replicas, and one of two gateways, SIGKILLed under load: what clients lost.

Routers share one queue group: nats-server stops delivering to a replica the moment its connection drops (the
kernel closes a killed process's socket), so only requests already delivered to the killed replica fail. The
gateways decide in-process (the default) behind a client that spreads requests round robin and resends a failed
one to the next gateway (a load balancer stand-in): only the requests in flight on the killed gateway, and those
sent to it after its death, fail a first attempt; the retry on the survivor answers every one. A few seconds of
load each; the figures are printed (`bench/takeover.py` repeats them for docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from switchyard.engine_agents.stub import StubConfig, StubEngine
from switchyard.shared.bus import Bus
from switchyard.shared.embedded import free_port
from switchyard.shared.schemas import RouteDecisions, RouteDecodeReply, RouteDecodeRequest
from switchyard.shared.settings import SwitchyardSettings
from tests.helpers import eventually
from tests.migration_processes import start_service
from tests.test_router_service import Engines

pytestmark = pytest.mark.slow

WORKERS = 4  # concurrent clients, each with one request in flight at a time
BEFORE_S, AFTER_S = 1.5, 2.5  # load before and after the SIGKILL
SETTLED_S = 1.0  # none sent this long after the kill may go to the killed replica
#: Time for the survivor's last shared decisions to reach the test's subscription after it stopped.
SHARED_S = 0.3
#: A killed router still gets the requests published before nats-server reads its closed socket (a few ms in
#: these runs): a first attempt sent this soon after the SIGKILL may fail.
NOTICE_S = 0.25


@dataclass
class Attempt:
    at: float
    target: int
    ok: bool
    error: str = ""


@dataclass
class Request:
    index: int
    sent: float
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.attempts[-1].ok


async def load(
    send: Callable[[int, int], Awaitable[None]], targets: int, seconds: float, retries: int = 3
) -> list[Request]:
    """WORKERS clients sending request after request for `seconds`; request i goes to target i mod `targets`, a
    failed attempt (any exception) is resent to the next target, up to `retries` more times."""
    requests: list[Request] = []
    until = time.monotonic() + seconds
    counter = iter(range(1 << 30))

    async def client() -> None:
        while time.monotonic() < until:
            i = next(counter)
            request = Request(i, time.monotonic())
            requests.append(request)
            for attempt in range(retries + 1):
                target, at = (i + attempt) % targets, time.monotonic()
                try:
                    await send(i, target)
                    request.attempts.append(Attempt(at, target, True))
                    break
                except Exception as exc:  # a timeout, a refused or reset connection, an error answer
                    request.attempts.append(Attempt(at, target, False, type(exc).__name__))
                    await asyncio.sleep(0.05)

    await asyncio.gather(*(client() for _ in range(WORKERS)))
    return requests


def summary(requests: list[Request], killed_at: float) -> str:
    failed = [r for r in requests if not r.attempts[0].ok]
    in_flight = [r for r in failed if r.attempts[0].at < killed_at]
    lost = [r for r in requests if not r.ok]
    errors = sorted({r.attempts[0].error for r in failed})
    last = max((r.attempts[0].at - killed_at for r in failed), default=0.0)
    return (
        f"{len(requests)} requests, {len(failed)} first attempts failed ({len(in_flight)} sent before the kill, "
        f"{len(failed) - len(in_flight)} after it, the last {last * 1000:+.0f} ms from it; "
        f"{', '.join(errors) or 'none'}), lost with retries {len(lost)}"
    )


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(30)


async def test_one_of_two_routers_killed_under_load(bus: Bus, settings: SwitchyardSettings, tmp_path: Path) -> None:
    engines = Engines(bus, {f"d{i}": "decode" for i in range(4)})
    await engines.answer_announces()

    async def report() -> None:
        while True:
            await engines.report()
            await asyncio.sleep(0.1)

    decided: dict[str, str] = {}  # request id -> the replica that decided it

    def on_decided(message: RouteDecisions, _msg: object) -> None:
        decided.update(dict.fromkeys(message.request_ids, message.replica_id))

    await bus.subscribe(bus.subjects.route_decided, RouteDecisions, on_decided)
    logs = {name: tmp_path / f"{name}.log" for name in ("router-a", "router-b")}
    env = {"SWITCHYARD_ROUTER_POLICY": "jsq", "SWITCHYARD_ROUTER_SHARE_INTERVAL_S": "0.02"}
    reporting = asyncio.create_task(report())
    routers = {
        name: start_service("router", settings, None, log, SWITCHYARD_ROUTER_REPLICA_ID=name, **env)
        for name, log in logs.items()
    }

    attempt_ids: dict[int, list[str]] = {}  # request index -> the request id of each of its attempts, in order

    async def send(i: int, _target: int) -> None:
        ids = attempt_ids.setdefault(i, [])
        ids.append(f"r{i}.{len(ids)}")  # an id per attempt: `decided` then says which replica took which attempt
        request = RouteDecodeRequest(request_id=ids[-1], prompt_tokens=100)
        await bus.request(bus.subjects.route_decode, request, RouteDecodeReply, timeout=0.5)

    try:

        async def serving() -> bool:
            return all(log.exists() and " serving " in log.read_text() for log in logs.values())

        await eventually(serving, timeout=90)
        await eventually(lambda: _both_decide(send, decided), timeout=30)
        decided.clear()
        kill = asyncio.create_task(_kill_after(routers["router-a"], BEFORE_S))
        requests = await load(send, 1, BEFORE_S + AFTER_S)
        killed_at = await kill
    finally:
        reporting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporting
        await asyncio.to_thread(_stop, list(routers.values()))  # the survivor shares its last decisions as it stops
        await asyncio.sleep(SHARED_S)

    print(f"router SIGKILL (1 of 2, queue group): {summary(requests, killed_at)}")
    tail = "\n".join(f"--- {name}\n{log.read_text()[-1500:]}" for name, log in logs.items())
    before = {decided.get(attempt_ids[r.index][-1]) for r in requests if r.sent < killed_at}
    assert {"router-a", "router-b"} <= before, (before, tail)  # both carried load: the kill hit a busy replica
    failed = [r for r in requests if not r.attempts[0].ok]
    # A failed first attempt the survivor decided was answered after the client's 0.5 s timeout: a stalled
    # machine, not a request for the dead replica. Printed, and covered by the retry like any other. (A CI run on
    # 2026-12-03 failed six first attempts after the kill, the last sent 1.07 s after it, when the test could not
    # yet tell which replica had taken them.)
    late = [r for r in failed if decided.get(attempt_ids[r.index][0]) == "router-b"]
    lost_to_the_kill = [r for r in failed if r not in late]
    print(f"first attempts the survivor answered too late: {len(late)}")
    # Only requests delivered to the killed replica before nats-server saw its connection close; each client
    # loses at most one there (a failed attempt waits out its 0.5 s timeout).
    assert all(r.attempts[0].at < killed_at + NOTICE_S for r in lost_to_the_kill), tail
    assert len(lost_to_the_kill) <= WORKERS, tail
    assert not any(r.sent > killed_at + SETTLED_S for r in lost_to_the_kill), tail
    assert all(r.ok for r in requests), tail  # a client that retries loses nothing
    assert routers["router-b"].returncode == 0, tail  # the survivor served on and stopped cleanly


async def _both_decide(send: Callable[[int, int], Awaitable[None]], decided: dict[str, str]) -> bool:
    """Both replicas answer (a joined queue group shares the requests); warms both before the measured load."""
    for i in range(20):
        await send(-1 - i, 0)
    await asyncio.sleep(0.1)
    return {"router-a", "router-b"} <= set(decided.values())


async def _kill_after(process: subprocess.Popen[bytes], seconds: float) -> float:
    await asyncio.sleep(seconds)
    process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    await asyncio.to_thread(process.wait, 30)
    return killed_at


async def test_one_of_two_gateways_killed_under_load(bus: Bus, settings: SwitchyardSettings, tmp_path: Path) -> None:
    stubs = [StubEngine(StubConfig(e, answer_delay_s=0.3), bus) for e in ("e0", "e1")]
    for stub in stubs:
        await stub.start()
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    logs = [tmp_path / f"gateway-g{n}.log" for n in (1, 2)]
    gateways = [
        start_service("gateway", settings, None, log, "--port", str(port), SWITCHYARD_GATEWAY_GATEWAY_ID=f"g{n}")
        for n, (log, port) in enumerate(zip(logs, ports, strict=True), start=1)
    ]
    body = {"model": "stub-model", "prompt": "hello there", "max_tokens": 4}
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:

            async def send(_i: int, target: int) -> None:
                answer = await client.post(f"{urls[target]}/v1/completions", json=body)
                answer.raise_for_status()

            async def serving() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    for target in (0, 1):
                        await send(0, target)
                    return True
                return False

            await eventually(serving, timeout=90, every=0.2)
            kill = asyncio.create_task(_kill_after(gateways[0], BEFORE_S))
            requests = await load(send, 2, BEFORE_S + AFTER_S)
            killed_at = await kill
    finally:
        await asyncio.to_thread(_stop, gateways)
        for stub in stubs:
            await stub.stop()

    print(
        f"gateway SIGKILL (1 of 2, in-process routing, round robin + retry on the next): {summary(requests, killed_at)}"
    )
    tail = "\n".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in logs)
    failed = [a for r in requests for a in r.attempts if not a.ok]
    assert failed and {a.target for a in failed} == {0}, tail  # only attempts on the killed gateway failed
    assert all(not a.ok for r in requests for a in r.attempts if a.target == 0 and a.at > killed_at), tail
    in_flight = [r for r in requests if not r.attempts[0].ok and r.attempts[0].at < killed_at]
    assert len(in_flight) <= WORKERS, tail
    assert all(r.ok for r in requests), tail  # a client that retries on the other gateway loses nothing
    assert sum(1 for r in requests if r.sent > killed_at) > 0 and gateways[1].returncode == 0, tail
