"""History routes: placements (with layouts and diffs), migrations (with per-move state), calibrations; and writes."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, HTTPException, Path, Query, status
from sqlalchemy import Select, func, select
from sqlalchemy.exc import IntegrityError

from switchyard.services.api import models as m
from switchyard.services.api.deps import Session, State, Writer, as_utc, decode_cursor, encode_cursor
from switchyard.services.expert_map import ExpertMapUnavailable, expert_map
from switchyard.services.history import (
    add_placement,
    applied_placement,
    load_layout,
    moves_between,
    new_plan_id,
    next_version,
    publish_plan,
)
from switchyard.shared.db import Calibration, Migration, MigrationMove, Placement
from switchyard.shared.schemas import CalibrationRequest, ObjectiveTerms, PlacementParams, PlacementPlan
from switchyard.solver.placement.layouts import default_layout_like

router = APIRouter(prefix="/v1")

Id = Annotated[int, Path(ge=1, le=2**63 - 1)]
Group = Annotated[str | None, Query(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Engine (EP) group id.")]
Limit = Annotated[int, Query(ge=1, le=500, description="Page size.")]
Cursor = Annotated[str | None, Query(max_length=64, description="`next_cursor` of the previous page.")]
Source = Literal["greedy", "minlp", "manual", "rollback"]
PlacementStatus = Literal["proposed", "published", "applied", "superseded", "rejected", "failed"]
MigrationState = Literal["pending", "running", "succeeded", "failed", "rolling_back", "rolled_back", "refused"]


async def _page(session: Session, query: Select[Any], id_column: Any, limit: int, cursor: str | None) -> tuple:
    after = decode_cursor(cursor)
    if after is not None:
        query = query.where(id_column < after)
    rows = list((await session.scalars(query.order_by(id_column.desc()).limit(limit + 1))).all())
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (encode_cursor(rows[-1].id) if more and rows else None)


_MAPS = ("params", "objective")  # JSON maps on the row, shaped for the response below


def _summary(row: Placement) -> m.PlacementSummary:
    return m.PlacementSummary(
        **{
            name: getattr(row, name)
            for name in m.PlacementSummary.model_fields
            if name not in _MAPS and hasattr(row, name)
        },
        params=row.params,
        objective={**row.objective_terms, "total": row.objective_total},
    )


async def _moves_by_state(session: Session, migration_ids: list[int]) -> dict[int, dict[str, int]]:
    counts: dict[int, dict[str, int]] = {i: {} for i in migration_ids}
    if migration_ids:
        query = (
            select(MigrationMove.migration_id, MigrationMove.state, func.count())
            .where(MigrationMove.migration_id.in_(migration_ids))
            .group_by(MigrationMove.migration_id, MigrationMove.state)
        )
        for migration_id, state, count in await session.execute(query):
            counts[migration_id][state] = count
    return counts


def _migration(row: Migration, by_state: dict[str, int]) -> m.MigrationSummary:
    fields = {name: getattr(row, name) for name in m.MigrationSummary.model_fields if hasattr(row, name)}
    return m.MigrationSummary(**fields, moves_by_state=by_state)


# ----- placements -----


@router.get("/placements", response_model=m.Page[m.PlacementSummary], tags=["placements"])
async def list_placements(
    session: Session,
    engine_group: Group = None,
    source: Source | None = None,
    status_: Annotated[PlacementStatus | None, Query(alias="status")] = None,
    since: Annotated[datetime | None, Query(description="Created at or after (ISO 8601; UTC if no zone).")] = None,
    until: Annotated[datetime | None, Query(description="Created before (ISO 8601; UTC if no zone).")] = None,
    limit: Limit = 50,
    cursor: Cursor = None,
) -> m.Page[m.PlacementSummary]:
    """Every placement ever planned, newest first: published, applied and rejected ones, with their terms."""
    query = select(Placement)
    if engine_group is not None:
        query = query.where(Placement.engine_group == engine_group)
    if source is not None:
        query = query.where(Placement.source == source)
    if status_ is not None:
        query = query.where(Placement.status == status_)
    if (start := as_utc(since, "since")) is not None:
        query = query.where(Placement.created_at >= start)
    if (end := as_utc(until, "until")) is not None:
        query = query.where(Placement.created_at < end)
    rows, next_cursor = await _page(session, query, Placement.id, limit, cursor)
    return m.Page[m.PlacementSummary](items=[_summary(r) for r in rows], next_cursor=next_cursor)


async def _detail(session: Session, row: Placement) -> m.PlacementDetail:
    layout = await load_layout(session, row) if row.details.get("layout_stored", True) else None
    predecessor = await session.get(Placement, row.parent_id) if row.parent_id is not None else None
    diff, diff_base = None, None
    if layout is not None:
        if predecessor is not None and predecessor.details.get("layout_stored", True):
            before, diff_base = await load_layout(session, predecessor), "predecessor"
        else:
            before, diff_base = default_layout_like(layout), "default"
        moves = await asyncio.to_thread(moves_between, before, layout)
        if moves is None:  # incomparable layouts (e.g. a GPU was added): no diff
            diff_base = None
        else:
            diff = [m.Move(**dict(zip(m.Move.model_fields, mv, strict=True))) for mv in moves.tolist()]
    migration = await session.scalar(select(Migration).where(Migration.placement_id == row.id))
    migration_out = None
    if migration is not None:
        migration_out = _migration(migration, (await _moves_by_state(session, [migration.id]))[migration.id])
    return m.PlacementDetail(
        **_summary(row).model_dump(),
        layout=layout.tolist() if layout is not None else None,
        predecessor_id=predecessor.id if predecessor is not None else None,
        diff_base=diff_base,
        diff=diff,
        migration=migration_out,
    )


@router.get("/placements/current", response_model=m.PlacementDetail, tags=["placements"])
async def current_placement(
    session: Session, engine_group: Annotated[str, Query(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
) -> m.PlacementDetail:
    """The placement the group's engines run now (the last applied one)."""
    row = await applied_placement(session, engine_group)
    if row is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"group {engine_group} has no applied placement: it runs the default layout"
        )
    return await _detail(session, row)


