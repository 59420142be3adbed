"""The control-plane duties of one engine, as every Switchyard engine agent performs them.

An agent says hello on start, every `hello_interval_s`, and whenever a service asks on `sy.engine.announce`
(a restarted router then knows the fleet within one telemetry interval), at most once per
`announce_min_interval_s` of its bus's settings however many ask (`core.announce`); it publishes telemetry every
`telemetry_interval_s` with a per-engine sequence number that starts at 0 on every start, so consumers can
tell lost messages from a restart. Given the engine's expert slots (`core.layout.ExpertSlots`) it also
answers `sy.engine.<id>.layout` and `.migrate`, before its first hello, so a control plane that hears the
hello can ask at once. The simulated engines, the vLLM agent and any new engine kind use this class.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.aio.subscription import Subscription

from switchyard.engine_agents.core.announce import AnnounceAnswerer, listen, stop_listening
from switchyard.engine_agents.core.layout import ExpertSlots, serve_expert_slots
from switchyard.shared.bus import Bus
from switchyard.shared.schemas import Hello, Telemetry

log = logging.getLogger(__name__)

#: What an engine reports each interval: the Telemetry fields other than engine_id, seq and ts.
TelemetrySource = Callable[[], dict[str, float | int | bool]]


class EngineAgent:
    """One engine's hello, telemetry and (optionally) expert-slot subjects on `bus`; `start` / `stop` on its loop."""

    def __init__(self, bus: Bus, hello: Hello, telemetry: TelemetrySource, slots: ExpertSlots | None = None) -> None:
        self.bus = bus
        self.hello = hello
        self.telemetry = telemetry
        self.slots = slots
        self.seq = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._subscriptions: list[Subscription] = []
        self.announces = AnnounceAnswerer(self._answer_announce, bus.settings.announce_min_interval_s)

    @property
    def engine_id(self) -> str:
        return self.hello.engine_id

    async def say_hello(self) -> None:
        await self.bus.publish(
            self.bus.subjects.hello(self.engine_id), self.hello.model_copy(update={"ts": time.time()})
        )

    async def _answer_announce(self) -> None:
        await self.say_hello()  # looked up at each call: a test harness may replace `say_hello` (bench/chaos.py)

    async def _hello_loop(self) -> None:
        while True:
            await asyncio.sleep(self.hello.hello_interval_s)
            try:
                await self.say_hello()
            except Exception:  # e.g. the outbound buffer is full during a NATS outage: try again next time
                log.warning("%s: hello failed", self.engine_id, exc_info=True)

    async def _telemetry_loop(self) -> None:
        subject = self.bus.subjects.telemetry(self.engine_id)
        while True:
            try:
                message = Telemetry(engine_id=self.engine_id, seq=self.seq, ts=time.time(), **self.telemetry())
                await self.bus.publish(subject, message)
                self.seq += 1
            except Exception:  # a bad reading must not silence the engine
                log.exception("%s: telemetry failed", self.engine_id)
            await asyncio.sleep(self.hello.telemetry_interval_s)

    async def start(self) -> None:
        if self.slots is not None:
            self._subscriptions += await serve_expert_slots(self.bus, self.engine_id, self.slots)
        self.announces = AnnounceAnswerer(self._answer_announce, self.bus.settings.announce_min_interval_s)
        await listen(self.bus, self.engine_id, self.announces.on_announce)  # one subscription per connection
        await self.say_hello()
        self._tasks = [asyncio.create_task(self._hello_loop()), asyncio.create_task(self._telemetry_loop())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        self._subscriptions = []
        await stop_listening(self.bus, self.engine_id)
        await self.announces.close()  # after that: no announce can schedule another
