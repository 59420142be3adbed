"""What an engine group runs now, gathered the same way by placement (where a plan starts) and migration (where
the moves start).

The database records the placement last *applied*, but engines that restarted run their boot layout again, and
an operator may have moved experts by hand. So both start from the layout the group's coordinator reports
(`LayoutProbe`, `sy.engine.<id>.layout`), and fall back to the database (`recorded`, read inside the caller's
session) only when no engine answers (an agent that does not serve the query, or none alive), and to the boot
layout of the group's shape before any placement: `layout_now` applies that rule
(`solver.placement.layouts.current_layout`) with the one default.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from sqlalchemy.ext.asyncio import AsyncSession

from switchyard.services.fleet_view import FleetView
from switchyard.services.history import applied_placement, load_layout
from switchyard.shared.bus import Bus
from switchyard.shared.db.models import Placement
from switchyard.shared.errors import RemoteError, WireError
from switchyard.shared.schemas import LayoutReply, LayoutRequest
from switchyard.solver.placement.layouts import LayoutSource, current_layout, default_layout

log = logging.getLogger(__name__)

_UNANSWERED = (NatsTimeoutError, NoRespondersError, ConnectionClosedError, TimeoutError, RemoteError, WireError)


class LayoutProbe:
    """Queries coordinators; says once per engine that it does not answer, not on every plan."""

    def __init__(self, bus: Bus, fleet: FleetView, timeout_s: float = 2.0) -> None:
        self.bus = bus
        self.fleet = fleet
        self.timeout_s = timeout_s
        self._silent: set[str] = set()

    async def live_layout(self, group: str) -> LayoutReply | None:
        """The group's slot map as its coordinator reports it, or None when no engine answers."""
        engine = self.fleet.coordinator(group)
        if engine is None:
            return None
        request = LayoutRequest(engine_group=group)
        try:
            reply = await self.bus.request(self.bus.subjects.layout(engine), request, LayoutReply, self.timeout_s)
        except _UNANSWERED as exc:
            if engine not in self._silent:
                self._silent.add(engine)
                log.warning("engine %s did not report its layout (%s); planning from the database", engine, exc)
            return None
        self._silent.discard(engine)
        return reply


def differs(reported: np.ndarray, recorded: np.ndarray) -> bool:
    """Whether the engines run something other than what the database says they run."""
    return reported.shape != recorded.shape or not np.array_equal(reported, recorded)


class GroupShape(NamedTuple):
    """The shape of a group's slot map and how many experts it places (what its boot layout needs)."""

    num_layers: int
    num_experts: int
    num_gpus: int
    slots_per_gpu: int

    @classmethod
    def of(cls, layout: np.ndarray) -> GroupShape:
        """The shape of `layout` `[L, G, slots]`, placing experts 0..its largest id."""
        num_layers, num_gpus, slots = layout.shape
        return cls(num_layers, int(layout.max()) + 1, num_gpus, slots)

    def boot_layout(self) -> np.ndarray:
        """What such a group runs before any placement: vLLM's contiguous layout."""
        return default_layout(self.num_layers, self.num_experts, self.num_gpus, self.slots_per_gpu)


class Recorded(NamedTuple):
    """The database's word: the placement last applied and its layout (both None before any)."""

    applied: Placement | None
    layout: np.ndarray | None


class LayoutNow(NamedTuple):
    layout: np.ndarray
    source: LayoutSource
    #: What the database says the group runs: the applied layout, else the boot layout of its shape.
    recorded: np.ndarray


async def recorded(session: AsyncSession, group: str) -> Recorded:
    applied = await applied_placement(session, group)
    return Recorded(applied, await load_layout(session, applied) if applied is not None else None)


def layout_now(reported: LayoutReply | None, record: Recorded, shape: GroupShape) -> LayoutNow:
    """The layout the group runs now and where it came from: the engines' report (only of the group's
    `(L, G)`), else the applied placement, else the boot layout of `shape`."""
    on_record = record.layout if record.layout is not None else shape.boot_layout()
    layout, source = current_layout(
        reported.layout if reported is not None else None,
        record.layout,
        lambda: on_record,
        shape=(shape.num_layers, shape.num_gpus),
    )
    return LayoutNow(layout, source, on_record)
