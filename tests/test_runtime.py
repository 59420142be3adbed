"""Service runtime helpers."""

from __future__ import annotations

import asyncio

import pytest

from switchyard.services.runtime import supervised


async def test_a_failing_background_loop_is_restarted_until_it_ends() -> None:
    runs: list[int] = []

    async def flaky() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RuntimeError("transient")

    await asyncio.wait_for(supervised("flaky", flaky, max_backoff_s=0.01), timeout=10)
    assert runs == [0, 1, 2]


async def test_cancelling_a_supervised_loop_stops_it() -> None:
    async def forever() -> None:
        await asyncio.sleep(3600)

    task = asyncio.create_task(supervised("forever", forever))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
