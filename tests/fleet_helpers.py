"""Helpers for service tests: engine hellos, placement plans, and waiting on the database."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import numpy as np

from switchyard.engine_agents.sim.live.migration import ExpertLoadWindow
from switchyard.shared.bus import Bus
from switchyard.shared.schemas import Capacity, Hello, ModelShape, ObjectiveTerms, PlacementParams, PlacementPlan
from tests.helpers import repeating

T = TypeVar("T")


def hello(
    engine_id: str, group: str, gpus: list[str], dp_rank: int = 0, layers: int = 4, experts: int = 8, role: str = "dp"
) -> Hello:
    return Hello(
        engine_id=engine_id,
        role=role,  # type: ignore[arg-type]
        model=ModelShape(name="tiny-moe", num_layers=layers, num_experts=experts, top_k=2),
        ep_group=group,
        dp_rank=dp_rank,
        gpus=gpus,
        capacity=Capacity(max_running=64, kv_blocks=1024, block_size=16),
        ts=time.time(),
        agent="sim",
        hello_interval_s=0.2,
        telemetry_interval_s=0.1,
    )


@contextlib.asynccontextmanager
async def announcing(bus: Bus, *hellos: Hello, every: float = 0.1) -> AsyncIterator[None]:
    """Publish the engines' hellos every `every` seconds while the block runs (as live engines do)."""

    async def say_hello() -> None:
        for message in hellos:
            await bus.publish(bus.subjects.hello(message.engine_id), message)

    async with repeating(say_hello, every):
        yield


def plan(
    group: str, version: int, layout: np.ndarray, plan_id: str | None = None, source: str = "greedy"
) -> PlacementPlan:
    return PlacementPlan(
        plan_id=plan_id or f"{group}-v{version}",
        version=version,
        engine_group=group,
        created_at=time.time(),
        source=source,  # type: ignore[arg-type]
        gpus=[f"{group}-gpu{g}" for g in range(layout.shape[1])],
        placement=layout.astype(np.int32),
        moves=np.zeros((0, 6), np.int32),
        objective=ObjectiveTerms(load=1.0, comm=2.0, mig=0.5, total=3.5),
        params=PlacementParams(alpha=1.0, beta=0.0025, gamma=1.0),
        predicted_gain=1.0,
    )


def shuffled(layout: np.ndarray, seed: int) -> np.ndarray:
    """The same experts in a random arrangement per layer."""
    rng = np.random.default_rng(seed)
    out = layout.copy()
    for layer in range(out.shape[0]):
        out[layer] = rng.permutation(out[layer].reshape(-1)).reshape(out.shape[1:])
    return out


async def publish_load(
    bus: Bus,
    engine_id: str,
    group: str,
    dp_rank: int,
    hot: range,
    windows: int = 1,
    layers: int = 4,
    experts: int = 8,
    clock_offset_s: float = 0.0,
) -> None:
    """Windows in which this engine's tokens (source `dp_rank`) all pick experts from `hot`; `clock_offset_s`
    skews the engine's clock."""
    clock = iter(time.time() + clock_offset_s + 0.01 * i for i in range(2 * windows + 2))
    window = ExpertLoadWindow(engine_id, group, layers, experts, num_sources=2, clock=lambda: next(clock))
    rng = np.random.default_rng(dp_rank)
    for _ in range(windows):
        selections = rng.choice(np.array(hot), size=(200, layers, 2))
        window.add(selections, np.full(200, dp_rank))
        message = window.flush()
        await bus.js_publish(bus.subjects.expert_load(engine_id), message, msg_id=f"{engine_id}-{message.seq}")


@contextlib.asynccontextmanager
async def running(service: Callable[[asyncio.Event], Awaitable[None]]) -> AsyncIterator[None]:
    """Run `service(stop)` as a task while the block runs; then set `stop` and wait for it to finish."""
    stop = asyncio.Event()
    task = asyncio.create_task(service(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
