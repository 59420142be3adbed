"""The gateway's KV events: on a NATS connection of their own, rate-bounded per engine before decoding.

Why a connection of its own (issue 37, item 3): hellos and telemetry keep engines live. On one connection with
a KV flood, nats-server cut the whole connection off as a slow consumer, engines went stale and honest requests
got 503. Here a flood can cut off only this connection: prefix routing degrades, liveness does not.

Why before decoding: decoding and applying 8,192 keys costs milliseconds of the event loop. Each message is
charged to its subject's engine (NATS permissions bind the subject to the engine's credential) at
1 + its bytes / 8 keys (a key is 8 bytes on the wire) against a token bucket (`KvRate`); a message past it is
dropped undecoded, counted (`switchyard_gateway_kv_events_total{outcome="rate"}`), and the engine's blocks are
cleared in both indexes (the index may be stale without it). A message admitted is applied, then the handler
yields to the loop once, so a run of large messages cannot hold it.
"""

from __future__ import annotations

import asyncio
import time

from nats.aio.msg import Msg

from switchyard.services.gateway import metrics
from switchyard.services.gateway.prefix import PrefillPrefix
from switchyard.services.router.feed import CoreFeed
from switchyard.services.router.kv_trust import KvRate
from switchyard.shared.bus import Bus
from switchyard.shared.schemas import MAX_KV_EVENT_KEYS, KvEvents
from switchyard.shared.settings import SwitchyardSettings

__all__ = ["KvIngest"]

#: A message with more keys than this yields the loop after it is applied.
YIELD_AFTER_KEYS = 1024


class KvIngest:
    """Feeds the prefill index (`prefix`, None: not read) and the in-process core (`feed`, None: not read)."""

    def __init__(self, prefix: PrefillPrefix | None, feed: CoreFeed | None, rate: KvRate) -> None:
        self.prefix, self.feed, self.rate = prefix, feed, rate
        self.bus: Bus | None = None
        self._dropped = metrics.KV_EVENTS.labels("rate")

    async def start(self, settings: SwitchyardSettings, name: str, servers: list[str] | None, role: str) -> None:
        self.bus = bus = await Bus.connect(settings, name=name, servers=servers, role=role)
        await bus.subscribe(bus.subjects.all_kv_events, KvEvents, self.on_kv, admit=self.admit)
        await bus.nc.flush()

    async def close(self) -> None:
        if self.bus is not None:
            await self.bus.close()

    def admit(self, msg: Msg) -> bool:
        """Whether the subject's engine has the rate for this message (cost from its size, before decoding)."""
        assert self.bus is not None
        engine_id = self.bus.subjects.engine_of(msg.subject)
        if engine_id is None:
            return True  # not an engine's KV subject: decoding rejects and counts it
        cost = 1 + min(len(msg.data) // 8, MAX_KV_EVENT_KEYS)
        if self.rate.admit(engine_id, cost, time.monotonic()):
            return True
        self._dropped.inc()
        self.dropped(engine_id)
        return False

    def dropped(self, engine_id: str) -> None:
        """A message of the engine's was dropped: its blocks may be stale in both indexes."""
        if self.prefix is not None:
            self.prefix.dropped(engine_id)
        if self.feed is not None:
            self.feed.core.prefix.dropped(engine_id)

    async def on_kv(self, events: KvEvents, _msg: object = None) -> None:
        if self.prefix is not None:
            self.prefix.on_kv(events)
        if self.feed is not None:
            self.feed.on_kv(events)
        if sum(len(op.keys) for op in events.ops) > YIELD_AFTER_KEYS:
            await asyncio.sleep(0)  # hellos, telemetry and requests run between large messages
