"""Simulated expert migration and expert-load reporting for the simulated engines.

- `SimExpertGroup` models the expert slots of one EP group. It changes only through `MigrateRequest`
  steps: a step's moves are checked and executed in order with the meaning `solver.placement.moves` gives
  them (one scratch slot per GPU as the rearrangement buffer), all or nothing, after the time the seed
  measured, and exactly once per `(plan_id, step)`: a retried or resumed step gets the first answer again.
  Every application is recorded, so tests can prove that no move was applied twice or lost.
- `serve_migrate` mounts it on `sy.engine.<id>.migrate` and `sy.engine.<id>.layout` for one engine: a real
  protocol peer over NATS. The layout query lets the control plane plan from what the engines really run
  (after a restart they run their boot layout again, whatever the database remembers).
- `expert_load_counts` / `ExpertLoadWindow` (re-exported from the engine-agent core, `engine_agents.core`) turn
  a batch's token→expert selections, with the source DP rank of each token, into the `A[L, S, E]` / `B[L, E]`
  windows of an `ExpertLoad` message.

Cost model (Gimbal, seed 003: 1.08 s for the first rearrangement, 0.72 s for later ones): a rearrangement
of every layer costs `later_s`, spread evenly over layers, so each step (one layer) costs `later_s / L`; the
very first step a group ever applies also pays the one-off `first_s - later_s` (buffer allocation and
warm-up). While a step is in flight the engines run `slowdown` times slower: weight transfers share HBM and
interconnect bandwidth with the all-to-all. `time_scale` maps simulated seconds to wall seconds (0: instant),
so tests never wait real seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from nats.aio.subscription import Subscription

from switchyard.engine_agents.core.expert_load import ExpertLoadWindow, expert_load_counts
from switchyard.engine_agents.core.layout import check_group, serve_expert_slots
from switchyard.shared.bus import Bus
from switchyard.shared.placement_terms import MIGRATION_FIRST_S, MIGRATION_LATER_S, MIGRATION_SLOWDOWN
from switchyard.shared.schemas import LayoutReply, LayoutRequest, MigrateReply, MigrateRequest
from switchyard.solver.placement import PlacementError
from switchyard.solver.placement.moves import apply_moves

__all__ = [
    "Application",
    "ExpertLoadWindow",
    "MigrationCost",
    "SimExpertGroup",
    "expert_load_counts",
    "serve_migrate",
]


@dataclass(frozen=True)
class MigrationCost:
    """How long simulated rearrangements take, and how much they slow the engines down."""

    first_s: float = MIGRATION_FIRST_S
    later_s: float = MIGRATION_LATER_S
    slowdown: float = MIGRATION_SLOWDOWN
    time_scale: float = 1.0

    def step_seconds(self, num_layers: int, first: bool) -> float:
        """Simulated seconds for one step (one layer) of a rearrangement."""
        return self.later_s / num_layers + (self.first_s - self.later_s if first else 0.0)


@dataclass(frozen=True)
class Application:
    """One migrate step as the group applied it."""

    plan_id: str
    version: int
    step: int
    moves: np.ndarray
    duration_s: float


@dataclass
class SimExpertGroup:
    """The expert slots of one simulated EP group; shared by the group's engines, so any may coordinate."""

    group_id: str
    layout: np.ndarray
    cost: MigrationCost = field(default_factory=MigrationCost)
    applications: list[Application] = field(default_factory=list)
    #: Every migrate request received, duplicates included.
    requests: int = 0
    migrating: bool = False
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    def __post_init__(self) -> None:
        self._answers: dict[tuple[str, int], MigrateReply] = {}
        self._in_flight: dict[tuple[str, int], asyncio.Future[MigrateReply]] = {}
        self._lock = asyncio.Lock()
        self._highest_version = 0
        self._last_plan_id: str | None = None

    @property
    def step_time_factor(self) -> float:
        """Multiplier for the engines' step time: `slowdown` while a migration step is in flight."""
        return self.cost.slowdown if self.migrating else 1.0

    def report(self, request: LayoutRequest) -> LayoutReply:
        """The live slot map (buffer slots excluded: they are empty between steps)."""
        check_group(request.engine_group, self.group_id)
        return LayoutReply(
            engine_group=self.group_id,
            layout=self.layout.astype(np.int32),
            version=self._highest_version,
            plan_id=self._last_plan_id,
        )

    def applied_keys(self) -> list[tuple[str, int]]:
        return [(a.plan_id, a.step) for a in self.applications]

    async def apply(self, request: MigrateRequest) -> MigrateReply:
        """Apply one step exactly once; a duplicate (retry, resume) waits for or returns the first answer."""
        self.requests += 1
        key = (request.plan_id, request.step)
        if key in self._answers:
            return self._answers[key]
        if key in self._in_flight:
            return await asyncio.shield(self._in_flight[key])
        future: asyncio.Future[MigrateReply] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            async with self._lock:
                reply = await self._apply_once(request)
            self._answers[key] = reply
            future.set_result(reply)
            return reply
        except asyncio.CancelledError:  # cancelled mid-step: nothing was applied, a retry starts afresh
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: nobody else may be waiting
            raise
        finally:
            del self._in_flight[key]

    async def _apply_once(self, request: MigrateRequest) -> MigrateReply:
        if request.engine_group != self.group_id:
            why = f"this engine belongs to group {self.group_id!r}, not {request.engine_group!r}"
            return MigrateReply.refusal(request, why)
        if request.version < self._highest_version:
            why = f"stale plan: version {request.version} < applied version {self._highest_version}"
            return MigrateReply.refusal(request, why)
        try:
            new_layout = apply_moves(self.layout, request.moves, buffer=True).astype(self.layout.dtype)
        except PlacementError as exc:
            return MigrateReply.refusal(request, str(exc))
        duration = self.cost.step_seconds(self.layout.shape[0], first=not self.applications)
        self.migrating = True
        try:
            await self.sleep(duration * self.cost.time_scale)
        finally:
            self.migrating = False
        self.layout = new_layout
        if request.version >= self._highest_version:
            self._highest_version, self._last_plan_id = request.version, request.plan_id
        moves = np.array(request.moves, copy=True)
        self.applications.append(Application(request.plan_id, request.version, request.step, moves, duration))
        return MigrateReply(
            plan_id=request.plan_id,
            version=request.version,
            step=request.step,
            applied=len(moves),
            duration_s=duration,
        )


async def serve_migrate(bus: Bus, engine_id: str, group: SimExpertGroup) -> list[Subscription]:
    """Answer `sy.engine.<engine_id>.migrate` and `.layout` from `group` (malformed requests get an ErrorReply)."""
    return await serve_expert_slots(bus, engine_id, group)
