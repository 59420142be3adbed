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
from switchyard.services.gateway.registry import Engine
from switchyard.services.gateway.routing import Chooser
from switchyard.services.router.ask import LocalDpAsk
from switchyard.services.router.core import Decided
from switchyard.services.router.feed import CoreFeed, DecisionSharer
from switchyard.shared.errors import WireError
from switchyard.shared.schemas import RouteDecodeRequest

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
    def __init__(self, feed: CoreFeed, sharer: DecisionSharer | None) -> None:
        super().__init__()
        self.core, self.sharer = feed.core, sharer
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

    async def route_dp(
        self,
        request_id: str,
        prompt_tokens: int,
        candidates: list[Engine],
        model: str | None = None,
        keys: PromptKeys | None = None,
    ) -> Engine | None:
        """The core's choice among `candidates` (the live DP engines serving `model`)."""
        if not candidates:
            return None
        keyed = keys is not None and len(keys.keys) > 0
        # Unvalidated: every field is this gateway's own (the id, a positive count, uint64 keys it computed).
        request = LocalDpAsk(
            request_id,
            prompt_tokens,
            model,
            keys.keys if keyed else None,  # type: ignore[union-attr]
            keys.kind if keyed else "tokens",  # type: ignore[union-attr]
            True,
        )
        reply, decided = self.core.route_dp(request, time.monotonic())
        if decided is None:
            return self.local(candidates, "dp", f"error_{reply.error.code}")  # type: ignore[union-attr]
        self._share(decided)
        return self._follow(decided.engine_id, candidates, "dp")

    async def route_decode(
        self,
        request_id: str,
        prompt_tokens: int,
        signature: np.ndarray | None,
        prefill_engine_id: str | None,
        candidates: list[Engine],
        model: str | None = None,
    ) -> Engine | None:
        """The core's (ELDR's) choice among the live decoders `candidates` for this prefill signature."""
        if not candidates:
            return None
        try:
            request = RouteDecodeRequest(
                request_id=request_id,
                prompt_tokens=prompt_tokens,
                signature=signature,
                prefill_engine_id=prefill_engine_id,
                model=model,
            )
            reply, decided = self.core.route_decode(request, time.monotonic())
        except WireError as exc:  # a signature of the wrong shape for the artifact
            return self.local(candidates, "decode", f"error_{exc.code}")
        except ValueError:  # ... refused by the request's own validation
            return self.local(candidates, "decode", "error_schema")
        if decided is None:
            return self.local(candidates, "decode", f"error_{reply.error.code}")  # type: ignore[union-attr]
        self._share(decided)
        return self._follow(decided.engine_id, candidates, "decode")
