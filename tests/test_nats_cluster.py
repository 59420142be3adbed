"""A 3-node JetStream cluster (replicas 3) loses one node under load: nothing stored is lost or duplicated.

The router, the simulated fleet (routing samples on), a load generator and the migration service run in this
process against three nats-servers started from the shipped binary; plans are published as the placement
outbox does (msg-id = plan id, resent until acknowledged). The node leading the plans' stream is SIGKILLed for
a few seconds, then restarted on its port and store. `make chaos ARGS="--nats-cluster 3 --faults nats-node"`
is the same fault on the whole loop as processes, measured (docs/reliability.md, "A NATS cluster").
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from switchyard.engine_agents.sim.live.engines import LiveFleet, LiveFleetConfig
from switchyard.engine_agents.sim.live.loadgen import LoadGenerator
from switchyard.engine_agents.sim.live.migration import MigrationCost
from switchyard.engine_agents.sim.live.protocol import SimCompleted
from switchyard.services.migration.service import run_migration
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode
from switchyard.shared.db import Migration, MigrationMove, create_async_db, upgrade
from switchyard.shared.errors import ConfigError
from switchyard.shared.nats_cluster import NatsCluster
from switchyard.shared.schemas import PlacementPlan, RoutingSample
from switchyard.shared.settings import SwitchyardSettings
from switchyard.simulator.offline.scenario import Scenario, prepare
from tests.conftest import SHIPPED_DATA
from tests.fleet_helpers import plan, shuffled
from tests.helpers import eventually

pytestmark = pytest.mark.slow

FINAL = ("succeeded", "failed", "rolled_back", "refused")


@pytest.fixture
def cluster(tmp_path: Path):
    nats = NatsCluster(tmp_path / "nats", 3)
    nats.start()
    yield nats
    nats.stop()


def _settings(cluster: NatsCluster, tmp_path: Path, replicas: int = 3, **kw: object) -> SwitchyardSettings:
    return SwitchyardSettings(
        nats_servers=cluster.urls,
        stream_replicas=replicas,
        data_dir=tmp_path / "data",
        nats_initial_connect_s=10.0,
        **kw,  # type: ignore[arg-type]
    )


async def _stored(bus: Bus, stream: str) -> list[tuple[bytes, dict[str, str]]]:
    """Every message of `stream` by sequence (data, headers)."""
    info = await bus.js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await bus.js.get_msg(stream, seq)
        out.append((msg.data, dict(msg.headers or {})))
    return out


async def test_replicas_follow_the_setting_and_a_single_server_refuses_more_than_one(
    cluster: NatsCluster, tmp_path: Path, settings: SwitchyardSettings
) -> None:
    one = await Bus.connect(_settings(cluster, tmp_path, replicas=1), name="r1")
    three = await Bus.connect(_settings(cluster, tmp_path, replicas=3), name="r3")
    try:
        assert set((await one.ensure_streams()).values()) == {"created"}
        await one.ensure_kv(one.subjects.router_bucket)
        s = one.subjects
        names = [*s.streams(), f"KV_{s.router_bucket}"]
        assert {(await one.js.stream_info(n)).config.num_replicas for n in names} == {1}
        # An R1 deployment moved to a cluster: the next start copies every stream and bucket to 3 nodes.
        assert set((await three.ensure_streams()).values()) == {"updated"}
        await three.ensure_kv(s.router_bucket)
        assert {(await three.js.stream_info(n)).config.num_replicas for n in names} == {3}
        assert set((await three.ensure_streams()).values()) == {"unchanged"}
    finally:
        await one.close()
        await three.close()
    single = await Bus.connect(settings.model_copy(update={"stream_replicas": 3}), name="single")
    try:
        with pytest.raises(ConfigError, match="SWITCHYARD_STREAM_REPLICAS above 1 needs a JetStream cluster"):
            await single.ensure_streams()
    finally:
        await single.close()


def _fleet_config() -> LiveFleetConfig:
    return LiveFleetConfig(
        prefill=1,
        decode=2,
        gpus_per_decoder=2,
        speed=4.0,
        telemetry_interval_s=0.05,
        load_window_s=0.3,
        routing_sample_fraction=1.0,
        migration=MigrationCost(time_scale=0.0),
    )


async def test_one_node_killed_under_load_loses_and_duplicates_nothing(cluster: NatsCluster, tmp_path: Path) -> None:
    scenario: Scenario = prepare(SHIPPED_DATA / "routing" / "esft_deepseek_v2_lite", gpu="H100", seed=0)
    database_url = f"sqlite:///{tmp_path / 'cluster.db'}"
    await asyncio.to_thread(upgrade, database_url)
    settings = _settings(cluster, tmp_path, database_url=database_url)
    bus = await Bus.connect(settings, name="test")
    fleet_bus = await Bus.connect(settings, name="fleet")  # its own connection, as the fleet's own process has
    await bus.ensure_streams()
    s = bus.subjects
    stop_migration = asyncio.Event()
    migration = asyncio.create_task(run_migration(settings, stop_migration))
    router = RouterService(settings, RouterSettings(policy="jsq"))
    await router.start()
    fleet = LiveFleet(scenario, _fleet_config())
    await fleet.start(fleet_bus)
    engine, sessions = create_async_db(database_url)
    decoder = fleet.decoders["sim-d0"]
    base = decoder.group.layout.copy()
    published: list[str] = []
    done_publishing = asyncio.Event()

    async def publish_plans() -> None:
        """The placement outbox's contract: a plan is resent until JetStream acknowledges it (same msg-id)."""
        version = 0
        while not done_publishing.is_set():
            version += 1
            target = plan("sim-d0", version, shuffled(base, version), plan_id=f"sim-d0-v{version}")
            while True:
                try:
                    await bus.js_publish(s.placement_plan, target, msg_id=target.plan_id)
                    break
                except Exception:
                    await asyncio.sleep(0.2)
            published.append(target.plan_id)
            await asyncio.sleep(0.4)

    wall_rate, duration = 20.0, 11.0  # requests per wall second: the workload's clock runs `speed` times faster
    speed = fleet.config.speed
    workload = scenario.workload(
        int(wall_rate * duration), seed=3, rate=wall_rate / speed, max_tokens=min(fleet.max_tokens, 1024)
    )
    loadgen = LoadGenerator(bus, workload, fleet.config.prefill_ids(), speed=speed)
    await loadgen.listen()
    finished_at: list[float] = []
    await bus.subscribe(s.sim_completed, SimCompleted, lambda _done, _msg: finished_at.append(time.monotonic()))
    try:
        load = asyncio.create_task(loadgen.run())
        plans = asyncio.create_task(publish_plans())
        await asyncio.sleep(3.0)
        leader = (await bus.js.stream_info(s.placement_stream)).cluster.leader
        meta = await asyncio.to_thread(cluster.meta_leader)
        victim = cluster.node(leader)
        done_before = len(loadgen.completions)
        killed_at = time.monotonic()
        await asyncio.to_thread(victim.kill)
        await asyncio.sleep(4.0)
        done_during = len(loadgen.completions) - done_before
        restarted_at = time.monotonic()
        await asyncio.to_thread(victim.start)
        await asyncio.to_thread(cluster.wait_healthy, 30.0)
        back_after = time.monotonic() - killed_at
        await load
        done_publishing.set()
        await plans
        drained = await loadgen.drain(timeout_s=10)
        await asyncio.sleep(1.0)  # the last routing samples' acks

        async def settled() -> list[Migration]:
            async with sessions() as session:
                rows = list((await session.scalars(select(Migration))).all())
            finished = len(rows) == len(published) and all(r.state in FINAL for r in rows)
            return rows if finished else []

        migrations = await eventually(settled, timeout=60, every=0.3)
        async with sessions() as session:
            moves = list((await session.scalars(select(MigrationMove))).all())
        waited = time.monotonic()
        while time.monotonic() - waited < 30:  # samples are published after their request completes, acked by 2 of 3
            stored = (await bus.js.stream_info(s.routing_samples_stream)).state.messages
            if stored >= fleet.counters.completed:
                break
            await asyncio.sleep(0.3)
        pending = len(fleet._publishes)
        samples = [decode(data, RoutingSample) for data, _ in await _stored(bus, s.routing_samples_stream)]
        stored_plans = await _stored(bus, s.placement_stream)
    finally:
        done_publishing.set()
        await fleet.stop()
        await router.stop()
        stop_migration.set()
        await asyncio.wait_for(migration, 30)
        await bus.close()
        await fleet_bus.close()
        await engine.dispose()

    lost = loadgen.sent - len(loadgen.completions)
    start, end = killed_at - 0.5, restarted_at + 1.0
    around = [start, *(t for t in finished_at if start < t < end), end]
    gap = max(b - a for a, b in itertools.pairwise(around))
    print(
        f"killed {leader} (placement stream leader; meta leader {meta}) for {restarted_at - killed_at:.1f} s, "
        f"cluster healthy {back_after:.1f} s after the kill: {loadgen.sent} requests, {lost} lost, "
        f"{done_during} completed while it was down, longest gap between completions {gap:.2f} s; "
        f"{len(published)} plans, {len(samples)} routing samples"
    )
    # Routing went on while the node was down (the clients connected to it reconnected to the others).
    assert done_during > 0
    assert drained or lost <= 5, f"{lost} of {loadgen.sent} requests never completed"
    # Plans: each acknowledged one stored exactly once (the stream's de-duplication survived the new leader).
    plan_ids = [decode(data, PlacementPlan).plan_id for data, _ in stored_plans]
    assert Counter(plan_ids) == Counter(published)
    assert all(headers.get("Nats-Msg-Id") == pid for (_, headers), pid in zip(stored_plans, plan_ids, strict=True))
    # History: one migration row per plan, each finished; steps recorded once, applied by the engines once.
    assert sorted(m.plan_version for m in migrations) == list(range(1, len(published) + 1))
    by_version = {m.plan_version: m for m in migrations}
    assert by_version[len(published)].state == "succeeded"
    for m in migrations:  # a plan still queued behind a newer one is refused as superseded: nothing else fails
        assert m.state == "succeeded" or (m.state == "refused" and "superseded" in (m.error or "")), (m.state, m.error)
    assert len({(m.migration_id, m.seq) for m in moves}) == len(moves)
    applied = decoder.group.applied_keys()
    assert len(applied) == len(set(applied))
    np.testing.assert_array_equal(decoder.group.layout, shuffled(base, len(published)))
    # Routing samples: one per completed request (fraction 1), none twice.
    ids = Counter(sample.request_id for sample in samples)
    assert not [rid for rid, n in ids.items() if n > 1]
    assert len(samples) == fleet.counters.completed, f"{pending} sample publishes still pending"
