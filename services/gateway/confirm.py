"""The answers that confirm (or contradict) an engine's KV claims, for the in-process core (issue 37, item 2).

When the core routed a request by an engine's claimed prefix (`PrefixState.record`), the engine's answer says
what it really found cached: `usage.prompt_tokens_details.cached_tokens` (vLLM with
`--enable-prompt-tokens-details`), in a whole answer's body or in a stream's final usage chunk (present only when
the client asked `stream_options.include_usage`). `watch` reads it (a regex, `reported_cached_tokens`) and hands
it to `PrefixState.answered`. Only requests the core expects an answer for are watched; the rest pay nothing.

An answer counts as the claimed engine's only when that engine's hop succeeded (`HttpEngine.failures` is 0 after
it): a hop retried on another engine reports nothing of the claim (`unreported`).

The remote-router shape has no such feedback (the router never sees answers): there claims are believed as
sent, within the rate and capacity bounds (docs/security.md says what is open).
"""

from __future__ import annotations

import time

from starlette.responses import Response
from starlette.types import Message, Send

from switchyard.services.gateway.registry import HttpEngine
from switchyard.services.gateway.relay import Context, StreamedAnswer, ToClient
from switchyard.services.router.kv_trust import reported_cached_tokens
from switchyard.services.router.prefix import PrefixState

__all__ = ["claims_of", "watch"]


def claims_of(ctx: Context, request_id: str) -> PrefixState | None:
    """The in-process core's prefix state when it expects this request's answer to confirm a claim."""
    core = getattr(ctx.router, "core", None)
    prefix: PrefixState | None = core.prefix if core is not None else None
    if prefix is None or prefix.claims is None or request_id not in prefix.claims.expected:
        return None
    return prefix


def unanswered(prefix: PrefixState, request_id: str) -> None:
    """The request ended without an answer of the claimed engine's: its claim is neither confirmed nor not."""
    prefix.answered(request_id, None, time.monotonic())


def watch(prefix: PrefixState, request_id: str, engine: HttpEngine, answer: ToClient) -> ToClient:
    """Report the answer's cached tokens once it is known: at once for a whole answer, at a stream's end."""
    if engine.failures or answer.status_code >= 400:
        unanswered(prefix, request_id)
        return answer
    if isinstance(answer, Response):
        prefix.answered(request_id, reported_cached_tokens(bytes(answer.body)), time.monotonic())
        return answer
    return _watch_stream(prefix, request_id, answer)


def _watch_stream(prefix: PrefixState, request_id: str, answer: StreamedAnswer) -> StreamedAnswer:
    found = [reported_cached_tokens(answer.first)]
    relay, finish = answer.relay, answer.finish

    async def watched(send: Send) -> bool:
        async def peek(message: Message) -> None:
            body = message.get("body")
            if body and b'"usage"' in body:
                reported = reported_cached_tokens(body)
                if reported is not None:
                    found[0] = reported
            await send(message)

        return await relay(peek)

    def finished(outcome: str, first_at: float) -> None:
        finish(outcome, first_at)
        prefix.answered(request_id, found[0] if outcome == "ok" else None, time.monotonic())

    answer.relay, answer.finish = watched, finished
    return answer
