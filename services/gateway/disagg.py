"""The prefill->decode handoff, as vLLM's disaggregated-serving proxy does it, with ELDR's decode routing.

1. Prefill: the body with `max_tokens = 1`, `stream = false` and `kv_transfer_params.do_remote_decode = true`
   goes to the prefill engine holding the most of the prompt's blocks under a load bound, ties by prefix-hash
   affinity (`choice.pick_prefill`, `prefix.PrefillPrefix`); one retry on the next engine if it fails.
2. Signature: `kv_transfer_params.switchyard_signature` in the prefill response, else the `PrefillSignature`
   the engine publishes on the bus for this request id, waited for at most `signature_wait_s` (not at all
   for an engine that published none for its last few handoffs); else none (the router then routes by load
   and says so in its reply's `fallback`).
3. `sy.route.decode` with the signature picks the decoder (ELDR).
4. Decode: the original body plus the prefill response's `kv_transfer_params`, without the `switchyard_*`
   keys, goes to that decoder; its answer streams back (one retry before the first byte on another decoder).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from switchyard.services.gateway import metrics
from switchyard.services.gateway.body import Parsed, error_response
from switchyard.services.gateway.choice import pick_prefill
from switchyard.services.gateway.registry import HttpEngine
from switchyard.services.gateway.relay import (
    ClientGone,
    Context,
    ToClient,
    client_authorization,
    final_hop,
    hop_span,
    until_disconnect,
)
from switchyard.services.gateway.routing import traced_route
from switchyard.services.gateway.upstream import Answer, UpstreamError
from switchyard.shared import json_depth
from switchyard.shared.errors import WireError
from switchyard.shared.signature_json import SIGNATURE_KEY, signature_from_json

#: What vLLM's proxy sends a prefill engine so that it keeps the KV blocks for a remote decoder.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": dict(PREFILL_KV_PARAMS)}
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


def decode_body(body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The client's body plus the prefill's transfer parameters, without Switchyard's own keys."""
    return {**body, "kv_transfer_params": {k: v for k, v in kv_params.items() if not k.startswith("switchyard_")}}


def signature_in(kv_params: dict[str, Any]) -> np.ndarray | None:
    """The signature carried in the prefill response, None when absent or malformed (counted)."""
    carried = kv_params.get(SIGNATURE_KEY)
    if carried is None:
        return None
    try:
        return signature_from_json(carried)
    except WireError:
        metrics.SIGNATURES.labels("malformed").inc()
        return None


def _prefill_answer(engine: HttpEngine, answer: Answer) -> Any:
    """The prefill answer's JSON, parsed with the nesting bound (`shared.json_depth`): an answer that is not
    JSON, or nests deeper than any OpenAI answer does, is a hostile hop failure, never a RecursionError."""
    try:
        return json_depth.loads(answer.content)
    except json_depth.TooDeep:
        raise UpstreamError(engine, "too_deep") from None
    except ValueError:
        raise UpstreamError(engine, "not_json") from None


