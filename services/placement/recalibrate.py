"""Calibration on demand: the placement service answers `sy.placement.calibrate` (the API's `POST /v1/calibrations`).

It calibrates the greedy's (α, β, γ) against the MINLP on the windows it holds right now (each group's
decayed load, with the group's applied placement as x⁰), using the offline job's code (`services.calibration`,
`switchyard calibrate`), and appends the result to `calibrations` with the request id in its details. The
next planning run picks the new weights up. A request that cannot be served (no window yet, an infeasible
instance) is recorded as a `failed` row saying why, so the operator who asked sees the answer either way.
Requests come through a durable JetStream consumer and are acknowledged after their row is written, so a
restart mid-calibration runs it again rather than losing it; a request whose row already exists (a
redelivery) is acknowledged without running again. One request runs for at most `calibration_budget_s`:
the per-layer time limit shrinks to fit the number of layer solves. Stopping the service cancels a
running calibration before its next layer and leaves the request for the next start.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, replace

from nats.errors import TimeoutError as NatsTimeoutError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from switchyard.services.calibration import Window, calibration_row, run_calibration
from switchyard.services.fleet_view import FleetView
from switchyard.services.history import applied_placement, calibrated_params, load_layout
from switchyard.services.runtime import FETCH_WHILE_NATS_RECOVERS, decode_stream_message
from switchyard.shared.bus import Bus
from switchyard.shared.db import Calibration
from switchyard.shared.schemas import CalibrationRequest
from switchyard.solver.placement import MinlpCancelled, MinlpOptions, PlacementError
from switchyard.solver.placement.calibrate import REFERENCE_SOLVES
from switchyard.solver.placement.policy import Policy
from switchyard.solver.placement.window import DecayedLoad

log = logging.getLogger(__name__)
#: Deliveries of one request (crashes, database outages; a shutdown's cancellation counts too).
MAX_DELIVER = 5


@dataclass(frozen=True)
class CalibrationContext:
    """What serving calibration requests takes from the placement service, and all it takes.

    `windows` is the service's own map of decayed windows (read, never written, at each request); `fleet`
    gives each group's GPUs and DP ranks; `policy` the migration cost and objective weights to calibrate for.
    """

    bus: Bus
    sessions: async_sessionmaker[AsyncSession]
    fleet: FleetView
    windows: Mapping[str, DecayedLoad]
    policy: Policy
    #: The longest one request may run (`PlacementSettings.calibration_budget_s`).
    budget_s: float


async def serve_calibration_requests(context: CalibrationContext, stop: asyncio.Event) -> None:
    """Run calibration requests one at a time until `stop` is set."""
    bus = context.bus
    subject = bus.subjects.calibration_request
    # ack_wait above the longest calibration (its budget), so a running one is never handed out twice
    ack_wait = context.budget_s + 60.0
    consumer = await bus.durable_pull(bus.subjects.calibration_requests, ack_wait=ack_wait, max_deliver=MAX_DELIVER)
    try:
        while not stop.is_set():
            try:
                messages = await consumer.fetch(1, timeout=0.5)
            except (NatsTimeoutError, TimeoutError):
                continue
            except FETCH_WHILE_NATS_RECOVERS as exc:  # a fetch in flight across a NATS restart
                log.debug("fetching calibration requests failed while NATS recovers: %r", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in messages:
                request = await decode_stream_message(msg, CalibrationRequest, subject, bus.max_payload)
                if request is None:
                    continue
                try:
                    if await _recorded(context, request.request_id):
                        log.info("calibration request %s was already answered; not run again", request.request_id)
                    else:
                        cancel = threading.Event()
                        await _cancellable(calibrate(context, request, cancel), cancel, stop)
                except MinlpCancelled:
                    log.info("calibration request %s cancelled by shutdown; it runs again on start", request.request_id)
                    await msg.nak()
                    return
                except Exception:  # e.g. the database is down: JetStream redelivers it (at most 3 times)
                    log.exception("calibration request %s failed unexpectedly", request.request_id)
                    await msg.nak(delay=5.0)
                    continue
                await msg.ack()
    finally:
        await consumer.unsubscribe()


async def _cancellable(work: Awaitable[int], cancel: threading.Event, stop: asyncio.Event) -> int:
    """Run `work`, setting `cancel` (seen by the solver threads) as soon as `stop` is set."""
    watcher = asyncio.create_task(stop.wait())
    watcher.add_done_callback(lambda _: cancel.set())
    try:
        return await work
    finally:
        watcher.cancel()


async def _recorded(context: CalibrationContext, request_id: str) -> bool:
    async with context.sessions() as session:
        query = select(Calibration.id).where(Calibration.details["request_id"].as_string() == request_id)
        return (await session.scalar(query.limit(1))) is not None


def per_layer_limit(requested_s: float, budget_s: float, layer_solves: int, parallel: int) -> float:
    """The per-layer time limit that keeps `layer_solves` solves, `parallel` at a time, within `budget_s`."""
    rounds = max(1, -(-layer_solves // parallel))
    return min(requested_s, budget_s / rounds)


async def _windows(context: CalibrationContext, request: CalibrationRequest) -> tuple[list[Window], int, list[str]]:
    """The groups' decayed windows as calibration windows, the GPU count most of them share, and why not others."""
    groups = [request.engine_group] if request.engine_group else sorted(context.windows)
    windows: list[tuple[Window, int]] = []
    skipped: list[str] = []
    for group in groups:
        decayed = context.windows.get(group)
        if decayed is None or decayed.load is None:
            skipped.append(f"no expert-load window for {group} yet")
            continue
        async with context.sessions() as session:
            applied = await applied_placement(session, group)
            current = await load_layout(session, applied) if applied is not None else None
        topology = context.fleet.topology(group, list(applied.gpus) if applied is not None else None)
        if topology is None:
            skipped.append(f"no engine of {group} has said hello yet (its GPUs are unknown)")
            continue
        counts = decayed.source_load if decayed.source_load is not None else decayed.load[:, None, :]
        name = f"{group}@{decayed.end:.0f}"
        windows.append((Window(name=name, source_counts=counts, placement=current), len(topology[0])))
    if not windows:
        return [], 0, skipped
    gpus = Counter(count for _, count in windows).most_common(1)[0][0]
    skipped += [f"{w.name} has {count} GPUs, not {gpus}" for w, count in windows if count != gpus]
    return [w for w, count in windows if count == gpus], gpus, skipped


