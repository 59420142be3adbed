"""Simulated expert migration and expert-load reporting for the simulated engines.

- `SimExpertGroup` models the expert slots of one EP group. It changes only through `MigrateRequest`
  steps: a step's moves are checked and executed in order with the meaning `solver.placement.moves` gives
  them (one scratch slot per GPU as the rearrangement buffer), all or nothing, after the time the seed
  measured, and exactly once per `(plan_id, step)`: a retried or resumed step gets the first answer again.
  Every application is recorded, so tests can prove that no move was applied twice or lost.
- `serve_migrate` mounts it on `sy.engine.<id>.migrate` and `sy.engine.<id>.layout` for one engine: a real
  protocol peer over NATS. The layout query lets the control plane plan from what the engines really run
  (after a restart they run their boot layout again, whatever the database remembers).
- `expert_load_counts` / `ExpertLoadWindow` turn a batch's token→expert selections, with the source DP rank
  of each token, into the `A[L, S, E]` / `B[L, E]` windows of an `ExpertLoad` message.

Cost model (Gimbal, seed 003: 1.08 s for the first rearrangement, 0.72 s for later ones): a rearrangement
of every layer costs `later_s`, spread evenly over layers, so each step (one layer) costs `later_s / L`; the
very first step a group ever applies also pays the one-off `first_s - later_s` (buffer allocation and
warm-up). While a step is in flight the engines run `slowdown` times slower: weight transfers share HBM and
interconnect bandwidth with the all-to-all. `time_scale` maps simulated seconds to wall seconds (0: instant),
so tests never wait real seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from nats.aio.subscription import Subscription

from switchyard.shared.bus import Bus
from switchyard.shared.errors import SchemaMismatch
from switchyard.shared.schemas import ExpertLoad, LayoutReply, LayoutRequest, MigrateReply, MigrateRequest
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

    first_s: float = 1.08
    later_s: float = 0.72
    slowdown: float = 2.0
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
        if request.engine_group != self.group_id:
            raise SchemaMismatch("engine_group", f"this engine belongs to group {self.group_id!r}")
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
    return [
        await bus.serve(bus.subjects.migrate(engine_id), MigrateRequest, group.apply),
        await bus.serve(bus.subjects.layout(engine_id), LayoutRequest, group.report),
    ]


def expert_load_counts(
    selections: np.ndarray, sources: np.ndarray, num_experts: int, num_sources: int
) -> tuple[np.ndarray, np.ndarray]:
    """Count a batch's expert selections per source DP rank.

    `selections` is `[T, L, k]` (the top-k expert ids of T tokens at each of L layers) and `sources` is `[T]`
    (the DP rank each token entered from). Returns `A[L, S, E]` (tokens from source s that selected expert
    e at layer l) and `B[L, E] = A.sum(axis=1)`, both uint32.
    """
    selections, sources = np.asarray(selections), np.asarray(sources)
    if selections.ndim != 3 or sources.shape != selections.shape[:1]:
        raise ValueError(f"selections must be [T, L, k] and sources [T]; got {selections.shape} and {sources.shape}")
    if selections.size and not (selections.min() >= 0 and selections.max() < num_experts):
        raise ValueError(f"expert ids must lie in 0..{num_experts - 1}")
    if sources.size and not (sources.min() >= 0 and sources.max() < num_sources):
        raise ValueError(f"source ranks must lie in 0..{num_sources - 1}")
    layers = selections.shape[1]
    layer = np.broadcast_to(np.arange(layers)[None, :, None], selections.shape)
    source = np.broadcast_to(sources[:, None, None], selections.shape)
    flat = (layer.astype(np.int64) * num_sources + source) * num_experts + selections
    counts = np.bincount(flat.reshape(-1), minlength=layers * num_sources * num_experts)
    source_counts = counts.reshape(layers, num_sources, num_experts).astype(np.uint32)
    return source_counts, source_counts.sum(axis=1, dtype=np.uint32)


@dataclass
class ExpertLoadWindow:
    """Accumulates one engine's expert selections and emits an `ExpertLoad` message per window."""

    engine_id: str
    ep_group: str
    num_layers: int
    num_experts: int
    num_sources: int
    clock: Callable[[], float] = time.time
    seq: int = 0

    def __post_init__(self) -> None:
        self._counts = np.zeros((self.num_layers, self.num_sources, self.num_experts), dtype=np.uint32)
        self._start = self.clock()

    def add(self, selections: np.ndarray, sources: np.ndarray) -> None:
        """Fold in one batch: `selections [T, L, k]`, `sources [T]` (see `expert_load_counts`)."""
        counts, _ = expert_load_counts(selections, sources, self.num_experts, self.num_sources)
        self._counts += counts

    def flush(self) -> ExpertLoad:
        """The window since the last flush as a message (seq increases by one per window); starts a new one."""
        end = self.clock()
        message = ExpertLoad(
            engine_id=self.engine_id,
            ep_group=self.ep_group,
            seq=self.seq,
            window_start=self._start,
            window_end=max(end, self._start),
            expert_counts=self._counts.sum(axis=1, dtype=np.uint32),
            source_counts=self._counts,
        )
        self.seq += 1
        self._counts = np.zeros_like(self._counts)
        self._start = end
        return message