async def _prefill(
    ctx: Context, request: Request, engines: list[HttpEngine], parsed: Parsed, path: str, request_id: str
) -> tuple[HttpEngine, dict[str, Any]] | Response:
    engines = [e for e in engines if not (e.ejected or e.trial_busy)] or engines  # out since the list was taken
    keys, prefix = parsed.keys, ctx.prefix
    cached = None
    if keys is not None and prefix is not None and len(keys.keys):
        cached = prefix.cached(keys.keys, keys.kind, engines, time.monotonic())
    order = pick_prefill(
        parsed.prefix,
        [e.engine_id for e in engines],
        [e.inflight for e in engines],
        ctx.settings.affinity_load_bound,
        cached,
    )
    by = "off" if prefix is None else "prefix" if cached and cached[order[0]] > 0 else "hash"
    metrics.PREFILL_CHOICES.labels(by).inc()
    content = json.dumps(prefill_body(parsed.body)).encode()
    headers = ctx.upstream.headers(request_id, client_authorization(request))
    tracing = ctx.tracing
    for attempt, index in enumerate(order[:2]):
        engine = engines[index]
        if attempt:
            metrics.RETRIES.labels("prefill").inc()
        span, sent = None, headers
        if tracing is not None:
            span, sent = hop_span(tracing, engine, path, "prefill", headers)
        engine.inflight += 1
        ctx.registry.hop_begun(engine)
        try:
            call = ctx.upstream.post(engine, path, content, sent, ctx.settings.prefill_timeout_s)
            answer = await until_disconnect(request, call)
            data = _prefill_answer(engine, answer) if answer.status < 400 else None
        except UpstreamError as exc:
            ctx.registry.hop_failed(engine, exc.hostile)
            metrics.UPSTREAM_ERRORS.labels(engine.engine_id, "prefill", exc.reason).inc()
            if span is not None:
                tracing.end(span, exc.reason)  # type: ignore[union-attr]
            continue
        except BaseException as exc:
            ctx.registry.hop_abandoned(engine)
            if span is not None:
                tracing.end(span, type(exc).__name__)  # type: ignore[union-attr]
            raise
        finally:
            engine.inflight -= 1
        if span is not None:
            span.set_attribute("http.response.status_code", answer.status)
            tracing.end(span)  # type: ignore[union-attr]
        ctx.registry.hop_succeeded(engine)
        if answer.status >= 400:  # the engine refused the request itself: the client's answer
            metrics.REQUESTS.labels("disagg", "client_error").inc()
            return Response(answer.content, answer.status, media_type=answer.content_type)
        kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
        usage = data.get("usage") if isinstance(data, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            parsed.prompt_tokens = usage["prompt_tokens"]
        if keys is not None and prefix is not None and len(keys.keys):  # run once this request's next hop waits
            now = time.monotonic()
            asyncio.get_running_loop().call_soon(prefix.chosen, engine.engine_id, keys.keys, keys.kind, now)
        return engine, kv if isinstance(kv, dict) else {}
    metrics.REQUESTS.labels("disagg", "upstream_error").inc()
    return error_response(502, "prefill failed on every engine tried", "BadGatewayError")


async def serve_disagg(
    ctx: Context,
    request: Request,
    parsed: Parsed,
    path: str,
    prefills: list[HttpEngine],
    decoders: list[HttpEngine],
    request_id: str,
    started: float,
    routed: Callable[[], None] | None = None,
) -> ToClient:
    """The handoff; `routed()` (flow control's) is called once the decoder is chosen: both engines count it now."""
    ctx.signatures.expect(request_id)  # before the prefill: the bus message may beat the HTTP answer
    try:
        done = await _prefill(ctx, request, prefills, parsed, path, request_id)
    except ClientGone:
        ctx.signatures.discard(request_id)
        metrics.CLIENT_ABORTS.labels("disagg").inc()
        metrics.REQUESTS.labels("disagg", "aborted").inc()
        return Response(status_code=499)
    except BaseException:
        ctx.signatures.discard(request_id)
        raise
    if isinstance(done, Response):
        ctx.signatures.discard(request_id)
        return done
    prefill_engine, kv = done
    signature = signature_in(kv)
    if signature is not None:
        ctx.signatures.discard(request_id)
        metrics.SIGNATURES.labels("response").inc()
        if ctx.flow is not None:  # the queue's charge is corrected from it, as from a bus signature
            ctx.flow.observe(request_id, signature)
    else:
        engine_id = prefill_engine.engine_id
        wait_s = ctx.signatures.wait_for(engine_id, ctx.settings.signature_wait_s)
        signature = await ctx.signatures.wait(request_id, wait_s, engine_id)
        metrics.SIGNATURES.labels("bus" if signature is not None else "missing").inc()
    choice = ctx.router.route_decode(
        request_id, parsed.prompt_tokens, signature, prefill_engine.engine_id, decoders, parsed.model
    )
    if ctx.tracing is None:
        decoder = await choice
    else:
        decoder = await traced_route(ctx.tracing, ctx.router, "decode", request_id, choice)
    if routed is not None:
        routed()
    if decoder is None:
        return error_response(503, "no live decode engine", "ServiceUnavailableError")
    return await final_hop(
        ctx,
        request,
        kind="disagg",
        hop="decode",
        engine=decoder,
        candidates=decoders,
        path=path,
        content=json.dumps(decode_body(parsed.body, kv)).encode(),
        stream=parsed.stream,
        request_id=request_id,
        started=started,
        prompt_tokens=parsed.prompt_tokens,  # the prefill's usage where it gave one (`_prefill`)
    )
