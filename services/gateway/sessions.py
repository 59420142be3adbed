"""Session affinity, "sticky until saturated": a request naming a session (`admission.SESSION_HEADERS`) goes to the
engine that served the session's last request while that engine is live, serves the model and has room below its
saturation limit (`flow.Pressure.room`); otherwise the router's core chooses as for any request, and the session moves
to the engine it chose.

Why: an agent's or a chat's turns share their whole history, which sits in one engine's prefix cache; prefix
routing finds it only for text it has keys for, and only while that engine is not the most loaded. Holding the
session there is worth a little imbalance, never a queue: past saturation the session moves.

Shared across gateway replicas through the decisions they already publish (`sy.route.decided.*`): each decision of
a request naming a session carries the session's key (`session_key`: 16 hex digits of a hash, never the id), and
every other replica learns the binding (`learn`), so a session whose turns reach several replicas stays on one
engine. What a peer says is believed within bounds: bindings only to engines this replica knows, at most
`learn_per_s` per sender (a token bucket, `MAX_SENDERS` senders), held in a table of their own (`learned`) so a
flood cannot push out this replica's own bindings; and a learned binding is used only as an own one is, while its
engine has room below saturation, so a forged binding can never pin sessions on a saturated engine.

Bounded: `max_sessions` entries per table, least recently used out first, each forgotten after `ttl_s` without a
request.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from prometheus_client import Counter

from switchyard.services.gateway import metrics
from switchyard.services.gateway.registry import HttpEngine
from switchyard.services.router.decision_bounds import Bucket
from switchyard.shared.schemas import RouteDecisions

__all__ = ["MAX_SENDERS", "Sessions", "session_key"]

REFUSED = Counter(
    "switchyard_gateway_session_bindings_refused_total",
    "Session bindings other replicas' decisions named that this gateway did not learn, by reason: unknown_engine "
    "(an engine it does not know), rate (past the sender's learning rate).",
    ["reason"],
)
#: Peers whose learning rate is tracked at once; past it the table is cleared (each peer starts a fresh bucket).
MAX_SENDERS = 1024


def session_key(session: str) -> str:
    """The session's key in the tables and on the bus: 16 hex digits of its BLAKE2b hash (bounded, and the client's
    id itself stays in this process)."""
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def _put(table: OrderedDict[str, tuple[str, float]], key: str, engine_id: str, now: float, limit: int) -> None:
    table[key] = (engine_id, now)
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


class Sessions:
    def __init__(
        self,
        room: Callable[[HttpEngine], int],
        max_sessions: int,
        ttl_s: float,
        engines: Mapping[str, HttpEngine] | None = None,
        learn_per_s: float = 1000.0,
    ) -> None:
        """`room(engine)`: requests it can take before saturation (`flow.Pressure.room`); `engines`: the engines
        this replica knows (a peer's binding to another is not learned); `learn_per_s`: bindings a peer may teach."""
        self.room, self.max_sessions, self.ttl_s = room, max_sessions, ttl_s
        self.known: Mapping[str, HttpEngine] = engines if engines is not None else {}
        self.learn_per_s = learn_per_s
        #: session key -> (engine id, when last used), least recently used first: this replica's own choices ...
        self.engines: OrderedDict[str, tuple[str, float]] = OrderedDict()
        #: ... and what other replicas' decisions said (the newer of the two entries wins).
        self.learned: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._senders: dict[str, Bucket] = {}
        self.refused: dict[str, int] = {}  # reason -> peer bindings not learned

    def _held(self, key: str, now: float) -> str | None:
        """The engine of the session's newest binding, own or learned, within `ttl_s` (expired ones go)."""
        best: tuple[str, float] | None = None
        for table in (self.engines, self.learned):
            held = table.get(key)
            if held is None:
                continue
            if now - held[1] > self.ttl_s:
                del table[key]
            elif best is None or held[1] > best[1]:
                best = held
        return best[0] if best is not None else None

    def sticky(self, session: str, candidates: list[HttpEngine], now: float | None = None) -> HttpEngine | None:
        """The session's engine if it is among `candidates` (live, serving the model) and below saturation.
        `session`: its key (`session_key`)."""
        now = time.monotonic() if now is None else now
        engine_id = self._held(session, now)
        if engine_id is None:
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
        _put(self.engines, session, engine.engine_id, now, self.max_sessions)

    def learn(self, sender: str, decisions: RouteDecisions, now: float | None = None) -> int:
        """Another replica's decisions naming sessions: remember where those sessions went, within the bounds of
        the module docstring. Returns how many bindings were learned."""
        now = time.monotonic() if now is None else now
        bucket = self._senders.get(sender)
        if bucket is None:
            if len(self._senders) >= MAX_SENDERS:
                self._senders.clear()
            bucket = self._senders[sender] = Bucket(self.learn_per_s, self.learn_per_s)
        learned = 0
        for key, engine_id in zip(decisions.sessions, decisions.engine_ids, strict=True):
            if not key:
                continue
            if engine_id not in self.known:
                self._refuse("unknown_engine")
            elif not bucket.take(1.0, now):
                self._refuse("rate")
            else:
                _put(self.learned, key, engine_id, now, self.max_sessions)
                learned += 1
        return learned

    def _refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        REFUSED.labels(reason).inc()
