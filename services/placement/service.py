"""The placement service: expert-load windows in, versioned placement plans out, every decision in the database.

- **Load**: an ordered JetStream consumer on `sy.engine.*.expert_load`, started `warmup_s` back in the stream,
  so a restart rebuilds the same decayed window per engine group (`window.DecayedLoad`) instead of starting
  cold (`ingest.ExpertLoadIngest`). Planning waits until that replay has caught up.
- **Groups**: the unit of placement is the EP group (`ExpertLoad.ep_group`). In an xPyD fleet each decoder is
  its own EP group, so each decoder gets a placement from its own load alone (ELDR §7).
- **Triggers**: a group is planned when it has never been planned by this process, every `period_s`, or
  early when its load distribution drifts by `drift_threshold` (at most every `min_interval_s`), and never
  while its last published plan is still being migrated (the rule: `solver.placement.policy.trigger`).
- **Decision**: `decide.decide` (`solver.placement.policy`) runs the solver's greedy from the group's current
  layout (what its engines report, else the last `applied` placement, else vLLM's contiguous default:
  `solver.placement.layouts`, the rule the migration service follows too) with the latest calibrated (α, β, γ),
  and publishes only a migration that pays in step time (`solver.placement.payoff`, priced with the simulator's
  physics: `placement.payoff`). Both predictions go into the plan's row; the saving measured on the windows
  after a published plan is written to its row when the group is next planned (kept in memory until then: a
  restart skips that one measurement, never a plan or a row).
- **Outbox**: a plan worth publishing is stored `proposed` (with its layout), then published to JetStream with
  msg-id = plan_id, then marked `published`; each tick republishes `proposed` rows (also the API's
  rollbacks), so a crash between the two never loses a plan. Rejected plans are stored `rejected` with
  their terms, parameters and reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import timedelta
from typing import Any

import numpy as np
from prometheus_client import Counter, Histogram
from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from switchyard.services.fleet_view import FleetView
from switchyard.services.history import (
    UNFINISHED_MIGRATION,
    add_placement,
    calibrated_params,
    load_layout,
    moves_between,
    new_plan_id,
    next_version,
    plan_message,
    publish_plan,
)
from switchyard.services.layout import GroupShape, LayoutProbe, layout_now, recorded
from switchyard.services.lease import GroupLeases
from switchyard.services.placement.engine_registry import EngineRegistry
from switchyard.services.placement.ingest import ExpertLoadIngest
from switchyard.services.placement.payoff import model_spec, step_context
from switchyard.services.placement.recalibrate import CalibrationContext, serve_calibration_requests
from switchyard.services.placement.settings import PlacementSettings
from switchyard.services.runtime import ensure_schema, metrics_endpoint, supervised
from switchyard.shared.bus import Bus
from switchyard.shared.db import Migration, Placement, create_async_db
from switchyard.shared.db.types import utcnow
from switchyard.shared.schemas import ObjectiveTerms, PlacementParams, PlacementPlan
from switchyard.shared.settings import SwitchyardSettings
from switchyard.simulator.core.physics import get_gpu
from switchyard.solver.placement import GreedyParams, PlacementError, Weights
from switchyard.solver.placement.payoff import StepContext, saving_per_step
from switchyard.solver.placement.policy import Decision, Policy, TriggerRule, decide, trigger
from switchyard.solver.placement.step_time import origin_matrix
from switchyard.solver.placement.window import DecayedLoad

log = logging.getLogger(__name__)

PLANS = Counter("switchyard_placement_plans_total", "Placement decisions, by outcome.", ["outcome"])
RUN_SECONDS = Histogram("switchyard_placement_run_seconds", "Time to plan one group (greedy + decision).")
PRUNE_EVERY_S = 3600.0
NO_MOVES = np.zeros((0, 6), np.int32)


class PlacementService:
    """Start with `await service.run(stop)`; `plan_group` runs one decision on demand (tests, operators)."""

    def __init__(self, settings: SwitchyardSettings, config: PlacementSettings | None = None) -> None:
        self.settings = settings
        self.config = config or PlacementSettings()
        self.policy = Policy(
            gain_threshold=self.config.gain_threshold,
            migration_cost=self.config.migration_cost,
            redundant_slots=self.config.redundant_slots,
            weights=Weights(self.config.objective_weights()),
            stage_bytes=self.config.stage_bytes,
        )
        model_spec(self.config.step_model, self.config)  # a misnamed preset fails at start, not at the first plan
        get_gpu(self.config.gpu)
        self.fleet = FleetView(manifest=settings.engine_manifest_entries())
        self.layouts: LayoutProbe | None = None  # set once connected
        self.registry: EngineRegistry | None = None  # set once connected
        self.leases: GroupLeases | None = None  # set once connected; None (tests driving plan_group): no lease
        self.ingest: Bus | None = None  # hellos and expert load, on a connection of their own (set once connected)
        #: The decayed expert load of every group, and whether its replay has caught up.
        self.expert_load = ExpertLoadIngest(self.config, self.fleet)
        self._last_run: dict[str, tuple[float, np.ndarray | None]] = {}
        #: Groups whose last published plan was a prefix of its target: the rest is planned next ("continue").
        self._unfinished: set[str] = set()
        #: Groups whose last plan would have paid but for the requests waiting: asked again soon.
        self._deferred: set[str] = set()
        #: Published plans awaiting their measured saving: group -> (row id, layout before, after, duration).
        self._checks: dict[str, tuple[int, np.ndarray, np.ndarray, float]] = {}
        self._static_groups: set[str] = set()
        self._last_prune = -PRUNE_EVERY_S

    @property
    def windows(self) -> dict[str, DecayedLoad]:
        """Each group's decayed expert load (`ExpertLoadIngest.windows`)."""
        return self.expert_load.windows

    @property
    def caught_up(self) -> asyncio.Event:
        """Set once the expert-load replay has been processed (`ExpertLoadIngest.caught_up`)."""
        return self.expert_load.caught_up

    # ----- lifecycle -----

    async def run(self, stop: asyncio.Event) -> None:
        database_url = self.settings.resolved_database_url()
        await ensure_schema(database_url)
        engine, self.sessions = create_async_db(database_url)
        self.bus = bus = await Bus.connect(self.settings, name="switchyard-placement", role="placement")
        # Engine ingest (hellos, expert-load windows: wildcard subjects any engine publishes on) has a connection
        # of its own: a flood there can make the server cut it off as a slow consumer, never the one that
        # publishes plans, asks layouts and holds the leases.
        self.ingest = ingest = await Bus.connect(self.settings, name="switchyard-placement-ingest", role="placement")
        try:
            with metrics_endpoint(self.config.metrics_port, self.config.metrics_host):
                await bus.ensure_streams()
                self.registry = EngineRegistry(self.sessions, self.config.engine_retention_s)
                # Hellos say who is alive and owns which GPUs, and keep the engines table: one subscription for both
                await self.fleet.subscribe(ingest, also=self.registry.on_hello)
                self.layouts = LayoutProbe(bus, self.fleet, self.config.layout_timeout_s)
                self.leases = GroupLeases(bus, "placement", self.config.replica_id, self.config.lease_ttl_s)
                await self.leases.start()
                await self.expert_load.follow(bus, ingest)
                context = CalibrationContext(
                    bus, self.sessions, self.fleet, self.windows, self.policy, self.config.calibration_budget_s
                )
                calibrations = asyncio.create_task(
                    supervised("calibration requests", lambda: serve_calibration_requests(context, stop)),
                    name="calibrations",
                )
                log.info("placement service ready (period %.0f s)", self.config.period_s)
                while not stop.is_set():
                    try:
                        await self.tick()
                    except Exception:  # e.g. the database is briefly down: everything is durable, tick again
                        log.exception("placement tick failed; trying again in %.0f s", self.config.tick_s)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.config.tick_s)
                await calibrations
        finally:
            if self.leases is not None:
                with contextlib.suppress(Exception):
                    await self.leases.release_all()
            if self.registry is not None:
                await self.registry.close()
            await ingest.close()
            await bus.close()
            await engine.dispose()

    # ----- triggers -----

    async def tick(self) -> None:
        if self.leases is not None:
            # A group is planned every `period_s` (30 s) but its lease lives `lease_ttl_s` (10 s): renew held
            # leases every tick, or each would lapse between plans and the next plan find it "lost".
            await self.leases.renew()
        await self.republish_proposed()
        if self.registry is not None:
            await self.registry.prune()
        await self.prune_rejected()
        if not self.caught_up.is_set():
            return
        for group in self.expert_load.drop_orphans(time.monotonic()):
            self._last_run.pop(group, None)
        for group in list(self.windows):
            trigger = self._trigger(group)
            if trigger is not None and self.leases is not None and not await self.leases.acquire(group):
                continue  # another replica plans this group (one owner per group)
            if trigger is not None:
                try:
                    await self.plan_group(group, trigger)
                except Exception:  # one group's trouble never stops the others
                    PLANS.labels("error").inc()
                    log.exception("planning group %s failed", group)

    async def prune_rejected(self, now: float | None = None) -> int:
        """Delete `rejected` decisions past their retention, at most once per `PRUNE_EVERY_S`; returns how many.

        A rejected decision is written every period per group, so unpruned they would outgrow the history that
        matters. A group's newest row is always kept, so versions never repeat.
        """
        now = time.monotonic() if now is None else now
        if self.config.rejected_retention_s == 0 or now - self._last_prune < PRUNE_EVERY_S:
            return 0
        self._last_prune = now
        cutoff = utcnow() - timedelta(seconds=self.config.rejected_retention_s)
        newest = select(func.max(Placement.id)).group_by(Placement.engine_group)
        async with self.sessions() as session, session.begin():
            result = await session.execute(
                delete(Placement).where(
                    Placement.status == "rejected", Placement.created_at < cutoff, Placement.id.not_in(newest)
                )
            )
        pruned = int(result.rowcount or 0)  # type: ignore[attr-defined]
        if pruned:
            retention = self.config.rejected_retention_s
            log.info("pruned %d rejected placement decisions older than %.0f s", pruned, retention)
        return pruned

    def _trigger(self, group: str) -> str | None:
        """The rule lives in the solver (`policy.trigger`): the simulated placement loop triggers by it too."""
        rule = TriggerRule(self.config.period_s, self.config.drift_threshold, self.config.min_interval_s)
        last, unfinished, deferred = self._last_run.get(group), group in self._unfinished, group in self._deferred
        return trigger(rule, time.monotonic(), last, self.windows[group].distribution(), unfinished, deferred)

    # ----- planning -----

    async def _in_flight(self, session: AsyncSession, group: str) -> bool:
        """Whether the group's last plan is unresolved: placing it again now would race its migration.

        A migration the migration service has taken up blocks the group until it is final, however long that
        takes: a standby replica takes over one whose owner died (`services/migration/takeover.py`) and marks
        the placement applied or failed in the transaction that finishes it, so the group is free the tick
        after. Before, any plan older than `inflight_timeout_s` (600 s) stopped blocking, unfinished migration or
        not. That timeout now covers only plans no migration replica has recorded yet (never delivered).
        """
        unfinished = select(Migration.id).where(
            Migration.engine_group == group, Migration.state.in_(UNFINISHED_MIGRATION)
        )
        if (await session.scalar(unfinished.limit(1))) is not None:
            return True
        recent = utcnow() - timedelta(seconds=self.config.inflight_timeout_s)
        query = select(Placement.id).where(
            Placement.engine_group == group,
            Placement.status.in_(("proposed", "published")),
            Placement.created_at > recent,
        )
        return (await session.scalar(query.limit(1))) is not None

    def _migrates(self, group: str) -> bool:
        """Whether the group's coordinator applies migrate steps (its hello says so); says once when not."""
        live = self.fleet.group(group)
        if not live or live[0].hello is None or live[0].hello.migrates:
            return True
        if group not in self._static_groups:
            self._static_groups.add(group)
            log.info("group %s: its engines do not move experts (%s agent); not planned", group, live[0].hello.agent)
        return False

    async def plan_group(self, group: str, trigger: str) -> Placement | None:
        """Run the greedy for one group and persist (and maybe publish) the plan; None if it cannot plan now."""
        window = self.windows.get(group)
        if window is None or window.load is None:
            return None
        async with self.sessions() as session:
            if await self._in_flight(session, group):
                return None
            record = await recorded(session, group)
            params, calibration_id = await calibrated_params(session, group)
        applied = record.applied
        topology = self.fleet.topology(group, list(applied.gpus) if applied is not None else None)
        if topology is None:
            log.info("group %s: no live engine has said hello; cannot place its experts", group)
            return None
        gpus, ranks = topology
        if not self.fleet.group(group):  # its stored GPUs outlive its engines: nobody to move experts on
            return None
        if not self._migrates(group):
            return None
        num_layers, num_experts = window.load.shape
        reported = await self.layouts.live_layout(group) if self.layouts is not None else None
        slots = -(-(num_experts + self.config.redundant_slots) // len(gpus))
        shape = GroupShape(num_layers, num_experts, len(gpus), slots)
        current, current_from, _ = layout_now(reported, record, shape)
        if current.shape[0] != num_layers or len(gpus) != current.shape[1]:
            log.warning(
                "group %s: load is %s but its placement is %s; skipped", group, window.load.shape, current.shape
            )
            return None
        step = step_context(
            self.config, self.fleet.group(group), window.span_s, first=applied is None, persistence=window.persistence
        )
        await self._measure(group, window, ranks, step)
        started = time.perf_counter()
        try:
            decision = await asyncio.to_thread(
                decide, window.load, window.source_load, ranks, current, params, self.policy, None, step
            )
        except PlacementError as exc:
            PLANS.labels("error").inc()
            log.warning("group %s: the greedy cannot place this window: %s", group, exc)
            self._last_run[group] = (time.monotonic(), window.distribution())
            return None
        RUN_SECONDS.observe(time.perf_counter() - started)
        self._last_run[group] = (time.monotonic(), window.distribution())
        details = {"trigger": trigger, "current_from": current_from}
        if decision.deferred:  # asked again after min_interval_s, not at the next period or drift
            self._deferred.add(group)
        else:
            self._deferred.discard(group)
        if not decision.publish and (repeated := await self._coalesce_rejected(group, applied, decision)) is not None:
            PLANS.labels("rejected").inc()
            return repeated
        row, plan = await self._store(group, details, window, applied, gpus, params, calibration_id, decision)
        PLANS.labels("published" if decision.publish else "rejected").inc()
        log.info("group %s v%d (%s): %s", group, row.version, trigger, decision.reason)
        self._unfinished.discard(group)
        if decision.publish:
            if decision.partial:
                self._unfinished.add(group)
            if decision.payoff is not None:  # measure its saving on the windows that come after it
                self._checks[group] = (row.id, current, decision.placement, decision.payoff.duration_s)
                window.mark(time.time())
            await publish_plan(self.bus, self.sessions, plan, row.id)
        return row

    async def _measure(
        self, group: str, window: DecayedLoad, ranks: list[int | None], step: StepContext | None
    ) -> None:
        """Write the saving of the group's last published plan, measured on the windows since it, to its row."""
        check = self._checks.get(group)
        if check is None or step is None or window.recent is None or window.recent_span_s <= 0:
            return
        placement_id, before, after, duration = self._checks.pop(group)
        sources = window.recent_sources if any(r is not None for r in ranks) else None
        counts = sources if sources is not None else window.recent[:, None, :]
        origin = origin_matrix(counts.shape[1], ranks if sources is not None else [None] * before.shape[1])
        seen = StepContext(
            step.cost, step.price, step.step_s, step.horizon_s, window.recent_span_s, step.first, step.margin
        )
        saving = await asyncio.to_thread(saving_per_step, counts, origin, before, after, seen)
        measured = saving * max(step.horizon_s - duration, 0.0) / step.step_s
        async with self.sessions() as session, session.begin():
            row = await session.get(Placement, placement_id)
            if row is not None:
                row.measured_saving_s = measured

    async def _coalesce_rejected(self, group: str, applied: Placement | None, decision: Decision) -> Placement | None:
        """Count a rejected decision into the group's newest row when that is a rejection from the same base:
        one row per unchanged situation instead of one per period (2,834 rows an hour across idle groups)."""
        base = applied.version if applied is not None else None
        async with self.sessions() as session, session.begin():
            newest = await session.scalar(
                select(Placement).where(Placement.engine_group == group).order_by(Placement.id.desc()).limit(1)
            )
            if newest is None or newest.status != "rejected" or newest.base_version != base:
                return None
            details = dict(newest.details or {})
            details["repeats"] = int(details.get("repeats", 0)) + 1
            details["last_decision"] = decision.reason
            details["last_at"] = utcnow().isoformat()
            newest.details = details
            return newest

    async def _store(
        self,
        group: str,
        details: dict[str, Any],
        window: DecayedLoad,
        applied: Placement | None,
        gpus: list[str],
        params: GreedyParams,
        calibration_id: int | None,
        decision: Decision,
    ) -> tuple[Placement, PlacementPlan]:
        details = {
            **details,
            "decision": decision.reason,
            "improvement": decision.improvement,
            "migration_cost": decision.cost,
            "threshold": decision.threshold,
            "current_objective": decision.current,
            "num_moves": len(decision.moves),
            "calibration_id": calibration_id,
            "weights": dict(self.policy.weights),
            "migration_cost_per_host": self.policy.migration_cost,
            "gain_threshold": self.policy.gain_threshold,
            "half_life_s": self.config.half_life_s,
            "windows": window.windows,
            "engines": sorted(window.engines),
            "roles": sorted({s.hello.role for s in self.fleet.group(group, live_only=False) if s.hello}),
            "source_aware": window.source_load is not None,
            "payoff": decision.payoff.as_dict() if decision.payoff is not None else None,
            "payoff_margin": self.config.payoff_margin,
            "partial": decision.partial,
        }
        predicted = (decision.payoff.gain_s, decision.payoff.cost_s) if decision.payoff is not None else None
        for attempt in range(3):  # versions race with the API's rollbacks: take the next one and retry
            try:
                async with self.sessions() as session, session.begin():
                    plan = PlacementPlan(
                        plan_id=new_plan_id(),
                        version=await next_version(session, group),
                        engine_group=group,
                        base_version=applied.version if applied is not None else None,
                        created_at=time.time(),
                        source="greedy",
                        gpus=gpus,
                        placement=decision.placement,
                        moves=decision.moves,
                        objective=ObjectiveTerms.from_flat(decision.new),
                        params=PlacementParams(weights=params.as_map()),
                        predicted_gain=decision.improvement,
                    )
                    row = await add_placement(
                        session,
                        plan,
                        "proposed" if decision.publish else "rejected",
                        parent_id=applied.id if applied is not None else None,
                        window=(window.start or 0.0, window.end or 0.0),
                        details=details,
                        store_layout=decision.publish or self.config.store_rejected_layouts,
                        predicted=predicted,
                    )
                    return row, plan
            except IntegrityError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def republish_proposed(self) -> None:
        """Publish every stored plan still `proposed` (idempotent: the stream de-duplicates by plan_id)."""
        async with self.sessions() as session:
            rows = (await session.scalars(select(Placement).where(Placement.status == "proposed"))).all()
            plans = []
            for row in rows:
                layout = await load_layout(session, row)
                parent = await session.get(Placement, row.parent_id) if row.parent_id else None
                before = await load_layout(session, parent) if parent is not None else None
                moves = await asyncio.to_thread(moves_between, before, layout)
                plans.append((row.id, plan_message(row, layout, NO_MOVES if moves is None else moves)))
        for placement_id, plan in plans:
            await publish_plan(self.bus, self.sessions, plan, placement_id)


async def run_placement(
    settings: SwitchyardSettings, stop: asyncio.Event, config: PlacementSettings | None = None
) -> None:
    """Run the placement service until `stop` is set."""
    await PlacementService(settings, config).run(stop)
