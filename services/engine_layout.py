"""Ask an engine group which expert sits in which slot now (`sy.engine.<id>.layout`).

The database records the placement last *applied*, but engines that restarted run their boot layout again,
and an operator may have moved experts by hand. Plans and migrate steps therefore start from the layout
the group's coordinator reports, and fall back to the database only when no engine answers (an agent
that does not serve the query, or none alive).
"""

from __future__ import annotations

import logging

import numpy as np
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from switchyard.services.fleet_view import FleetView
from switchyard.shared.bus import Bus
from switchyard.shared.errors import RemoteError, WireError
from switchyard.shared.schemas import LayoutReply, LayoutRequest

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
