"""How an engine answers `sy.engine.announce`: at a bounded rate, whoever asks and however often.

Any credential that may publish an announce (the read-only one included) can ask every engine for a hello.
Answered one for one, 100,000 announces made an 8-engine fleet publish 800,000 hellos
(`bench/announce_flood.py`), each carried to every service's engine ingest, and the server cut placement's
off as a slow consumer. An engine therefore answers the first announce at once, then at most one hello per
`min_interval_s`; announces that arrive during that hold-off are answered together by one trailing hello at its
end, so a service that starts during a flood still hears every engine within `min_interval_s`. The rule is
`AnnounceGate` (pure, clock passed in); every engine kind answers through `AnnounceAnswerer` (the agent core,
hence the simulated engines and the vLLM agent, the gateway's stub engine, the router bench's engines).

Engine agents that share a connection (the simulated fleet runs all its engines on one) share one announce
subscription (`listen`): the server then sends the process each announce once, not once per engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections.abc import Awaitable, Callable

from nats.aio.subscription import Subscription

from switchyard.shared.bus import Bus
from switchyard.shared.schemas import Announce

log = logging.getLogger(__name__)


class AnnounceGate:
    """When to answer announces: at once, then at most once per `min_interval_s`, with one trailing answer."""

    def __init__(self, min_interval_s: float) -> None:
        if not min_interval_s > 0:
            raise ValueError(f"min_interval_s must be positive, not {min_interval_s}")
        self.min_interval_s = min_interval_s
        self._last = -math.inf  # when the last answer went out
        self._trailing = False  # an answer is already scheduled for the end of the hold-off

    def offer(self, now: float) -> float | None:
        """An announce arrived at `now`: the delay after which to answer it (0: at once), or None when the
        answer already scheduled covers it. A delayed answer must be reported with `answered` when it goes out."""
        if self._trailing:
            return None
        wait = self._last + self.min_interval_s - now
        if wait <= 0:
            self._last = now
            return 0.0
        self._trailing = True
        return wait

    def answered(self, now: float) -> None:
        """The trailing answer went out at `now`: the next hold-off starts here."""
        self._trailing = False
        self._last = now


class AnnounceAnswerer:
    """Calls `say_hello` for announces as `AnnounceGate` allows; the trailing hello is a task of its own."""

    def __init__(
        self,
        say_hello: Callable[[], Awaitable[None]],
        min_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.say_hello = say_hello
        self.gate = AnnounceGate(min_interval_s)
        self.clock = clock
        self._trailing: asyncio.Task[None] | None = None
        self._closed = False

    async def on_announce(self) -> None:
        """One announce (already found to concern this engine) arrived."""
        if self._closed:  # one still being fanned out as the engine stopped
            return
        delay = self.gate.offer(self.clock())
        if delay is None:
            return
        if delay == 0:
            await self.say_hello()
        else:
            self._trailing = asyncio.create_task(self._answer_later(delay))

    async def _answer_later(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self.gate.answered(self.clock())
        try:
            await self.say_hello()
        except Exception:  # e.g. the outbound buffer is full during a NATS outage: the periodic hello follows
            log.warning("trailing hello failed", exc_info=True)

    async def close(self) -> None:
        """Cancel a trailing hello not yet sent and answer no more announces (the engine is stopping)."""
        self._closed = True
        if self._trailing is not None:
            self._trailing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._trailing
            self._trailing = None


class _Listeners:
    """The engines on one connection that answer announces, behind one subscription."""

    def __init__(self) -> None:
        self.by_engine: dict[str, Callable[[], Awaitable[None]]] = {}
        self.subscription: Subscription | None = None
        self.lock = asyncio.Lock()

    async def on_announce(self, request: Announce, _msg: object) -> None:
        if request.engine_id is None:
            answers = list(self.by_engine.items())
        else:
            answer = self.by_engine.get(request.engine_id)
            answers = [] if answer is None else [(request.engine_id, answer)]
        for engine_id, answer in answers:
            try:
                await answer()
            except Exception:  # one engine's failed hello (e.g. a full outbound buffer) must not silence the others
                log.warning("%s: hello for an announce failed", engine_id, exc_info=True)


_LISTENERS: weakref.WeakKeyDictionary[Bus, _Listeners] = weakref.WeakKeyDictionary()


async def listen(bus: Bus, engine_id: str, answer: Callable[[], Awaitable[None]]) -> None:
    """Call `answer` for each announce on `bus` that concerns `engine_id` (all, or those naming it)."""
    listeners = _LISTENERS.setdefault(bus, _Listeners())
    async with listeners.lock:
        listeners.by_engine[engine_id] = answer
        if listeners.subscription is None:
            listeners.subscription = await bus.subscribe(bus.subjects.announce, Announce, listeners.on_announce)


async def stop_listening(bus: Bus, engine_id: str) -> None:
    """`engine_id` no longer answers announces on `bus`; the subscription goes with the last engine."""
    listeners = _LISTENERS.get(bus)
    if listeners is None:
        return
    async with listeners.lock:
        listeners.by_engine.pop(engine_id, None)
        if not listeners.by_engine and listeners.subscription is not None:
            subscription, listeners.subscription = listeners.subscription, None
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
