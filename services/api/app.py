"""The FastAPI application: `create_app(settings)` wires the routes to a database, NATS and the live fleet view."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import Counter
from sqlalchemy.exc import DBAPIError

from switchyard.services.api import history, live
from switchyard.services.api.deps import ApiState
from switchyard.services.api.settings import ApiSettings
from switchyard.services.fleet_view import FleetView
from switchyard.services.runtime import ensure_schema
from switchyard.shared.bus import Bus
from switchyard.shared.db import create_async_db
from switchyard.shared.settings import SwitchyardSettings

log = logging.getLogger(__name__)

REQUESTS = Counter("switchyard_api_requests_total", "HTTP requests served, by route and status.", ["route", "status"])

DESCRIPTION = """\
Placement, migration and calibration history of the Switchyard control plane, the live engine view and the
current routing artifact. Reads are open; writes (trigger a calibration, re-apply a past placement) need
`Authorization: Bearer <SWITCHYARD_API_TOKEN>`. Listings are newest first and paged with an opaque cursor.
"""


def create_app(settings: SwitchyardSettings, config: ApiSettings | None = None) -> FastAPI:
    """The API; its lifespan connects to the database (schema brought to head) and NATS, and closes both."""
    config = config or ApiSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        database_url = settings.resolved_database_url()
        await ensure_schema(database_url)
        engine, sessions = create_async_db(database_url)
        bus = await Bus.connect(settings, name="switchyard-api", role="api")
        ingest: Bus | None = None
        try:
            # The fleet view (hellos, telemetry: wildcard subjects any engine publishes on) has a connection of
            # its own: a flood there can make the server cut it off as a slow consumer, never the one that
            # publishes plans and calibration requests and reads the routing artifact.
            ingest = await Bus.connect(settings, name="switchyard-api-ingest", role="api")
            await bus.ensure_streams()
            fleet = FleetView(manifest=settings.engine_manifest_entries())
            await fleet.subscribe(ingest)
            kv = await bus.ensure_kv(bus.subjects.router_bucket)
            app.state.switchyard = ApiState(settings, config, engine, sessions, bus, fleet, kv, ingest)
            yield
        finally:
            if ingest is not None:
                await ingest.close()
            await bus.close()
            await engine.dispose()

    # FastAPIOffline: FastAPI whose /docs and /redoc load their scripts from the package, not from a CDN.
    app = FastAPIOffline(title="Switchyard", version="1", description=DESCRIPTION, lifespan=lifespan)
    app.include_router(history.router)
    app.include_router(live.router)

    @app.middleware("http")
    async def count_requests(request: Request, call_next) -> Response:
        response = await call_next(request)
        route = request.scope.get("route")
        REQUESTS.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        return response

    @app.exception_handler(DBAPIError)
    async def database_unavailable(_request: Request, exc: DBAPIError) -> JSONResponse:
        log.warning("database error: %s", exc)
        return JSONResponse({"detail": f"database unavailable: {type(exc.orig).__name__}"}, status_code=503)

    return app
