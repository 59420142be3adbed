"""Issue 29's skipped plans, replayed with the default settings: how long until each is applied.

The plans consumer's filter is rewritten (to the calibration requests, as `readonly` could before the
permissions were fixed, as `admin` still can) while four groups each get a plan: the migration service
fetches past them. Before the reconciliation they stayed `published` for ever. Now the service sets the
filter back within `SWITCHYARD_MIGRATION_RECONCILE_S` (10 s) and takes the plans up once they are
`SWITCHYARD_MIGRATION_SKIPPED_PLAN_S` (60 s) old; a fifth plan published after the repair comes through the
consumer as usual. Simulated engines (instant steps), embedded NATS, SQLite.

    .venv/bin/python bench/skipped_plans.py

Prints figures; asserts nothing (see DESIGN.md: benchmarks report, tests assert).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

import numpy as np
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError
from sqlalchemy import select

from switchyard.engine_agents.sim.live.migration import MigrationCost, SimExpertGroup, serve_migrate
from switchyard.services.history import add_placement
from switchyard.services.migration.service import MigrationService
from switchyard.services.migration.settings import MigrationSettings
from switchyard.shared.bus import Bus
from switchyard.shared.db import Placement, create_async_db, upgrade
from switchyard.shared.embedded import EmbeddedNats
from switchyard.shared.schemas import Capacity, Hello, ModelShape, ObjectiveTerms, PlacementParams, PlacementPlan
from switchyard.shared.settings import SwitchyardSettings
from switchyard.solver.placement.layouts import default_layout

LAYERS, EXPERTS, GPUS, GROUPS = 4, 8, 2, 4


def _hello(group: str) -> Hello:
    return Hello(
        engine_id=f"{group}-e0", role="dp", ep_group=group, dp_rank=0, gpus=[f"{group}-gpu{g}" for g in range(GPUS)],
        model=ModelShape(name="bench", num_layers=LAYERS, num_experts=EXPERTS, top_k=2), agent="sim", ts=time.time(),
        capacity=Capacity(max_running=64, kv_blocks=1024, block_size=16), hello_interval_s=1.0,
    )  # fmt: skip


def _plan(group: str, version: int, rng: np.random.Generator) -> PlacementPlan:
    layout = default_layout(LAYERS, EXPERTS, GPUS)
    for layer in range(LAYERS):
        layout[layer] = rng.permutation(layout[layer].reshape(-1)).reshape(GPUS, -1)
    return PlacementPlan(
        plan_id=f"{group}-v{version}", version=version, engine_group=group, created_at=time.time(), source="greedy",
        gpus=[f"{group}-gpu{g}" for g in range(GPUS)], placement=layout, moves=np.zeros((0, 6), np.int32),
        objective=ObjectiveTerms(load=1.0, comm=1.0, mig=0.0, total=2.0),
        params=PlacementParams(alpha=1, beta=0, gamma=1),
    )  # fmt: skip


async def run(database_url: str) -> None:
    upgrade(database_url)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as store, EmbeddedNats(Path(store)) as nats:
        settings = SwitchyardSettings(nats_servers=[nats.url], database_url=database_url, subject_prefix="bench")
        bus = await Bus.connect(settings)
        await bus.ensure_streams()
        subjects, durable = bus.subjects, bus.subjects.migration_plans
        groups = [f"g{i}" for i in range(GROUPS)]
        engines = {
            g: SimExpertGroup(g, default_layout(LAYERS, EXPERTS, GPUS), MigrationCost(time_scale=0.0)) for g in groups
        }
        for group, engine in engines.items():
            await serve_migrate(bus, f"{group}-e0", engine)

        async def announce() -> None:
            while True:
                for group in groups:
                    await bus.publish(subjects.hello(f"{group}-e0"), _hello(group))
                await asyncio.sleep(0.5)

        announcing = asyncio.create_task(announce())
        db, sessions = create_async_db(database_url)
        stop = asyncio.Event()
        service = MigrationService(
            settings, MigrationSettings()
        )  # the defaults: skipped after 60 s, checked every 10 s
        task = asyncio.create_task(service.run(stop))
        while True:
            with contextlib.suppress(NotFoundError):
                await bus.js.consumer_info(durable.stream, durable.name)
                break
            await asyncio.sleep(0.05)
        rewrite = ConsumerConfig(
            durable_name=durable.name, filter_subject=subjects.calibration_request, ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30.0, max_deliver=-1,
        )  # fmt: skip
        await bus.js.add_consumer(durable.stream, config=rewrite)
        started = time.monotonic()
        published: dict[str, float] = {}
        plans = [_plan(g, 1, rng) for g in groups]
        for plan in plans:
            async with sessions() as session, session.begin():
                await add_placement(session, plan, "published")  # what placement stores, then marks, around publishing
            await bus.js_publish(subjects.placement_plan, plan, msg_id=plan.plan_id)
            published[plan.plan_id] = time.monotonic()
        repaired_at: float | None = None
        applied: dict[str, float] = {}
        late: PlacementPlan | None = None
        while len(applied) < len(plans) + 1:
            info = await bus.js.consumer_info(durable.stream, durable.name)
            if repaired_at is None and info.config.filter_subject == subjects.placement_plan:
                repaired_at = time.monotonic()
                late = _plan(groups[0], 2, rng)  # after the repair: delivered by the consumer again
            if late is not None and late.plan_id not in published and groups[0] + "-v1" in applied:
                async with sessions() as session, session.begin():
                    await add_placement(session, late, "published")
                await bus.js_publish(subjects.placement_plan, late, msg_id=late.plan_id)
                published[late.plan_id] = time.monotonic()
            async with sessions() as session:
                rows = (await session.execute(select(Placement.plan_id, Placement.status))).all()
            for plan_id, status in rows:
                if status == "applied":
                    applied.setdefault(plan_id, time.monotonic())
            await asyncio.sleep(0.1)
        stop.set()
        await task
        announcing.cancel()
        await db.dispose()
        await bus.close()
    print(f"filter set back {repaired_at - started:.1f} s after the rewrite")  # type: ignore[operator]
    for plan in plans:
        took = applied[plan.plan_id] - published[plan.plan_id]
        print(f"skipped plan {plan.plan_id}: applied {took:.1f} s after publishing")
    assert late is not None
    took = applied[late.plan_id] - published[late.plan_id]
    print(f"plan {late.plan_id}, published after the repair: applied {took:.2f} s after publishing")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(f"sqlite:///{Path(tmp) / 'bench.sqlite'}"))


if __name__ == "__main__":
    main()