async def calibrate(
    context: CalibrationContext, request: CalibrationRequest, cancel: threading.Event | None = None
) -> int:
    """Calibrate for one request and record the outcome; returns the `calibrations` row id.

    Raises `MinlpCancelled` (and records nothing) when `cancel` is set mid-way.
    """
    started = time.perf_counter()
    windows, gpus, skipped = await _windows(context, request)
    layers = min(request.layers or 2**31, *(w.source_counts.shape[0] for w in windows)) if windows else 0
    budget = context.budget_s
    options = MinlpOptions(cancel=cancel)
    solves = REFERENCE_SOLVES * len(windows) * layers  # calibrate solves each window's MINLP twice
    limit = per_layer_limit(request.time_limit_s, budget, solves, options.parallel_layers)
    extra = {
        "request_id": request.request_id,
        "trigger": "api",
        "windows": [w.name for w in windows],
        "skipped": skipped,
        "time_limit_s": limit,
        "budget_s": budget,
    }
    try:
        if not windows:
            raise PlacementError("nothing to calibrate on: " + ("; ".join(skipped) or "no expert-load window yet"))
        result = await asyncio.to_thread(
            run_calibration,
            windows,
            gpus,
            replace(options, time_limit_s=limit),
            migration_cost=context.policy.migration_cost,
            weights=context.policy.weights,
            layers=request.layers,
        )
        async with context.sessions() as session, session.begin():
            row = calibration_row(result, engine_group=request.engine_group, extra=extra)
            session.add(row)
            await session.flush()
        log.info("calibration %d for request %s: agreement %.3f", row.id, request.request_id, result.agreement)
        return row.id
    except MinlpCancelled:
        raise
    except PlacementError as exc:
        log.warning("calibration request %s failed: %s", request.request_id, exc)
        async with context.sessions() as session, session.begin():
            params, _ = await calibrated_params(session, request.engine_group or "")
            row = Calibration(
                engine_group=request.engine_group,
                status="failed",
                params=params.as_map(),
                agreement=0.0,
                comm_gap=0.0,
                solve_seconds=time.perf_counter() - started,
                num_windows=len(windows),
                details={**extra, "error": str(exc)},
            )
            session.add(row)
            await session.flush()
            return row.id
