"""Live routes: the engines as their hellos and telemetry describe them, the routing artifact, health, metrics."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, Response, status
from nats.js.errors import KeyNotFoundError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import select, text

from switchyard.services.api import models as m
from switchyard.services.api.deps import Session, State
from switchyard.services.artifacts import ArtifactError, last_valid_artifact, load_artifact
from switchyard.services.engine_book import BookEntry
from switchyard.services.fleet_view import FleetView
from switchyard.shared.db import Engine

router = APIRouter()
#: Largest page of `/v1/engines` (20,000 hellos once made it a 10.5 MB response).
ENGINES_PAGE_MAX = 500


def _when(ts: float | None) -> datetime | None:
    return datetime.fromtimestamp(ts, UTC) if ts else None


@router.get("/v1/engines", response_model=list[m.EngineOut], tags=["engines"])
async def list_engines(
    state: State,
    session: Session,
    response: Response,
    ep_group: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9_-]{1,64}$")] = None,
    role: Literal["prefill", "decode", "dp"] | None = None,
    limit: Annotated[int, Query(ge=1, le=ENGINES_PAGE_MAX, description="Page size.")] = ENGINES_PAGE_MAX,
    offset: Annotated[
        int, Query(ge=0, le=10**7, description="Engines to skip (`X-Next-Offset` of the last page).")
    ] = 0,
) -> list[m.EngineOut]:
    """Every engine heard live since the API started, plus those only known from earlier hellos (marked stale).

    Paged: at most `limit` engines; when more follow, the `X-Next-Offset` header says where the next page starts
    (`X-Total-Count`: how many match)."""
    # Only the sort keys of every match are gathered (from the database, three small columns); the page's
    # engines alone are loaded and built. Building every one per request held ~90 MB at once for 20,000 rows.
    fleet = state.fleet
    live = {
        engine_id: s
        for engine_id, s in fleet.engines.items()
        if (ep_group is None or (s.hello is not None and s.hello.ep_group == ep_group))
        and (role is None or (s.hello is not None and s.hello.role == role))
    }
    keys: list[tuple[str, int, str]] = [
        (s.hello.ep_group if s.hello else "", s.hello.dp_rank if s.hello else 0, engine_id)
        for engine_id, s in live.items()
    ]
    query = select(Engine.engine_id, Engine.ep_group, Engine.hello["dp_rank"].as_integer())
    if ep_group is not None:
        query = query.where(Engine.ep_group == ep_group)
    if role is not None:
        query = query.where(Engine.role == role)
    keys += [
        (group or "", rank or 0, engine_id)
        for engine_id, group, rank in await session.execute(query)
        if engine_id not in fleet.engines  # a live record wins over the database's, matching or not
    ]
    keys.sort()
    response.headers["X-Total-Count"] = str(len(keys))
    if offset + limit < len(keys):
        response.headers["X-Next-Offset"] = str(offset + limit)
    page = [engine_id for _, _, engine_id in keys[offset : offset + limit]]
    stored = [engine_id for engine_id in page if engine_id not in live]
    rows: dict[str, Engine] = {}
    if stored:
        rows = {
            row.engine_id: row for row in (await session.scalars(select(Engine).where(Engine.engine_id.in_(stored))))
        }
    return [
        _live_engine(fleet, live[e]) if e in live else _stored_engine(rows[e]) for e in page if e in live or e in rows
    ]


def _live_engine(fleet: FleetView, s: BookEntry) -> m.EngineOut:
    hello = s.hello
    return m.EngineOut(
        engine_id=s.engine_id,
        role=hello.role if hello else None,
        ep_group=hello.ep_group if hello else None,
        dp_rank=hello.dp_rank if hello else None,
        gpus=list(hello.gpus) if hello else [],
        model=m.ModelOut.model_validate(hello.model) if hello else None,
        agent=hello.agent if hello else None,
        live=True,
        stale=fleet.is_stale(s),
        last_seen=_when(s.last_seen),
        telemetry=m.TelemetryOut.model_validate(s.telemetry) if s.telemetry else None,
        telemetry_gaps=s.telemetry_gaps,
        restarts=s.restarts,
    )


def _stored_engine(row: Engine) -> m.EngineOut:
    return m.EngineOut(
        engine_id=row.engine_id,
        role=row.role,
        ep_group=row.ep_group,
        dp_rank=row.hello.get("dp_rank"),
        gpus=list(row.hello.get("gpus", [])),
        model=m.ModelOut(name=row.model_name, num_layers=row.num_layers, num_experts=row.num_experts, top_k=row.top_k),
        agent=row.agent,
        live=False,
        stale=True,
        last_seen=row.last_seen,
        telemetry=None,
        telemetry_gaps=0,
        restarts=0,
    )


@router.get("/v1/router/artifact", response_model=m.ArtifactOut, tags=["router"])
async def router_artifact(
    state: State,
    include_arrays: Annotated[bool, Query(description="Also return the IDF weights and centroids.")] = False,
) -> m.ArtifactOut:
    """The routing artifact the router replicas score against (KV bucket `sy-router`): metadata and shapes."""
    try:
        entry = await state.kv.get(state.bus.subjects.artifact_key)
    except KeyNotFoundError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no routing artifact has been published yet") from None
    key, revision = state.settings.artifact_key(), entry.revision or 0
    try:
        artifact = load_artifact(entry.value or b"", state.bus.max_payload, "KV artifact", key)
    except ArtifactError as exc:  # what the routers do: the last valid revision the bucket keeps
        found = await last_valid_artifact(state.kv, state.bus.subjects.artifact_key, state.bus.max_payload, key)
        if found is None:
            raise HTTPException(status.HTTP_502_BAD_GATEWAY, f"the stored routing artifact is invalid: {exc}") from None
        artifact, revision = found
    return m.ArtifactOut(
        **artifact.model_dump(include=set(m.ArtifactOut.model_fields) - {"model", "idf", "centroids"}),
        model=m.ModelOut.model_validate(artifact.model),
        idf_shape=list(artifact.idf.shape),
        centroids_shape=list(artifact.centroids.shape),
        kv_revision=revision,
        idf=artifact.idf.tolist() if include_arrays else None,
        centroids=artifact.centroids.tolist() if include_arrays else None,
    )


@router.get("/healthz", response_model=m.Health, tags=["health"])
async def healthz() -> m.Health:
    """Liveness: the process serves HTTP."""
    return m.Health(status="ok")


@router.get("/readyz", response_model=m.Health, tags=["health"], responses={503: {"model": m.Health}})
async def readyz(state: State, response: Response) -> m.Health:
    """Readiness: the database answers and NATS is connected."""
    checks = {"nats": "ok" if state.bus.nc.is_connected else "disconnected"}
    try:
        async with state.sessions() as session:
            await asyncio.wait_for(session.execute(text("SELECT 1")), 2.0)
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"unavailable: {type(exc).__name__}"
    ready = all(v == "ok" for v in checks.values())
    if not ready:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return m.Health(status="ok" if ready else "unavailable", checks=checks)


@router.get("/metrics", tags=["health"], response_class=Response)
async def metrics() -> Response:
    """Prometheus metrics of this process."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
