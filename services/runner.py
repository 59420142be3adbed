"""Run one long-lived service in the foreground until Ctrl-C or SIGTERM, then stop it cleanly."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable


async def until_signal(service: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `service(stop)`; SIGINT/SIGTERM set `stop`, and the service is expected to return soon after."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service(stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run_service(service: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    asyncio.run(until_signal(service))
