"""Session affinity, "sticky until saturated": a request naming a session (`admission.SESSION_HEADERS`) goes to the
engine that served the session's last request while that engine is live, serves the model and has room below its
saturation limit (`flow.Pressure.room`); otherwise the router's core chooses as for any request, and the session moves
to the engine it chose.

Why: an agent's or a chat's turns share their whole history, which sits in one engine's prefix cache; prefix
routing finds it only for text it has keys for, and only while that engine is not the most loaded. Holding the
session there is worth a little imbalance, never a queue: past saturation the session moves.

Per gateway replica: the decisions replicas share (`sy.route.decided.*`) name requests and engines, not sessions,
so a session whose requests reach several replicas is held by each separately (a load balancer hashing the
session header keeps it on one). Bounded: `max_sessions` entries, least recently used out first, each forgotten
after `ttl_s` without a request.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from switchyard.services.gateway import metrics
from switchyard.services.gateway.registry import HttpEngine

__all__ = ["Sessions"]


class Sessions:
    def __init__(self, room: Callable[[HttpEngine], int], max_sessions: int, ttl_s: float) -> None:
        """`room(engine)`: requests it can take before saturation (`flow.Pressure.room`)."""
        self.room, self.max_sessions, self.ttl_s = room, max_sessions, ttl_s
        #: session id -> (engine id, when last used), least recently used first.
        self.engines: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def sticky(self, session: str, candidates: list[HttpEngine], now: float | None = None) -> HttpEngine | None:
        """The session's engine if it is among `candidates` (live, serving the model) and below saturation."""
        held = self.engines.get(session)
        if held is None:
            return None
        engine_id, used = held
        now = time.monotonic() if now is None else now
        if now - used > self.ttl_s:
            del self.engines[session]
            return None
        for engine in candidates:
            if engine.engine_id == engine_id:
                if self.room(engine) > 0:
                    metrics.SESSIONS.labels("sticky").inc()
                    return engine
                metrics.SESSIONS.labels("saturated").inc()
                return None
        metrics.SESSIONS.labels("gone").inc()
        return None

    def served(self, session: str, engine: HttpEngine, now: float | None = None) -> None:
        """The session's request went to `engine`: its next one goes there too, while it can take it."""
        now = time.monotonic() if now is None else now
        self.engines[session] = (engine.engine_id, now)
        self.engines.move_to_end(session)
        while len(self.engines) > self.max_sessions:
            self.engines.popitem(last=False)
