"""What many tests build or wait for, in one place: an engine's `Telemetry`, and `eventually` (poll until a
condition holds; the bound only stops a broken test from hanging, it is not a timed assertion)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from switchyard.shared.schemas import Telemetry

__all__ = ["eventually", "telemetry"]

T = TypeVar("T")


def telemetry(
    engine_id: str = "e0",
    seq: int = 1,
    *,
    ts: float = 0.0,
    kv_usage: float = 0.1,
    num_running: int = 0,
    num_waiting: int = 0,
    waiting_prefill_tokens: int = 0,
    remaining_prefill_tokens: int = 0,
    step_time_ema: float = 0.01,
    **fields: Any,
) -> Telemetry:
    """An idle engine's telemetry unless told otherwise (`ts=time.time()` where a reader checks freshness)."""
    return Telemetry(
        engine_id=engine_id,
        seq=seq,
        ts=ts,
        kv_usage=kv_usage,
        num_running=num_running,
        num_waiting=num_waiting,
        waiting_prefill_tokens=waiting_prefill_tokens,
        remaining_prefill_tokens=remaining_prefill_tokens,
        step_time_ema=step_time_ema,
        **fields,
    )


async def eventually(
    probe: Callable[[], T | Awaitable[T]],
    timeout: float = 20.0,  # noqa: ASYNC109 - the bound of a poll, not of one call
    every: float = 0.05,
) -> T:
    """Poll `probe` (a plain or an async callable) until it returns something truthy, and return that; fail with
    its last value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s (last value {value!r})")
        await asyncio.sleep(every)


@contextlib.asynccontextmanager
async def repeating(step: Callable[[], Awaitable[None]], every: float) -> AsyncIterator[None]:
    """Await `step()` every `every` seconds while the block runs.

    Stopped by a flag as well as by cancellation: nats-py's `publish` swallows a `CancelledError` that lands while
    it queues a flush (`Client._flush_pending`), so a publishing loop stopped by `cancel()` alone can run on
    forever and hang whoever awaits it."""
    stop = asyncio.Event()

    async def loop() -> None:
        while not stop.is_set():
            await step()
            await asyncio.sleep(every)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        stop.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
