"""The gateway's calls to the router (`sy.route.dp`, `sy.route.decode`), with the local fallback.

This is the remote shape (`--router remote`); the in-process one (`services.gateway.local_route`) runs the
router's core here and shares the fallback (`Chooser`). The router decides; the gateway only follows. When the
router cannot be reached (no responder, timeout, an error reply, or a choice the gateway cannot send to) the
gateway picks the least-loaded live engine by its own in-flight counts, counts it in
`switchyard_gateway_routing_fallbacks_total` and logs once per incident (the first fallback after a success), so
an outage is one line, not one per request.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from nats.errors import Error as NatsError

from switchyard.services.gateway import metrics
from switchyard.services.gateway.choice import least_loaded
from switchyard.services.gateway.progress import ProgressReporter
from switchyard.services.gateway.prompt_keys import PromptKeys
from switchyard.services.gateway.registry import HttpEngine
from switchyard.services.router.ask import LOCAL_REPORTER, LocalDecodeAsk, LocalDpAsk
from switchyard.shared.bus import Bus
from switchyard.shared.codec import WireModel, encode_unchecked, reply_fields
from switchyard.shared.errors import RemoteError, WireError
from switchyard.shared.schemas import RouteDecodeReply, RouteDecodeRequest, RouteDpReply, RouteDpRequest

if TYPE_CHECKING:
    from switchyard.shared.tracing import Tracing

log = logging.getLogger(__name__)


class Progress(Protocol):
    """Where the DP path notes each routed request's first token and end (`ProgressReporter`, `CoreProgress`)."""

    def first(self, request_id: str) -> None: ...
    def done(self, request_id: str) -> None: ...
    async def close(self) -> None: ...


class Routes(Protocol):
    """What the request paths ask: either shape (`Router`, `local_route.InProcessRouter`)."""

    progress: Progress | None
    #: Why the last choice was local ("" when the router's was followed): read right after the call returns.
    fallback: str

    def trace_attributes(self, kind: str) -> dict[str, str]:
        """What a `route.<kind>` span says of this shape (and, in process, of the profile deciding)."""
        ...

    async def route_dp(
        self,
        request_id: str,
        prompt_tokens: int,
        candidates: list[HttpEngine],
        model: str | None = None,
        keys: PromptKeys | None = None,
    ) -> HttpEngine | None: ...

    async def route_decode(
        self,
        request_id: str,
        prompt_tokens: int,
        signature: np.ndarray | None,
        prefill_engine_id: str | None,
        candidates: list[HttpEngine],
        model: str | None = None,
    ) -> HttpEngine | None: ...


def dp_ask(
    request_id: str,
    prompt_tokens: int,
    model: str | None,
    keys: PromptKeys | None,
    progress: bool,
    reporter: str | None = LOCAL_REPORTER,
) -> LocalDpAsk:
    """The DP ask both shapes make (`services.router.ask`): every field this gateway's own."""
    keyed = keys is not None and len(keys.keys) > 0
    block_keys = keys.keys if keys is not None and keyed else None
    kind = keys.kind if keys is not None and keyed else "tokens"
    return LocalDpAsk(request_id, prompt_tokens, model, block_keys, kind, progress, reporter)


class Chooser:
    """What both shapes share: follow a choice if it is a candidate, else choose locally (counted, logged once
    per incident)."""

    def __init__(self) -> None:
        self.incident = False  # True from the first fallback until the router answers again
        self.fallbacks_in_incident = 0
        self._turn = 0
        self.fallback = ""

    def local(self, candidates: list[HttpEngine], kind: str, reason: str) -> HttpEngine | None:
        """Least-loaded candidate by the gateway's own in-flight counts; counted and logged once per incident."""
        metrics.FALLBACKS.labels(kind, reason).inc()
        self.fallback = reason
        if not self.incident:
            self.incident = True
            log.warning("router unavailable for %s (%s): choosing engines locally (least loaded)", kind, reason)
        self.fallbacks_in_incident += 1
        self._turn += 1
        index = least_loaded([e.inflight for e in candidates], self._turn)
        return candidates[index] if index >= 0 else None

    def _recovered(self) -> None:
        if self.incident:
            log.warning("router answering again after %d local choices", self.fallbacks_in_incident)
            self.incident, self.fallbacks_in_incident = False, 0

    def _follow(self, engine_id: str, candidates: list[HttpEngine], kind: str) -> HttpEngine | None:
        for engine in candidates:
            if engine.engine_id == engine_id:
                self._recovered()
                self.fallback = ""
                return engine
        return self.local(candidates, kind, "unknown_engine")


