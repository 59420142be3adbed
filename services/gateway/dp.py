"""The data-parallel path: ask `sy.route.dp` (Gimbal's pressure rule, or vLLM's), forward the body as received."""

from __future__ import annotations

from starlette.requests import Request

from switchyard.services.gateway.body import Parsed, error_response
from switchyard.services.gateway.registry import Engine
from switchyard.services.gateway.relay import Context, ToClient, final_hop


async def serve_dp(
    ctx: Context,
    request: Request,
    parsed: Parsed,
    raw: bytes,
    path: str,
    candidates: list[Engine],
    request_id: str,
    started: float,
) -> ToClient:
    engine = await ctx.router.route_dp(request_id, parsed.prompt_tokens, candidates, parsed.model, parsed.keys)
    if engine is None:
        return error_response(503, "no live engine", "ServiceUnavailableError")
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
    )
