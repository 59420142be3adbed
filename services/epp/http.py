"""The picker's HTTP port: Prometheus `/metrics` and `POST /v1/select` (services/epp/select.py), one aiohttp app.

It runs on the picker's event loop, beside the gRPC server, because a selection reads and counts in the same
engine registry and router core as the ext_proc decisions (neither is shared across threads).
"""

from __future__ import annotations

import json
import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from switchyard.services.epp import metrics
from switchyard.services.epp.select import MAX_REQUEST_BYTES, MEDIA_TYPE, BadSelection, Selector, parse_selection
from switchyard.shared.errors import ConfigError

log = logging.getLogger(__name__)

SELECT_PATH = "/v1/select"


def _error(status: int, reason: str, message: str) -> web.Response:
    """A refusal AIBrix counts as a failed exchange; its body says why, for whoever reads the logs."""
    body = json.dumps({"error": {"reason": reason, "message": message}})
    return web.Response(status=status, text=body, content_type="application/json")


def build_app(selector: Selector) -> web.Application:
    async def select(request: web.Request) -> web.Response:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            metrics.SELECTIONS.labels("too_large").inc()
            return _error(413, "too_large", f"request body over {MAX_REQUEST_BYTES} bytes")
        try:
            selection = parse_selection(raw)
        except BadSelection as exc:
            metrics.SELECTIONS.labels("bad_request").inc()
            metrics.SELECT_BAD_REQUESTS.labels(exc.reason).inc()
            return _error(400, exc.reason, str(exc))
        answer = selector.select(selection)
        # AIBrix accepts the answer only in its versioned media type (aiohttp's content_type takes no parameters).
        return web.Response(body=json.dumps(answer).encode(), headers={"Content-Type": MEDIA_TYPE})

    async def prometheus(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app.router.add_post(SELECT_PATH, select)
    app.router.add_get("/metrics", prometheus)
    return app


async def start_http(selector: Selector, host: str, port: int) -> web.AppRunner:
    """Serve the app on `host:port` until the returned runner is cleaned up (`await runner.cleanup()`)."""
    runner = web.AppRunner(build_app(selector), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"the endpoint picker cannot serve HTTP on {host}:{port}: {exc}") from None
    log.info("endpoint picker HTTP (metrics, %s) on %s:%d", SELECT_PATH, host, port)
    return runner
