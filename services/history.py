"""Placement history rows: written by the placement service, the migration service and the API alike
(and the calibration in force, read from the `calibrations` rows).

A placement's layout is stored as `placement_assignments` rows (one per layer, GPU and slot); its status
moves `proposed → published → applied → superseded`, or ends `rejected` (not worth migrating), `failed`
(its migration failed or was rolled back) or `superseded` (refused as stale). At most one placement per
group is `applied`: the layout the group's engines run now.
"""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime
from typing import Any

import numpy as np
from sqlalchemy import func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from switchyard.shared.bus import Bus
from switchyard.shared.db import Calibration, Placement, PlacementAssignment
from switchyard.shared.schemas import ObjectiveTerms, PlacementParams, PlacementPlan
from switchyard.solver.placement import DEFAULT_PARAMS, GreedyParams, PlacementError
from switchyard.solver.placement.moves import plan_moves

log = logging.getLogger(__name__)

#: Migration states that are not final: the group's placement is still being moved (or rolled back).
UNFINISHED_MIGRATION = ("pending", "running", "rolling_back")


def layout_rows(layout: np.ndarray) -> list[dict[str, int]]:
    """`placement_assignments` rows for a slot map `[L, G, slots]` (empty slots included, so the shape round-trips)."""
    layers, gpus, slots = np.indices(layout.shape).reshape(3, -1)
    return [
        {"layer": int(layer), "gpu": int(gpu), "slot": int(slot), "expert": int(expert)}
        for layer, gpu, slot, expert in zip(layers, gpus, slots, layout.reshape(-1), strict=True)
    ]


def layout_from_rows(rows: list[tuple[int, int, int, int]], shape: tuple[int, int, int]) -> np.ndarray:
    """Rebuild a slot map from `(layer, gpu, slot, expert)` rows; slots without a row are empty."""
    layout = np.full(shape, -1, dtype=np.int32)
    if rows:
        index = np.array(rows, dtype=np.int64)
        layout[index[:, 0], index[:, 1], index[:, 2]] = index[:, 3]
    return layout


def moves_between(before: np.ndarray | None, after: np.ndarray) -> np.ndarray | None:
    """The ordered moves from `before` to `after` (`solver.placement.moves`), or None when there is no
    `before` or the two are incomparable (another shape, an expert missing). Up to ~0.1 s at 48 x 128 x 8:
    async callers run it in a thread."""
    if before is None or before.shape != after.shape:
        return None
    try:
        return plan_moves(before, after, buffer=True).astype(np.int32)
    except (PlacementError, ValueError):
        return None


