"""The live simulated fleet over a real nats-server: the engine protocol, routing at the handoff, fallbacks,
expert-load windows, routing samples, migration, and a router restarted under it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from switchyard.engine_agents.sim.live.engines import LiveFleet, LiveFleetConfig
from switchyard.engine_agents.sim.live.loadgen import LoadGenerator
from switchyard.engine_agents.sim.live.migration import MigrationCost
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode
from switchyard.shared.errors import RemoteError
from switchyard.shared.schemas import (
    ExpertLoad,
    Hello,
    MigrateReply,
    MigrateRequest,
    RouteDecodeReply,
    RouteDecodeRequest,
    RoutingSample,
    Telemetry,
)
from switchyard.shared.settings import SwitchyardSettings
from switchyard.simulator.offline.scenario import Scenario, prepare
from switchyard.solver.placement.moves import plan_moves
from tests.conftest import SHIPPED_DATA

ESFT = SHIPPED_DATA / "routing" / "esft_deepseek_v2_lite"


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return prepare(ESFT, gpu="H100", seed=0)


def _config(**kw: object) -> LiveFleetConfig:
    base = dict(
        prefill=1,
        decode=3,
        gpus_per_decoder=2,
        speed=4.0,
        telemetry_interval_s=0.05,
        load_window_s=0.3,
        routing_sample_fraction=1.0,
        migration=MigrationCost(time_scale=0.0),
    )
    return LiveFleetConfig(**{**base, **kw})  # type: ignore[arg-type]


async def _collect(bus: Bus, subject: str, schema: type, into: list) -> None:
    await bus.subscribe(subject, schema, lambda m, _: into.append(m))


async def _run_load(bus: Bus, scenario: Scenario, fleet: LiveFleet, n: int, rate: float) -> LoadGenerator:
    workload = scenario.workload(n, seed=3, rate=rate, max_tokens=min(fleet.max_tokens, 2048))
    loadgen = LoadGenerator(bus, workload, fleet.config.prefill_ids(), speed=fleet.config.speed)
    await loadgen.listen()
    await loadgen.run()
    assert await loadgen.drain(timeout_s=60), f"{len(loadgen.completions)} of {loadgen.sent} completed"
    return loadgen


async def test_fleet_speaks_the_protocol_and_every_request_finishes_once(
    bus: Bus, settings: SwitchyardSettings, scenario: Scenario
) -> None:
    hellos: list[Hello] = []
    telemetry: list[Telemetry] = []
    await _collect(bus, bus.subjects.all_hello, Hello, hellos)
    await _collect(bus, bus.subjects.all_telemetry, Telemetry, telemetry)
    router = RouterService(settings, RouterSettings(policy="jsq"))
    await router.start()
    fleet = LiveFleet(scenario, _config())
    await fleet.start(bus)
    try:
        loadgen = await _run_load(bus, scenario, fleet, n=60, rate=40.0)
        done = loadgen.completions
        assert len(done) == 60 and fleet.counters.completed == 60 and fleet.in_flight() == 0
        assert sum(done.by_engine.values()) == 60 and set(done.by_engine) <= set(fleet.config.decode_ids())
        assert not done.fallbacks  # the router answered every handoff
        assert min(done.ttft) > 0 and min(done.tpot) > 0
        engines = set(fleet.config.prefill_ids()) | set(fleet.config.decode_ids())
        assert {h.engine_id for h in hellos} == engines
        assert {h.role for h in hellos if h.engine_id.startswith("sim-d")} == {"decode"}
        by_engine: dict[str, list[int]] = {}
        for t in telemetry:
            by_engine.setdefault(t.engine_id, []).append(t.seq)
        assert set(by_engine) == engines
        for seqs in by_engine.values():  # one engine's sequence numbers increase by one from 0
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] == 0
    finally:
        await fleet.stop()
        await router.stop()


async def test_expert_load_and_routing_samples_reach_jetstream(
    bus: Bus, settings: SwitchyardSettings, scenario: Scenario
) -> None:
    router = RouterService(settings, RouterSettings(policy="rr"))
    await router.start()
    fleet = LiveFleet(scenario, _config())
    await fleet.start(bus)
    try:
        loadgen = await _run_load(bus, scenario, fleet, n=30, rate=40.0)
        await asyncio.sleep(0.5)  # one more load window
    finally:
        await fleet.stop()
        await router.stop()
    s = bus.subjects
    loads = await _stream(bus, s.expert_load_stream, ExpertLoad)
    assert {m.engine_id for m in loads} <= set(fleet.config.decode_ids()) and loads
    layers, experts = scenario.model.moe_layers, scenario.model.num_experts
    for m in loads:
        assert m.expert_counts.shape == (layers, experts) and m.source_counts.shape == (layers, 1, experts)
    # every decode token selects top-k experts at every layer: the windows hold exactly tokens x k per layer
    tokens = sum(int(m.expert_counts[0].sum()) for m in loads) // scenario.trace.top_k
    assert tokens == loadgen.completions.tokens
    samples = await _stream(bus, s.routing_samples_stream, RoutingSample)
    assert len(samples) == 30  # routing_sample_fraction = 1
    assert all(sample.prefill_counts.shape == (layers, experts) for sample in samples)


async def _stream(bus: Bus, stream: str, schema: type) -> list:
    info = await bus.js.stream_info(stream)
    messages = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        messages.append(decode((await bus.js.get_msg(stream, seq)).data, schema))
    return messages


async def test_without_a_router_prefill_engines_fall_back_and_nothing_is_lost(bus: Bus, scenario: Scenario) -> None:
    fleet = LiveFleet(scenario, _config(route_timeout_s=0.05))
    await fleet.start(bus)
    try:
        loadgen = await _run_load(bus, scenario, fleet, n=20, rate=40.0)
    finally:
        await fleet.stop()
    assert len(loadgen.completions) == 20
    assert loadgen.completions.fallbacks["router_unavailable"] == 20
    assert fleet.counters.route_fallbacks == 20


async def test_a_migration_changes_the_decoders_expert_ranks(bus: Bus, scenario: Scenario) -> None:
    fleet = LiveFleet(scenario, _config(decode=1))
    await fleet.start(bus)
    try:
        decoder = fleet.decoders["sim-d0"]
        before = decoder.group.layout.copy()
        target = before.copy()
        target[0, [0, 1]] = target[0, [1, 0]]  # swap the two GPUs' experts of layer 0
        moves = plan_moves(before[:1], target[:1], buffer=True)
        reply = await bus.request(
            bus.subjects.migrate("sim-d0"),
            MigrateRequest(plan_id="p1", version=1, engine_group="sim-d0", step=0, moves=moves.astype(np.int32)),
            MigrateReply,
            timeout=5,
        )
        assert reply.failure is None and reply.applied == len(moves)
        np.testing.assert_array_equal(decoder.group.layout[0], target[0])
        old_masks = decoder.engine.rank_masks.copy()
        decoder.wake.set()  # the step loop picks up the new layout before its next step
        await _run_load(bus, scenario, fleet, n=3, rate=40.0)
        assert not np.array_equal(decoder.engine.rank_masks[:, 0], old_masks[:, 0])
        np.testing.assert_array_equal(decoder.engine.rank_masks[:, 0], old_masks[::-1, 0])
        np.testing.assert_array_equal(decoder.engine.rank_masks[:, 1:], old_masks[:, 1:])
    finally:
        await fleet.stop()


def _start_router(nats_url: str, prefix: str, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "SWITCHYARD_NATS_SERVERS": nats_url,
        "SWITCHYARD_SUBJECT_PREFIX": prefix,
        "SWITCHYARD_ROUTER_POLICY": "jsq",
        "SWITCHYARD_LOG_LEVEL": "INFO",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "switchyard.cli", "router"],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


#: Far inside the 60 s hello interval of the router-restart test: an answer by then came from announces.
REBUILT_WITHIN_S = 15.0


async def _first_answer(bus: Bus, deadline_s: float) -> tuple[RouteDecodeReply, float]:
    start = time.monotonic()
    while True:
        try:
            reply = await bus.request(
                bus.subjects.route_decode,
                RouteDecodeRequest(request_id="probe", prompt_tokens=10),
                RouteDecodeReply,
                timeout=0.2,
            )
            return reply, time.monotonic() - start
        except (RemoteError, TimeoutError, Exception) as exc:  # no responders / unavailable while rebuilding
            if time.monotonic() - start > deadline_s:
                raise AssertionError(f"no routing answer within {deadline_s} s: {exc}") from exc
            await asyncio.sleep(0.02)


def _log_text(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


async def _wait_ready(log: Path, timeout_s: float) -> None:
    """Until the router process logs that it is serving (subscribed, fleet asked to announce itself)."""
    deadline = time.monotonic() + timeout_s
    while "serving" not in (text := await asyncio.to_thread(_log_text, log)):
        assert time.monotonic() < deadline, text[-2000:]
        await asyncio.sleep(0.02)


async def test_a_killed_router_answers_again_with_the_fleet_rebuilt_from_announces(
    bus: Bus, settings: SwitchyardSettings, scenario: Scenario, nats_url: str, tmp_path: Path
) -> None:
    """SIGKILL a router process under a live fleet; the restarted one routes again, over the whole fleet, rebuilt
    from the bus alone. Hellos come only every 60 s, so an answer within `REBUILT_WITHIN_S` of its subscribing can
    only come from the announce it asks for. How fast is for `make chaos` to report (a router fault's recovery
    time), not for an assertion here: a bound of 2 s failed on a loaded machine."""
    # hellos only every 60 s: a restarted router can only know the fleet by asking it to announce itself
    fleet = LiveFleet(scenario, _config(hello_interval_s=60.0))
    await fleet.start(bus)
    first = _start_router(nats_url, settings.subject_prefix, tmp_path / "router-1.log")
    try:
        await _wait_ready(tmp_path / "router-1.log", 60)
        reply, _ = await _first_answer(bus, 10)
        assert reply.engine_id in fleet.config.decode_ids()
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        second = _start_router(nats_url, settings.subject_prefix, tmp_path / "router-2.log")
        try:
            await _wait_ready(tmp_path / "router-2.log", 60)
            reply, _seconds = await _first_answer(bus, REBUILT_WITHIN_S)
            assert reply.engine_id in fleet.config.decode_ids()
            # its state is the whole fleet: least-loaded routing with in-flight compensation uses every decoder
            # (within 12 requests, not 6: on a loaded machine the compensation of the first can lapse, with the
            # inflight grace, before the last is asked; a decoder the router does not know is never chosen)
            chosen = set()
            for i in range(12):
                if chosen == set(fleet.config.decode_ids()):
                    break
                chosen.add(
                    (
                        await bus.request(
                            bus.subjects.route_decode,
                            RouteDecodeRequest(request_id=f"after-{i}", prompt_tokens=10),
                            RouteDecodeReply,
                            timeout=1,
                        )
                    ).engine_id
                )
            assert chosen == set(fleet.config.decode_ids())
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(20) == 0
    finally:
        if first.poll() is None:
            first.kill()
        await fleet.stop()


async def test_prefill_engines_cache_prefixes_and_report_the_hit_rate(bus: Bus, scenario: Scenario) -> None:
    """Submits with a JSONL trace's hash ids: a repeated prefix hits the prefill engine's cache, reported back."""
    from switchyard.simulator.core.workload import Workload

    fleet = LiveFleet(scenario, _config(route_timeout_s=0.05))
    prompt = np.array([4096 + 100, 4096 + 300, 4096 + 50])
    workload = Workload(
        arrival=np.arange(3) * 1.0,
        prompt=prompt,
        output=np.array([3, 3, 3]),
        replay=np.arange(3),
        description="shared prefix",
        hash_ids=tuple(np.r_[np.arange(8), 100 + i] for i in range(3)),
        hash_block=512,
    )
    await fleet.start(bus)
    try:
        loadgen = LoadGenerator(bus, workload, fleet.config.prefill_ids(), speed=fleet.config.speed)
        await loadgen.listen()
        await loadgen.run()
        assert await loadgen.drain(timeout_s=30)
        summary = loadgen.completions.summary()
        assert summary["prefix_hit_rate"] == pytest.approx(2 * 4096 / prompt.sum())
    finally:
        await fleet.stop()
