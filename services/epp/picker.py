"""The picker's decision: one request's body in, an ordered list of endpoints (or a refusal) out.

It is the in-process gateway's decision, with the gateway's own pieces: the body parser and its limits
(`gateway.body.parse`), the engine registry fed by hellos (`gateway.registry`: liveness, the engine manifest,
ejection), prefix keys from the gateway's tokenizer path (`gateway.prompt_keys`), and the router's core with its
feed and decision sharing (`gateway.local_route.InProcessRouter`), so the picker counts every other replica's
requests in flight and they count its own. It serves data-parallel engines (role `dp`); a prefill→decode handoff
needs a proxy that waits for the prefill's answer, which is Switchyard's own gateway (docs/epp.md).

Under saturation the gateway's flow control applies here too (`gateway.flow.Flow`, its settings mirrored in
`EppSettings`): the same headers name a request's priority band and tenant, requests wait in the same queues and
leave in the same order, and what is shed is answered 429 with `Retry-After` as an ImmediateResponse.

What the proxy adds that the gateway decides alone: the subset hint (choose only among the endpoints it names),
fallback endpoints after the choice, and the report of which endpoint served.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from yarl import URL

from switchyard.services.epp import metrics
from switchyard.services.epp.settings import EppSettings
from switchyard.services.gateway import metrics as gateway_metrics
from switchyard.services.gateway.admission import BANDS, BadClass, classify, request_cost
from switchyard.services.gateway.body import BadBody, parse
from switchyard.services.gateway.flow import Flow
from switchyard.services.gateway.local_route import InProcessRouter
from switchyard.services.gateway.prompt_keys import PromptKeyer, PromptKeys
from switchyard.services.gateway.registry import GatewayRegistry, HttpEngine
from switchyard.services.gateway.signatures import new_request_id
from switchyard.services.router.ask import LOCAL_REPORTER
from switchyard.services.router.core import Decided
from switchyard.services.router.feed import CoreFeed, DecisionSharer
from switchyard.services.router.prefix import key_block_size

log = logging.getLogger(__name__)

COMPLETIONS = ("/v1/completions", "/v1/chat/completions")


class Refused(Exception):
    """The picker answers the client itself: `status` with OpenAI's error (`kind`, `param`), counted as `outcome`."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        outcome: str,
        param: str | None = None,
        retry_after: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.outcome, self.param = status, kind, outcome, param
        self.retry_after = retry_after  # a 429's `Retry-After` (seconds)


@dataclass
class Pick:
    """One routed request, from its decision to its end."""

    request_id: str
    engine: HttpEngine
    #: The chosen endpoint first, then the fallbacks, as sent to the proxy.
    endpoints: list[str]
    answered: bool = False
    finished: bool = False