def to_datetime(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def new_plan_id() -> str:
    return uuid.uuid4().hex


async def next_version(session: AsyncSession, engine_group: str) -> int:
    """One more than the group's highest version (rejected plans included, so versions never repeat)."""
    latest = await session.scalar(select(func.max(Placement.version)).where(Placement.engine_group == engine_group))
    return (latest or 0) + 1


async def applied_placement(session: AsyncSession, engine_group: str) -> Placement | None:
    """The placement the group runs now, or None while it still runs the default layout."""
    query = (
        select(Placement)
        .where(Placement.engine_group == engine_group, Placement.status == "applied")
        .order_by(Placement.version.desc())
        .limit(1)
    )
    return await session.scalar(query)


async def calibrated_params(session: AsyncSession, engine_group: str) -> tuple[GreedyParams, int | None]:
    """The greedy weights in force for a group: the latest successful calibration for it (or for all groups),
    and that calibration's id; the defaults (and None) when there is none or it is unusable."""
    query = (
        select(Calibration)
        .where(
            Calibration.status == "succeeded",
            or_(Calibration.engine_group == engine_group, Calibration.engine_group.is_(None)),
        )
        .order_by(Calibration.created_at.desc(), Calibration.id.desc())
        .limit(1)
    )
    calibration = await session.scalar(query)
    if calibration is None:
        return DEFAULT_PARAMS, None
    try:
        return GreedyParams.from_map(calibration.params), calibration.id
    except PlacementError as exc:
        log.warning("calibration %d unusable (%s); using defaults", calibration.id, exc)
        return DEFAULT_PARAMS, None


async def load_layout(session: AsyncSession, placement: Placement) -> np.ndarray:
    a = PlacementAssignment
    rows = await session.execute(select(a.layer, a.gpu, a.slot, a.expert).where(a.placement_id == placement.id))
    shape = (placement.num_layers, placement.num_gpus, placement.slots_per_gpu)
    return layout_from_rows([tuple(r) for r in rows], shape)


async def add_placement(
    session: AsyncSession,
    plan: PlacementPlan,
    status: str,
    *,
    parent_id: int | None = None,
    window: tuple[float, float] | None = None,
    details: dict[str, Any] | None = None,
    store_layout: bool = True,
    predicted: tuple[float, float] | None = None,
) -> Placement:
    """Insert a placement row for `plan` (and its assignments unless `store_layout` is False); flushes.

    `predicted`: the step time its layout should save and its migration cost (s), in the same transaction."""
    num_layers, num_gpus, slots = plan.placement.shape
    row = Placement(
        plan_id=plan.plan_id,
        engine_group=plan.engine_group,
        version=plan.version,
        base_version=plan.base_version,
        parent_id=parent_id,
        created_at=to_datetime(plan.created_at),
        source=plan.source,
        status=status,
        params=dict(plan.params.weights),
        objective_terms=dict(plan.objective.terms),
        objective_total=plan.objective.total,
        predicted_gain=plan.predicted_gain,
        window_start=to_datetime(window[0]) if window else None,
        window_end=to_datetime(window[1]) if window else None,
        num_layers=num_layers,
        num_gpus=num_gpus,
        slots_per_gpu=slots,
        gpus=list(plan.gpus),
        details={**(details or {}), "layout_stored": store_layout},
        predicted_saving_s=predicted[0] if predicted is not None else None,
        predicted_cost_s=predicted[1] if predicted is not None else None,
    )
    session.add(row)
    await session.flush()
    if store_layout:
        await session.execute(
            insert(PlacementAssignment), [{"placement_id": row.id, **r} for r in layout_rows(plan.placement)]
        )
    return row


def plan_message(placement: Placement, layout: np.ndarray, moves: np.ndarray) -> PlacementPlan:
    """The wire form of a stored placement (for re-publishing it)."""
    return PlacementPlan(
        plan_id=placement.plan_id,
        version=placement.version,
        engine_group=placement.engine_group,
        base_version=placement.base_version,
        created_at=placement.created_at.timestamp(),
        source=placement.source,  # type: ignore[arg-type]
        gpus=list(placement.gpus),
        placement=layout.astype(np.int32),
        moves=moves.astype(np.int32),
        objective=ObjectiveTerms(terms=placement.objective_terms, total=placement.objective_total),
        params=PlacementParams(weights=placement.params),
        predicted_gain=placement.predicted_gain,
    )


async def set_status(session: AsyncSession, placement_id: int, status: str, *, only_if: tuple[str, ...] = ()) -> None:
    """Change a placement's status; with `only_if`, only from those statuses (so a late writer never undoes)."""
    query = update(Placement).where(Placement.id == placement_id)
    if only_if:
        query = query.where(Placement.status.in_(only_if))
    await session.execute(query.values(status=status))


async def publish_plan(
    bus: Bus, sessions: async_sessionmaker[AsyncSession], plan: PlacementPlan, placement_id: int
) -> bool:
    """Publish a stored `proposed` plan (msg-id = plan id) and mark it `published`; False if the bus refused.

    The outbox half of "store, then publish": a plan that could not be published stays `proposed`, and the
    placement service republishes every `proposed` row each tick (the stream de-duplicates by plan id).
    """
    try:
        await bus.js_publish(bus.subjects.placement_plan, plan, msg_id=plan.plan_id)
    except Exception as exc:
        log.warning("plan %s not published yet (%s); it stays proposed and is retried", plan.plan_id, exc)
        return False
    async with sessions() as session, session.begin():
        await set_status(session, placement_id, "published", only_if=("proposed",))
    return True