@router.get("/placements/{placement_id}", response_model=m.PlacementDetail, tags=["placements"])
async def get_placement(session: Session, placement_id: Id) -> m.PlacementDetail:
    """One placement: its layout, the ordered moves from its predecessor, and its migration."""
    row = await session.get(Placement, placement_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no placement {placement_id}")
    return await _detail(session, row)


@router.get(
    "/placements/{placement_id}/expert-map",
    response_model=list[list[int]],
    tags=["placements"],
    responses={409: {"description": "no stored layout, or an empty slot vLLM cannot load"}},
)
async def placement_expert_map(session: Session, placement_id: Id) -> list[list[int]]:
    """The placement as vLLM's proposed `eplb_config.initial_expert_map_path` JSON (vLLM PR #49572): one
    physical→logical list per MoE layer, physical slots in EP-rank order (docs/vllm-agent.md)."""
    try:
        return await expert_map(session, placement_id)
    except ExpertMapUnavailable as exc:
        code = status.HTTP_404_NOT_FOUND if exc.missing else status.HTTP_409_CONFLICT
        raise HTTPException(code, str(exc)) from None


@router.post(
    "/placements/{placement_id}/reapply",
    response_model=m.PlacementSummary,
    status_code=status.HTTP_202_ACCEPTED,
    dependencies=[Writer],
    tags=["placements"],
    responses={401: {"description": "missing or wrong token"}, 403: {"description": "writes disabled"}},
)
async def reapply_placement(state: State, session: Session, placement_id: Id) -> m.PlacementSummary:
    """Roll back: publish a past placement's layout again as a new version (source `rollback`)."""
    past = await session.get(Placement, placement_id)
    if past is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no placement {placement_id}")
    if not past.details.get("layout_stored", True):
        raise HTTPException(status.HTTP_409_CONFLICT, f"placement {placement_id} was rejected and has no stored layout")
    layout = await load_layout(session, past)
    for attempt in range(3):  # the version may race with the placement service: take the next one
        try:
            async with state.sessions() as writer, writer.begin():
                applied = await applied_placement(writer, past.engine_group)
                base = await load_layout(writer, applied) if applied is not None else None
                moves = await asyncio.to_thread(moves_between, base, layout)
                plan = PlacementPlan(
                    plan_id=new_plan_id(),
                    version=await next_version(writer, past.engine_group),
                    engine_group=past.engine_group,
                    base_version=applied.version if applied is not None else None,
                    created_at=time.time(),
                    source="rollback",
                    gpus=list(past.gpus),
                    placement=layout,
                    moves=moves if moves is not None else np.zeros((0, 6), np.int32),
                    objective=ObjectiveTerms(terms=past.objective_terms, total=past.objective_total),
                    params=PlacementParams(weights=past.params),
                )
                row = await add_placement(
                    writer,
                    plan,
                    "proposed",
                    parent_id=applied.id if applied is not None else None,
                    details={"reapplied_from": past.id, "requested_via": "api"},
                )
            break
        except IntegrityError:
            if attempt == 2:
                raise HTTPException(status.HTTP_409_CONFLICT, "concurrent placements; try again") from None
    await publish_plan(state.bus, state.sessions, plan, row.id)  # if it fails, the placement service's outbox retries
    async with state.sessions() as reader:
        return _summary(await reader.get(Placement, row.id))


# ----- migrations -----


@router.get("/migrations", response_model=m.Page[m.MigrationSummary], tags=["migrations"])
async def list_migrations(
    session: Session,
    engine_group: Group = None,
    state: MigrationState | None = None,
    limit: Limit = 50,
    cursor: Cursor = None,
) -> m.Page[m.MigrationSummary]:
    """Migrations, newest first, with how many moves are in each state."""
    query = select(Migration)
    if engine_group is not None:
        query = query.where(Migration.engine_group == engine_group)
    if state is not None:
        query = query.where(Migration.state == state)
    rows, next_cursor = await _page(session, query, Migration.id, limit, cursor)
    counts = await _moves_by_state(session, [r.id for r in rows])
    return m.Page[m.MigrationSummary](items=[_migration(r, counts[r.id]) for r in rows], next_cursor=next_cursor)


@router.get("/migrations/{migration_id}", response_model=m.MigrationDetail, tags=["migrations"])
async def get_migration(session: Session, migration_id: Id) -> m.MigrationDetail:
    """One migration with every move (forward and rollback) and its state."""
    row = await session.get(Migration, migration_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no migration {migration_id}")
    query = select(MigrationMove).where(MigrationMove.migration_id == row.id).order_by(MigrationMove.seq)
    moves = [m.MigrationMoveOut.model_validate(mv) for mv in (await session.scalars(query)).all()]
    counts = (await _moves_by_state(session, [row.id]))[row.id]
    return m.MigrationDetail(**_migration(row, counts).model_dump(), moves=moves)


# ----- calibrations -----


@router.get("/calibrations", response_model=m.Page[m.CalibrationOut], tags=["calibrations"])
async def list_calibrations(
    session: Session,
    engine_group: Group = None,
    status_: Annotated[Literal["succeeded", "failed"] | None, Query(alias="status")] = None,
    limit: Limit = 50,
    cursor: Cursor = None,
) -> m.Page[m.CalibrationOut]:
    """Calibrations of the greedy's (α, β, γ), newest first (offline `switchyard calibrate` and API-triggered)."""
    query = select(Calibration)
    if engine_group is not None:
        query = query.where(Calibration.engine_group == engine_group)
    if status_ is not None:
        query = query.where(Calibration.status == status_)
    rows, next_cursor = await _page(session, query, Calibration.id, limit, cursor)
    return m.Page[m.CalibrationOut](items=[m.CalibrationOut.model_validate(r) for r in rows], next_cursor=next_cursor)


@router.post(
    "/calibrations",
    response_model=m.Accepted,
    status_code=status.HTTP_202_ACCEPTED,
    dependencies=[Writer],
    tags=["calibrations"],
    responses={401: {"description": "missing or wrong token"}, 403: {"description": "writes disabled"}},
)
async def trigger_calibration(state: State, body: m.CalibrationTrigger | None = None) -> m.Accepted:
    """Ask the placement service to calibrate on its current windows; the result appears in `/v1/calibrations`."""
    body = body or m.CalibrationTrigger()
    request = CalibrationRequest(
        request_id=uuid.uuid4().hex,
        requested_at=time.time(),
        engine_group=body.engine_group,
        time_limit_s=body.time_limit_s,
        layers=body.layers,
    )
    subject = state.bus.subjects.calibration_request
    try:
        await state.bus.js_publish(subject, request, msg_id=request.request_id)
    except Exception as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"cannot queue the calibration: {exc}") from None
    return m.Accepted(
        request_id=request.request_id,
        detail=f"queued on {subject}; the placement service records the result in /v1/calibrations "
        f"with details.request_id = {request.request_id}",
    )
