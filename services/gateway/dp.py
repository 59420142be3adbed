"""The data-parallel path: ask `sy.route.dp` (Gimbal's pressure rule, or vLLM's), forward the body as received."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.requests import Request

from switchyard.services.gateway.body import Parsed, error_response
from switchyard.services.gateway.confirm import claims_of, unanswered, watch
from switchyard.services.gateway.local_route import InProcessRouter
from switchyard.services.gateway.registry import HttpEngine
from switchyard.services.gateway.relay import Context, StreamedAnswer, ToClient, final_hop
from switchyard.services.gateway.routing import traced_route
from switchyard.services.gateway.sessions import session_key


async def serve_dp(
    ctx: Context,
    request: Request,
    parsed: Parsed,
    raw: bytes,
    path: str,
    candidates: list[HttpEngine],
    request_id: str,
    started: float,
    routed: Callable[[], None] | None = None,
    session: str | None = None,
) -> ToClient:
    """Route and relay; `routed()` (flow control's) is called once the engine is chosen: the core counts it now.
    A `session` goes to its engine while that one has room (`sessions.Sessions`), else where the core chooses."""
    sessions, router = ctx.sessions, ctx.router
    pinned, key = None, ""
    if session is not None and sessions is not None and isinstance(router, InProcessRouter):
        key = session_key(session)  # its binding here and on the decision the other replicas learn it from
        pinned = sessions.sticky(key, candidates)
    if pinned is not None:
        engine: HttpEngine | None = router.route_to(request_id, parsed.prompt_tokens, pinned, key)  # type: ignore[union-attr]
    else:
        if key:
            choice = router.route_dp(request_id, parsed.prompt_tokens, candidates, parsed.model, parsed.keys, key)  # type: ignore[call-arg]
        else:
            choice = router.route_dp(request_id, parsed.prompt_tokens, candidates, parsed.model, parsed.keys)
        if ctx.tracing is None:
            engine = await choice
        else:
            engine = await traced_route(ctx.tracing, router, "dp", request_id, choice)
    if routed is not None:
        routed()
    if key and sessions is not None and engine is not None:
        sessions.served(key, engine)
    if engine is None:
        return error_response(503, "no live engine", "ServiceUnavailableError")
    claims = claims_of(ctx, request_id)  # the core credited a KV claim: the answer is to confirm it
    if claims is not None:
        try:
            answer = await _relay(ctx, request, raw, path, candidates, request_id, started, parsed, engine)
        except BaseException:
            unanswered(claims, request_id)
            ctx.router.progress.done(request_id)  # type: ignore[union-attr]  # in-process: it reports progress
            raise
        return _progressed(ctx, request_id, watch(claims, request_id, engine, answer))
    progress = ctx.router.progress
    if progress is None:
        return await _relay(ctx, request, raw, path, candidates, request_id, started, parsed, engine)
    try:
        answer = await _relay(ctx, request, raw, path, candidates, request_id, started, parsed, engine)
    except BaseException:
        progress.done(request_id)
        raise
    return _progressed(ctx, request_id, answer)


def _progressed(ctx: Context, request_id: str, answer: ToClient) -> ToClient:
    """The answer, reporting its first token and its end to the router's ledger (`progress`)."""
    progress = ctx.router.progress
    assert progress is not None
    if isinstance(answer, StreamedAnswer):  # the engine's first chunk is in hand: its first token
        # Reported once the chunk has gone to the client (the loop's next turn), not ahead of it.
        asyncio.get_running_loop().call_soon(progress.first, request_id)
        finish = answer.finish

        def finished(outcome: str, first_at: float) -> None:
            finish(outcome, first_at)
            progress.done(request_id)

        answer.finish = finished
    else:  # a whole answer (or an error): the request is over
        progress.done(request_id)
    return answer


async def _relay(
    ctx: Context,
    request: Request,
    raw: bytes,
    path: str,
    candidates: list[HttpEngine],
    request_id: str,
    started: float,
    parsed: Parsed,
    engine: HttpEngine,
) -> ToClient:
    return await final_hop(
        ctx,
        request,
        kind="dp",
        hop="dp",
        engine=engine,
        candidates=candidates,
        path=path,
        content=raw,
        stream=parsed.stream,
        request_id=request_id,
        started=started,
        prompt_tokens=parsed.prompt_tokens,
    )