def endpoint_of(base_url: str) -> str:
    """An engine's `ip:port` from its hello's `base_url` (IPv6 in brackets, as Envoy writes it)."""
    url = URL(base_url)
    host = url.host or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EndpointPicker:
    def __init__(
        self,
        settings: EppSettings,
        registry: GatewayRegistry,
        feed: CoreFeed,
        router: InProcessRouter,
        sharer: DecisionSharer | None,
        keyer: PromptKeyer | None,
        flow: Flow | None = None,
    ) -> None:
        self.settings, self.registry, self.feed, self.router = settings, registry, feed, router
        self.sharer, self.keyer = sharer, keyer
        #: The gateway's flow control (`settings.admission`), with the gateway settings it reads.
        self.flow, self.gateway = flow, settings.gateway()
        self._endpoints: dict[str, str] = {}  # base_url -> ip:port

    def endpoint(self, engine: HttpEngine) -> str:
        endpoint = self._endpoints.get(engine.base_url)
        if endpoint is None:
            if len(self._endpoints) > 4 * self.registry.max_engines:
                self._endpoints.clear()
            endpoint = self._endpoints[engine.base_url] = endpoint_of(engine.base_url)
        return endpoint

    def load(self, engine: HttpEngine) -> float:
        """Requests outstanding on `engine` as the core counts them (running + waiting by its telemetry, plus every
        replica's decisions since), or this picker's own in-flight count before the core knows it."""
        fleet = self.feed.core.fleet
        row = fleet.index.get(engine.engine_id)
        if row is None:
            return float(engine.inflight)
        return float(fleet.num_running[row] + fleet.num_waiting[row] + fleet.inflight[row])

    async def pick(
        self, path: str, raw: bytes | None, subset: list[str] | None, headers: list[tuple[bytes, bytes]] | None = None
    ) -> Pick:
        """Decide where the request goes; raises `Refused` when no engine may take it. `headers`: the request's
        (lower-case names), for its priority band and tenant under flow control (`flow.Flow`, as in the gateway)."""
        path = path.split("?", 1)[0]
        model, tokens, body, chat = None, 1, None, path.endswith("/chat/completions")
        if path in COMPLETIONS and raw is not None:  # None: the proxy sends no body (GET, or body mode NONE)
            if len(raw) > self.settings.max_body_bytes:
                raise Refused(
                    413, f"request body over {self.settings.max_body_bytes} bytes", "BadRequestError", "too_large"
                )
            try:
                parsed = parse(raw, chat)
            except BadBody as exc:
                metrics.BAD_REQUESTS.labels(exc.reason).inc()
                raise Refused(400, str(exc), "BadRequestError", "bad_request", exc.param) from None
            model, tokens, body = parsed.model, parsed.prompt_tokens, parsed.body
        candidates, eligible = self._eligible(model, subset)
        bound = self.settings.shed_load
        if bound and all(self.load(e) >= bound for e in eligible):
            raise Refused(429, "every engine is at its load bound; retry later", "RateLimitError", "shed")
        request_id = "syepp-" + new_request_id().removeprefix("sygw-")
        routed = None
        if self.flow is not None and body is not None:
            routed = await self._admit(headers or [], model, tokens, body, eligible)
            if routed is not None:  # it waited: engines may have come or gone meanwhile
                try:
                    candidates, eligible = self._eligible(model, subset)
                except Refused:
                    routed()
                    raise
        try:
            keys = await self._keys(body, chat, model, eligible) if body is not None else None
            if keys is not None and keys.tokens is not None:
                tokens = max(1, keys.tokens)
            if eligible is candidates:
                engine = await self.router.route_dp(request_id, tokens, candidates, model, keys)
            else:
                engine = self._within(request_id, tokens, eligible)
        finally:
            if routed is not None:
                routed()  # the core counts it now: its slot is no longer pending in the queue
        if engine is None:  # no candidate left (it cannot happen with candidates; kept for the type)
            raise Refused(503, "no live engine can serve this request", "ServiceUnavailableError", "unavailable")
        engine.inflight += 1
        self.registry.hop_begun(engine)
        return Pick(request_id, engine, [self.endpoint(engine), *self._fallbacks(engine, eligible)])

    def _eligible(self, model: str | None, subset: list[str] | None) -> tuple[list[HttpEngine], list[HttpEngine]]:
        """The live DP engines serving `model`, and those of them in the proxy's subset (the same list without one);
        `Refused` when there are none."""
        candidates = self.registry.live("dp", model)
        if not candidates:
            served = self.registry.models()
            if model is not None and served and model not in served:
                raise Refused(404, f"The model `{model}` does not exist.", "NotFoundError", "unknown_model", "model")
            raise Refused(503, "no live engine can serve this request", "ServiceUnavailableError", "unavailable")
        if subset is None:
            return candidates, candidates
        allowed = set(subset)
        eligible = [e for e in candidates if self.endpoint(e) in allowed]
        if not eligible:
            raise Refused(
                503, "no engine among the proxy's endpoint subset can serve this request",
                "ServiceUnavailableError", "subset_empty",
            )  # fmt: skip
        return candidates, eligible

    async def _admit(
        self,
        headers: list[tuple[bytes, bytes]],
        model: str | None,
        tokens: int,
        body: dict,
        eligible: list[HttpEngine],
    ) -> Callable[[], None] | None:
        """The gateway's flow control (`flow.Flow.admit`) for this request: returns at once while an engine has room,
        else once the queue lets it out (the `routed` to call once it is routed); `Refused` (429 with `Retry-After`,
        400 for a bad priority or tenant header, 503 at shutdown) instead. The client leaving ends the ext_proc
        stream, which cancels this wait and takes the request out of the queue."""
        flow, g = self.flow, self.gateway
        assert flow is not None
        try:
            klass = classify(headers, body, BANDS.index(g.default_priority))
        except BadClass as exc:
            raise Refused(400, str(exc), "BadRequestError", "bad_request", exc.header) from None

        def cost() -> float:
            return request_cost(tokens, body, g.output_token_weight, g.default_output_tokens)

        refused, routed = await flow.admit(None, model, klass, cost, eligible)
        if refused is None:
            return routed
        outcome = "queue_shed" if refused.status == 429 else "stopping"
        retry_after = str(refused.retry_after_s) if refused.retry_after_s is not None else None
        raise Refused(refused.status, refused.message, refused.kind, outcome, retry_after=retry_after)

    async def _keys(self, body: dict, chat: bool, model: str | None, engines: list[HttpEngine]) -> PromptKeys | None:
        """The prompt's block keys at the block size most candidates announce; none (counted) if naming fails."""
        if self.keyer is None:
            return None
        size = key_block_size([e.block_size for e in engines])
        try:
            return await self.keyer.keys(body, chat, model, size)
        except Exception:
            gateway_metrics.PROMPT_KEYS_FAILED.inc()
            log.debug("no block keys for a request", exc_info=True)
            return None

    def _fallbacks(self, chosen: HttpEngine, eligible: list[HttpEngine]) -> list[str]:
        """The other eligible endpoints, least outstanding first (then by id), at most `fallbacks` of them."""
        n = self.settings.fallbacks
        if n == 0 or len(eligible) < 2:
            return []
        rest = sorted((e for e in eligible if e is not chosen), key=lambda e: (self.load(e), e.engine_id))
        return [self.endpoint(e) for e in rest[:n]]

    def _within(self, request_id: str, tokens: int, eligible: list[HttpEngine]) -> HttpEngine:
        """A choice narrower than the core's view (the proxy's subset): the least outstanding eligible engine,
        counted in the core (exact ledger, views, shared) as the core counts its own. The core's profiles choose
        over a model's whole fleet; a per-request candidate mask would be a core change (docs/epp.md)."""
        engine = min(eligible, key=lambda e: (self.load(e), e.engine_id))
        core = self.feed.core
        row = core.fleet.index.get(engine.engine_id)
        if row is not None:
            core.fleet.on_decision_row(row, tokens, time.monotonic(), request_id, LOCAL_REPORTER)
            core.dp.record_decision(row, tokens)
            core.decode.record_decision(row, tokens)
            if self.sharer is not None:
                self.sharer.add(Decided("dp", request_id, engine.engine_id, tokens))
                self.sharer.idle()
        return engine

    def answered(self, pick: Pick, status: int, served: str | None) -> None:
        """The response's headers came back: its first token for the core (the picker sees no body, see
        docs/epp.md), and the hop's verdict for the registry (5xx: failed, as the gateway counts a hop)."""
        if pick.answered:
            return
        pick.answered = True
        self.feed.settle((pick.request_id,), ())
        first = pick.endpoints[0]
        if served is not None and served != first:
            metrics.SERVED_ELSEWHERE.inc()
            self.registry.hop_failed(pick.engine)  # the proxy moved on: the chosen one did not answer
            return
        if status >= 500:
            metrics.HOP_FAILURES.inc()
            self.registry.hop_failed(pick.engine)
        elif status:
            self.registry.hop_succeeded(pick.engine)

    def finish(self, pick: Pick) -> None:
        """The request is over (its ext_proc stream ended): settle it in the core, once."""
        if pick.finished:
            return
        pick.finished = True
        if not pick.answered:
            self.registry.hop_abandoned(pick.engine)
        self.feed.settle((), (pick.request_id,))
        pick.engine.inflight = max(0, pick.engine.inflight - 1)