class Router(Chooser):
    """The remote shape: ask a router replica over the bus (`--router remote`)."""

    def __init__(
        self, bus: Bus | None, timeout_s: float, tracing: Tracing | None = None, reporter: str = "gateway"
    ) -> None:
        super().__init__()
        self.bus, self.timeout_s = bus, timeout_s
        #: Tracing on: each question carries the current span's `traceparent` in its NATS headers.
        self.tracing = tracing
        #: The gateway reports each routed DP request's first token and end (`sy.route.progress`), so it asks
        #: with ``progress``: the router counts the request exactly until those reports. `reporter` (its NATS user)
        #: names the subject it reports on, the only one whose reports settle its requests.
        self.progress = ProgressReporter(bus, reporter) if bus is not None else None

    async def _ask(self, subject: str, payload: bytes, reply: type[WireModel]) -> tuple[str | None, str]:
        """The chosen engine id (checked by the caller against its candidates), or None and the reason."""
        if self.bus is None:
            return None, "no_bus"
        headers = self.tracing.headers() if self.tracing is not None else None
        try:
            answer = await self.bus.nc.request(subject, payload, timeout=self.timeout_s, headers=headers)
            engine_id = reply_fields(answer.data, reply, self.bus.max_payload).get("engine_id")
        except TimeoutError:
            return None, "timeout"
        except RemoteError as exc:
            return None, f"error_{exc.code}"
        except WireError:
            return None, "bad_reply"
        except NatsError as exc:
            return None, "no_responders" if "no responders" in str(exc).lower() else "nats_error"
        if not isinstance(engine_id, str):
            return None, "bad_reply"
        return engine_id, ""

    def trace_attributes(self, kind: str) -> dict[str, str]:
        return {"switchyard.route.shape": "remote"}  # the profile: on the router's own span

    async def route_dp(
        self,
        request_id: str,
        prompt_tokens: int,
        candidates: list[HttpEngine],
        model: str | None = None,
        keys: PromptKeys | None = None,
    ) -> HttpEngine | None:
        """The router's choice among `candidates` (the live DP engines serving `model`, which the router
        filters to as well); `keys`, the prompt's block keys, go with the request for its prefix scorers."""
        if not candidates:
            return None
        subject = self.bus.subjects.route_dp if self.bus is not None else ""
        reporter = self.progress.reporter if self.progress is not None else None
        ask = dp_ask(request_id, prompt_tokens, model, keys, self.progress is not None, reporter)
        engine_id, reason = await self._ask(subject, encode_unchecked(RouteDpRequest, ask.wire()), RouteDpReply)
        if engine_id is None:
            return self.local(candidates, "dp", reason)
        return self._follow(engine_id, candidates, "dp")

    async def route_decode(
        self,
        request_id: str,
        prompt_tokens: int,
        signature: np.ndarray | None,
        prefill_engine_id: str | None,
        candidates: list[HttpEngine],
        model: str | None = None,
    ) -> HttpEngine | None:
        """The router's (ELDR's) choice among the live decoders `candidates` for a request with this prefill
        signature."""
        if not candidates:
            return None
        subject = self.bus.subjects.route_decode if self.bus is not None else ""
        ask = LocalDecodeAsk(request_id, prompt_tokens, signature, prefill_engine_id, model)
        engine_id, reason = await self._ask(subject, encode_unchecked(RouteDecodeRequest, ask.wire()), RouteDecodeReply)
        if engine_id is None:
            return self.local(candidates, "decode", reason)
        return self._follow(engine_id, candidates, "decode")


async def traced_route(
    tracing: Tracing, router: Routes, kind: str, request_id: str, choice: Awaitable[HttpEngine | None]
) -> HttpEngine | None:
    """Await `choice` (the router's `route_dp` / `route_decode` call) inside a `route.<kind>` span: a client span
    in the remote shape (its `traceparent` goes with the question, and the router's server span is its child),
    an internal one in process; it names the engine chosen and, when the choice was local, why."""
    attributes: dict[str, Any] = {"switchyard.request_id": request_id, **router.trace_attributes(kind)}
    span_kind = "client" if attributes["switchyard.route.shape"] == "remote" else "internal"
    with tracing.span(f"route.{kind}", span_kind, attributes) as span:
        engine = await choice
        if engine is not None:
            span.set_attribute("switchyard.engine_id", engine.engine_id)
            if router.fallback:
                span.set_attribute("switchyard.route.fallback", router.fallback)
    return engine
