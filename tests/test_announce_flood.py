"""An announce flood from the read-only credential (issue 29, item 6), on a real nats-server with per-role users.

Any credential that may publish `sy.engine.announce` can ask every engine for a hello. Answered one for one, a
flood became hellos times engines, carried to every service's engine ingest, and the server cut placement's
off as a slow consumer. Engines now answer at a bounded rate (`engine_agents.core.announce`), and placement
takes each hello once.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import pytest

from switchyard.engine_agents.core import EngineAgent
from switchyard.services.fleet_view import FleetView
from switchyard.shared.bus import Bus
from switchyard.shared.codec import encode
from switchyard.shared.embedded import EmbeddedNats
from switchyard.shared.nats_auth import SERVICE_ROLES, Credentials, engine_user, render_authorization
from switchyard.shared.schemas import Announce, Hello
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.subjects import Subjects
from tests.fleet_helpers import hello
from tests.helpers import eventually

ENGINES = [f"e{i}" for i in range(8)]
#: Far below nats-server's 64 MiB default, so that a flood of test size shows what a large one does to a
#: consumer that falls behind (no lower: it may not be below the 8 MiB `max_payload`); ~25,000 hellos of headroom.
MAX_PENDING = "8MB"
IDLE = {
    "kv_usage": 0.0,
    "num_running": 0,
    "num_waiting": 0,
    "waiting_prefill_tokens": 0,
    "remaining_prefill_tokens": 0,
    "step_time_ema": 0.02,
}
#: 1 s hold-off (the default): the flood below lasts ~4 of them.
INTERVAL_S = 1.0


def test_the_gate_answers_at_once_then_once_per_interval_with_one_trailing_answer() -> None:
    from switchyard.engine_agents.core.announce import AnnounceGate

    gate = AnnounceGate(1.0)
    assert gate.offer(10.0) == 0.0  # the first: at once
    assert gate.offer(10.2) == pytest.approx(0.8)  # during the hold-off: one trailing answer at its end
    assert gate.offer(10.5) is None and gate.offer(10.9) is None  # covered by it
    gate.answered(11.0)
    assert gate.offer(11.5) == pytest.approx(0.5)  # the trailing answer started a hold-off of its own
    gate.answered(12.0)
    assert gate.offer(13.5) == 0.0  # quiet for longer than the interval: at once again
    with pytest.raises(ValueError):
        AnnounceGate(0.0)


class Fleet:
    """Per-role credentials for services and eight engines, on a nats-server that logs its slow consumers."""

    def __init__(self, root: Path) -> None:
        self.subjects = Subjects("p" + uuid.uuid4().hex[:8])
        self.credentials = Credentials.generate([*SERVICE_ROLES, *(engine_user(e) for e in ENGINES)])
        self.credentials_path = root / "credentials.json"
        self.credentials.save(self.credentials_path)
        block = render_authorization(self.subjects, self.credentials)
        self.server = EmbeddedNats(root / "nats", extra_config=f"max_pending: {MAX_PENDING}\n{block}")
        self.root = root

    def settings(self) -> SwitchyardSettings:
        return SwitchyardSettings(
            nats_servers=[self.server.url],
            subject_prefix=self.subjects.prefix,
            nats_credentials=self.credentials_path,
            nats_initial_connect_s=3.0,
            announce_min_interval_s=INTERVAL_S,
        )

    async def raw(self, role: str, name: str) -> nats.NATS:
        creds = self.credentials.users[role]
        return await nats.connect(
            self.server.url,
            name=name,
            user=creds["user"],
            password=creds["password"],
            inbox_prefix=f"_INBOX_{creds['user']}",
            error_cb=_ignore,
        )

    def slow_consumers(self, since: int = 0) -> list[str]:
        log = self.server.log_path.read_text(errors="replace")[since:]
        return re.findall(r".*Slow Consumer.*", log)


async def _ignore(_exc: Exception) -> None:
    pass


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("announce-flood"))
    f.server.start()
    yield f
    f.server.stop()


@asynccontextmanager
async def engines(fleet: Fleet) -> AsyncIterator[list[EngineAgent]]:
    """Eight engine agents, each on its own connection under its own credentials; no periodic hello in a test."""
    agents = []
    for engine_id in ENGINES:
        bus = await Bus.connect(fleet.settings(), name=engine_id, role=engine_user(engine_id))
        message = hello(engine_id, engine_id, [f"{engine_id}-gpu0"], role="decode").model_copy(
            update={"hello_interval_s": 60.0}
        )
        agents.append(EngineAgent(bus, message, lambda: IDLE))
    try:
        for agent in agents:
            await agent.start()
        yield agents
    finally:
        for agent in agents:
            await agent.stop()
            await agent.bus.close()


async def _flood(nc: nats.NATS, subject: str, count: int, batches: int, every_s: float) -> None:
    """`count` announces in `batches` bursts `every_s` apart (bounded in count and in time, loopback only)."""
    payload = encode(Announce(requester="flood"))
    for _ in range(batches):
        for _ in range(count // batches):
            await nc.publish(subject, payload)
        await nc.flush()
        await asyncio.sleep(every_s)


async def test_an_announce_flood_costs_each_engine_about_one_hello_per_interval(fleet: Fleet) -> None:
    """5,000 announces from the read-only credential over ~4–5 s: each engine sends at most ~one hello per
    `announce_min_interval_s` (+1), not one per announce; a service that starts during the flood still gets a
    fresh hello from every engine (sent after it asked) while the flood goes on."""
    watch = await fleet.raw("admin", "watch")
    sent: dict[str, list[float]] = {e: [] for e in ENGINES}

    async def count(msg) -> None:
        engine_id = msg.subject.split(".")[2]
        sent[engine_id].append(time.monotonic())

    await watch.subscribe(fleet.subjects.all_hello, cb=count)
    await watch.flush()
    flooder = await fleet.raw("readonly", "flood")
    late = await Bus.connect(fleet.settings(), name="late-service", role="api")
    fresh: dict[str, float] = {}
    try:
        async with engines(fleet):
            await eventually(lambda: _true(all(sent.values())), timeout=20)  # every start-up hello is in
            started = time.monotonic()
            flood = asyncio.create_task(_flood(flooder, fleet.subjects.announce, 5000, 20, 0.2))
            await asyncio.sleep(1.0)
            asked = time.time()

            def on_hello(message: Hello, _msg: object) -> None:
                if message.ts >= asked:
                    fresh.setdefault(message.engine_id, message.ts)

            await late.subscribe(late.subjects.all_hello, Hello, on_hello)
            await FleetView().subscribe(late, "late-service", telemetry=False)  # subscribes, then announces
            await flood
            flood_end = time.time()
            flood_s = time.monotonic() - started
            await asyncio.sleep(2 * INTERVAL_S)  # the trailing hellos of the last hold-off
            counts = {e: sum(t >= started for t in times) for e, times in sent.items()}
    finally:
        await late.close()
        await flooder.close()
        await watch.close()
    bound = int(flood_s / INTERVAL_S) + 1 + 2  # + the trailing hello + the one after the flood (its last hold-off)
    assert max(counts.values()) <= bound, (counts, flood_s)  # was ~5,000 each (one per announce)
    assert min(counts.values()) >= 2, counts  # answered at once and at least once more during the flood
    assert set(fresh) == set(ENGINES), fresh
    assert all(ts < flood_end for ts in fresh.values()), (fresh, flood_end)


async def _true(value: bool) -> bool:
    return value


def _start_placement(fleet: Fleet, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env.update(
        {
            "SWITCHYARD_NATS_SERVERS": fleet.server.url,
            "SWITCHYARD_NATS_CREDENTIALS": str(fleet.credentials_path),
            "SWITCHYARD_SUBJECT_PREFIX": fleet.subjects.prefix,
            "SWITCHYARD_DATABASE_URL": f"sqlite:///{fleet.root / 'placement.db'}",
            "SWITCHYARD_LOG_LEVEL": "INFO",
        }
    )
    argv = [sys.executable, "-m", "switchyard.cli", "placement"]
    return subprocess.Popen(argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


async def test_placement_is_not_cut_off_by_an_announce_flood(fleet: Fleet, tmp_path: Path) -> None:
    """The placement service (a process of its own) and eight engines through 5,000 announces from the
    read-only credential, placement stalled meanwhile (SIGSTOP for the flood, as a loaded machine starves a
    process; `bench/announce_flood.py` shows the same cut-off without it, over a longer flood): nats-server cuts
    no connection off as a slow consumer, and placement carries on. Before, each announce made every engine say
    hello and placement took each hello twice: ~28 MB piled up for its ingest and the server cut it off."""
    log = tmp_path / "placement.log"
    placement = _start_placement(fleet, log)
    flooder = await fleet.raw("readonly", "flood")
    try:
        await eventually(lambda: _true("placement service ready" in log.read_text(errors="replace")), timeout=90)
        async with engines(fleet):
            await asyncio.sleep(0.5)
            since = fleet.server.log_path.stat().st_size
            placement.send_signal(signal.SIGSTOP)
            try:
                await _flood(flooder, fleet.subjects.announce, 5000, 20, 0.2)
                await asyncio.sleep(2 * INTERVAL_S)  # the engines' answers are out
            finally:
                placement.send_signal(signal.SIGCONT)
            await asyncio.sleep(3 * INTERVAL_S)  # placement reads what piled up (or the server has cut it off)
            cut = fleet.slow_consumers(since)
        assert placement.poll() is None, log.read_text(errors="replace")[-2000:]
    finally:
        await flooder.close()
        placement.terminate()
        try:
            placement.wait(20)
        except subprocess.TimeoutExpired:
            placement.kill()
    assert cut == [], cut
    assert "reconnect" not in log.read_text(errors="replace").lower()


async def test_engines_sharing_a_connection_take_each_announce_once(fleet: Fleet) -> None:
    """Four engine agents on one connection (as the simulated fleet runs them): the server sends the process
    each announce once, not once per engine (counted by the connection's received messages), yet an announce
    for all reaches every engine and one naming an engine only that one."""
    bus = await Bus.connect(fleet.settings(), name="engines", role="admin")
    watch = await fleet.raw("admin", "watch")
    heard: list[str] = []

    async def count(msg) -> None:
        heard.append(msg.subject.split(".")[2])

    await watch.subscribe(fleet.subjects.all_hello, cb=count)
    await watch.flush()
    agents = [
        EngineAgent(bus, hello(e, e, [f"{e}-gpu0"], role="decode").model_copy(update={"hello_interval_s": 60.0}), _idle)
        for e in ENGINES[:4]
    ]
    try:
        for agent in agents:
            await agent.start()
        await eventually(lambda: _true(len(heard) == 4), timeout=20)  # the start-up hellos
        await asyncio.sleep(INTERVAL_S)  # the first announce below is answered at once
        received = bus.nc.stats["in_msgs"]
        await watch.publish(fleet.subjects.announce, encode(Announce(requester="test")))
        await watch.publish(fleet.subjects.announce, encode(Announce(requester="test", engine_id=ENGINES[1])))
        await watch.flush()
        await eventually(lambda: _true(len(heard) >= 4 + 4 + 1), timeout=20)  # all four, then e1's trailing one
        await asyncio.sleep(0.5)
        assert sorted(heard[4:]) == sorted([*ENGINES[:4], ENGINES[1]]), heard
        assert bus.nc.stats["in_msgs"] - received == 2  # was 8: one copy per engine's subscription
    finally:
        for agent in agents:
            await agent.stop()
        await bus.close()
        await watch.close()


def _idle() -> dict[str, float | int | bool]:
    return dict(IDLE)


async def test_the_gateways_stub_engine_answers_announces_at_the_same_rate(fleet: Fleet) -> None:
    """The gateway's stub engine answers announces by the same rule: 500 announces in one burst cost it the
    answer at once and one trailing hello (was 500)."""
    from switchyard.engine_agents.stub import StubConfig, StubEngine

    bus = await Bus.connect(fleet.settings(), name="stub", role="admin")
    watch = await fleet.raw("admin", "watch")
    heard: list[float] = []

    async def count(msg) -> None:
        heard.append(time.monotonic())

    await watch.subscribe(fleet.subjects.hello("stub0"), cb=count)
    await watch.flush()
    stub = StubEngine(StubConfig(hello_interval_s=60.0, telemetry_interval_s=60.0), bus)
    await stub.start()
    try:
        await eventually(lambda: _true(len(heard) == 1), timeout=20)  # its start-up hello
        await asyncio.sleep(INTERVAL_S)
        await _flood(watch, fleet.subjects.announce, 500, 1, 0.0)
        await eventually(lambda: _true(len(heard) >= 3), timeout=20)
        await asyncio.sleep(2 * INTERVAL_S)  # nothing more comes
        assert len(heard) == 3, len(heard)
    finally:
        await stub.stop()
        await bus.close()
        await watch.close()
