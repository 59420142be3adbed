"""Control-plane overhead of a migration: a full 48 x 128 x 8 reshuffle through the migration service.

The simulated engines apply steps instantly (time_scale 0), so the wall time is the service's own cost: one
`MigrateRequest` round trip and two committed database transactions per step (`sent`, then `applied`).
Also times the pure parts: the placement decision (`solver.placement.place` + gain test) and step planning.

    .venv/bin/python bench/migration_overhead.py [--database-url postgresql://...]

Prints figures; asserts nothing (see DESIGN.md: benchmarks report, tests assert).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np
from sqlalchemy import select

from switchyard.engine_agents.sim.live.migration import MigrationCost, SimExpertGroup, serve_migrate
from switchyard.services.migration.planner import plan_steps
from switchyard.services.migration.service import run_migration
from switchyard.services.migration.settings import MigrationSettings
from switchyard.shared.bus import Bus
from switchyard.shared.db import Migration, create_async_db, upgrade
from switchyard.shared.embedded import EmbeddedNats
from switchyard.shared.schemas import Capacity, Hello, ModelShape, ObjectiveTerms, PlacementParams, PlacementPlan
from switchyard.shared.settings import SwitchyardSettings
from switchyard.solver.placement import DEFAULT_PARAMS
from switchyard.solver.placement.layouts import default_layout
from switchyard.solver.placement.policy import Policy, decide

LAYERS, EXPERTS, GPUS = 48, 128, 8


def pure_parts(rng: np.random.Generator) -> np.ndarray:
    current = default_layout(LAYERS, EXPERTS, GPUS)
    source = rng.zipf(1.5, (LAYERS, 2, EXPERTS)).astype(float).clip(0, 1000)
    started = time.perf_counter()
    decision = decide(source.sum(axis=1), source, [0] * 4 + [1] * 4, current, DEFAULT_PARAMS, Policy())
    print(f"placement decision (place + gain test): {time.perf_counter() - started:.3f} s, {len(decision.moves)} moves")
    target = current.copy()
    for layer in range(LAYERS):
        target[layer] = rng.permutation(target[layer].reshape(-1)).reshape(GPUS, -1)
    started = time.perf_counter()
    steps = plan_steps(current, target)
    moves = sum(len(s) for s in steps)
    print(f"step planning, full reshuffle: {time.perf_counter() - started:.3f} s, {len(steps)} steps, {moves} moves")
    return target


async def end_to_end(database_url: str, target: np.ndarray) -> None:
    upgrade(database_url)
    with tempfile.TemporaryDirectory() as store, EmbeddedNats(Path(store)) as nats:
        settings = SwitchyardSettings(nats_servers=[nats.url], database_url=database_url, subject_prefix="bench")
        bus = await Bus.connect(settings)
        await bus.ensure_streams()
        group = SimExpertGroup("g0", default_layout(LAYERS, EXPERTS, GPUS), MigrationCost(time_scale=0.0))
        await serve_migrate(bus, "e0", group)
        engine, sessions = create_async_db(database_url)
        stop = asyncio.Event()
        service = asyncio.create_task(run_migration(settings, stop, MigrationSettings()))
        plan = PlacementPlan(
            plan_id="bench-1", version=1, engine_group="g0", created_at=time.time(), source="manual",
            gpus=[f"gpu{g}" for g in range(GPUS)], placement=target, moves=np.zeros((0, 6), np.int32),
            objective=ObjectiveTerms(load=0, comm=0, mig=0, total=0), params=PlacementParams(alpha=1, beta=1, gamma=1),
        )  # fmt: skip
        coordinator = Hello(
            engine_id="e0", role="dp", ep_group="g0", gpus=plan.gpus, ts=time.time(), agent="sim",
            model=ModelShape(name="bench", num_layers=LAYERS, num_experts=EXPERTS, top_k=8),
            capacity=Capacity(max_running=64, kv_blocks=1024, block_size=16),
        )  # fmt: skip
        for _ in range(20):  # until the service has subscribed and heard it
            await bus.publish(bus.subjects.hello("e0"), coordinator)
            await asyncio.sleep(0.05)
        started = time.perf_counter()
        await bus.js_publish(bus.subjects.placement_plan, plan, msg_id=plan.plan_id)
        while True:
            async with sessions() as session:
                migration = await session.scalar(select(Migration))
            if migration is not None and migration.state == "succeeded":
                break
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - started
        assert np.array_equal(group.layout, target)
        steps = len(group.applications)
        backend = database_url.split(":")[0]
        print(f"migration service, {backend}: {steps} steps in {elapsed:.2f} s ({1000 * elapsed / steps:.1f} ms/step)")
        stop.set()
        await service
        await engine.dispose()
        await bus.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database-url", default=None, help="default: a temporary SQLite file")
    args = parser.parse_args()
    target = pure_parts(np.random.default_rng(0))
    with tempfile.TemporaryDirectory() as tmp:
        url = args.database_url or f"sqlite:///{Path(tmp) / 'bench.sqlite'}"
        asyncio.run(end_to_end(url, target))


if __name__ == "__main__":
    main()
