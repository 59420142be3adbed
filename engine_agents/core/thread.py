"""The bus on a daemon thread with its own event loop, so an engine's own loop never waits on NATS.

Engines such as vLLM (and SGLang) are not asyncio services of ours: their engine core runs a busy loop,
their workers run the model. Each process that has something to publish starts one `AgentThread`; the
engine side hands it work with plain method calls (`submit`), which are thread-safe and never block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings

__all__ = ["AgentThread"]

log = logging.getLogger(__name__)


class AgentThread:
    """Connects to NATS on its own thread; `submit` schedules a coroutine there from any thread.

    `role` is the NATS user of this engine when per-role credentials are set (`engine-<id>`); `kind` names
    the engine kind in the connection name (`switchyard-<kind>-<name>`, as NATS monitoring shows it).
    """

    def __init__(
        self, name: str, settings: SwitchyardSettings | None = None, role: str | None = None, kind: str = "agent"
    ) -> None:
        self.name = name
        self.kind = kind
        self.role = role
        self.settings = settings or SwitchyardSettings()
        self.loop = asyncio.new_event_loop()
        self.bus: Bus | None = None
        self._on_connect: Callable[[Bus], Awaitable[object]] | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"switchyard-{name}", daemon=True)

    def start(self, on_connect: Callable[[Bus], Awaitable[object]], timeout_s: float = 10.0) -> bool:
        """Start the thread and run `on_connect(bus)` (a coroutine function) there; False if NATS is unreachable."""
        self._on_connect = on_connect
        self._thread.start()
        return self._ready.wait(timeout_s) and self.bus is not None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._connect())
        except Exception:
            log.exception("switchyard agent %s: cannot reach NATS at %s", self.name, self.settings.nats_servers)
            self.bus = None
            self._ready.set()
            self.loop.close()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Cancel what runs on the thread, close the connection (flushing it), and end the thread."""
        if not self._thread.is_alive() or self.loop.is_closed():
            return

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.bus is not None:
                await self.bus.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)

    async def _connect(self) -> None:
        self.bus = await Bus.connect(self.settings, name=f"switchyard-{self.kind}-{self.name}", role=self.role)
        assert self._on_connect is not None
        await self._on_connect(self.bus)

    def submit(self, coroutine: Coroutine[Any, Any, object]) -> None:
        """Run `coroutine` on the agent's loop (dropped, and closed, when the bus never connected)."""
        if self.bus is not None:
            asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        else:
            coroutine.close()
