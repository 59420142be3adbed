"""The in-process shape (the default): the gateway decides with the router's own core, no bus round trip.

`InProcessRouter` has the remote `Router`'s interface (`route_dp`, `route_decode`, `progress`, the local
fallback), but asks a `RouterCore` built from the same `RouterSettings` (`SWITCHYARD_ROUTER_*`: profiles,
weights, prefix index) as `switchyard router`, fed by a `CoreFeed` (`services.router.feed`). It publishes only
its own decisions, on `sy.route.decided.gateway.<gateway id>`, so other gateways and routers count them in
flight and it counts theirs. Every request it routes reports its first token and end straight to the core
(`CoreProgress`): its exact ledger needs no bus message.
"""

from __future__ import annotations

import time

import numpy as np

from switchyard.services.gateway.prompt_keys import PromptKeys
from switchyard.services.gateway.registry import GatewayRegistry, HttpEngine
from switchyard.services.gateway.routing import Chooser, dp_ask
from switchyard.services.router.ask import LOCAL_REPORTER, LocalDecodeAsk
from switchyard.services.router.core import Decided
from switchyard.services.router.feed import CoreFeed, DecisionSharer
from switchyard.shared.errors import WireError

__all__ = ["CoreProgress", "InProcessRouter"]


class CoreProgress:
    """First tokens and ends of the requests this gateway routed, settled in its core at once (`CoreFeed.settle`:
    the views are re-read on a later turn of the loop, not by the next request)."""

    def __init__(self, feed: CoreFeed) -> None:
        self.feed = feed

    def first(self, request_id: str) -> None:
        self.feed.settle((request_id,), ())

    def done(self, request_id: str) -> None:
        self.feed.settle((), (request_id,))

    async def close(self) -> None:
        """Nothing to publish (the remote shape's reporter flushes here)."""


class InProcessRouter(Chooser):
    """The core's choice, taken as it is: the core and `registry` project one engine book, and the registry holds
    every engine it would not send to (ejected, on trial and busy, serving no HTTP) in that book, so the core
    chooses only among the live candidates the registry offers. Candidates are read only to choose locally when
    the core has no answer."""

    def __init__(self, feed: CoreFeed, sharer: DecisionSharer | None, registry: GatewayRegistry) -> None:
        super().__init__()
        if feed.core.book is not registry.book:
            raise ValueError("the in-process router and the registry must project one engine book")
        self.core, self.sharer, self.engines = feed.core, sharer, registry.engines
        self.progress = CoreProgress(feed)

    def trace_attributes(self, kind: str) -> dict[str, str]:
        settings = self.core.settings
        return {
            "switchyard.route.shape": "inprocess",
            "switchyard.route.profile": settings.dp_rule if kind == "dp" else settings.policy,
        }

    def _share(self, decided: Decided | None) -> None:
        if decided is not None and self.sharer is not None:
            self.sharer.add(decided)
            self.sharer.idle()  # published on the loop's next turn at the earliest, batched with its neighbours

    def _take(self, decided: Decided, session: str = "") -> HttpEngine:
        """The core's engine (a registry engine by construction: see the class docstring), its decision shared
        (naming the request's `session` key, if any: the other replicas learn where the session went)."""
        self._share(decided._replace(session=session) if session else decided)
        self._recovered()
        self.fallback = ""
        return self.engines[decided.engine_id]

    async def route_dp(
        self,
        request_id: str,
        prompt_tokens: int,
        candidates: list[HttpEngine],
        model: str | None = None,
        keys: PromptKeys | None = None,
        session: str = "",
    ) -> HttpEngine | None:
        """The core's choice among `candidates` (the live DP engines serving `model`); `session`: the request's
        session key (`sessions.session_key`), shared with the decision."""
        if not candidates:
            return None
        ask = dp_ask(request_id, prompt_tokens, model, keys, True)
        reply, decided = self.core.route_dp(ask, time.monotonic())
        if decided is None:
            return self.local(candidates, "dp", f"error_{reply.error.code}")  # type: ignore[union-attr]
        return self._take(decided, session)

    def route_to(self, request_id: str, prompt_tokens: int, engine: HttpEngine, session: str = "") -> HttpEngine:
        """A choice made outside the core (a session's sticky engine), counted in the core as its own decisions
        are (exact ledger, role views) and shared with the other replicas, so their load counts include it."""
        core = self.core
        row = core.fleet.index.get(engine.engine_id)
        if row is not None:
            core.fleet.on_decision_row(row, prompt_tokens, time.monotonic(), request_id, LOCAL_REPORTER)
            core.dp.record_decision(row, prompt_tokens)
            core.decode.record_decision(row, prompt_tokens)
            self._share(Decided("dp", request_id, engine.engine_id, prompt_tokens, session))
        return engine

    async def route_decode(
        self,
        request_id: str,
        prompt_tokens: int,
        signature: np.ndarray | None,
        prefill_engine_id: str | None,
        candidates: list[HttpEngine],
        model: str | None = None,
    ) -> HttpEngine | None:
        """The core's (ELDR's) choice among the live decoders `candidates` for this prefill signature."""
        if not candidates:
            return None
        ask = LocalDecodeAsk(request_id, prompt_tokens, signature, prefill_engine_id, model)
        try:
            reply, decided = self.core.route_decode(ask, time.monotonic())
        except WireError as exc:  # a signature of the wrong shape for the artifact
            return self.local(candidates, "decode", f"error_{exc.code}")
        if decided is None:
            return self.local(candidates, "decode", f"error_{reply.error.code}")  # type: ignore[union-attr]
        return self._take(decided)
