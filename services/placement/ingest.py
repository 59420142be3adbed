"""The placement service's expert-load ingest: JetStream windows in, one decayed window per EP group out.

An ordered JetStream consumer on `sy.engine.*.expert_load`, started `warmup_s` back in the stream, so a restart
rebuilds the same decayed window per engine group (`window.DecayedLoad`) instead of starting cold; `caught_up`
is set once that replay has been processed, and the service plans nothing before. A window is kept only from an
engine that said hello, for the group and model shape that hello announced, and not ending too far in the
future; the windows of groups left without a live engine are dropped after `orphan_window_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime, timedelta

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client import Counter

from switchyard.services.fleet_view import FleetView
from switchyard.services.placement.settings import PlacementSettings
from switchyard.services.runtime import decode_stream_message
from switchyard.shared.bus import Bus
from switchyard.shared.schemas import ExpertLoad
from switchyard.solver.placement.window import DecayedLoad

log = logging.getLogger(__name__)

WINDOWS = Counter("switchyard_placement_windows_total", "Expert-load windows folded into the decayed state.")
FUTURE_WINDOWS = Counter(
    "switchyard_placement_windows_refused_total", "Expert-load windows refused: they end too far in the future."
)
WINDOWS_REFUSED = Counter(
    "switchyard_placement_windows_mismatched_total",
    "Expert-load windows refused: from an engine that never said hello, or for another group or model shape.",
    ["reason"],
)


class ExpertLoadIngest:
    """The decayed expert load of every EP group (`windows`), fed by `follow`; `caught_up` once replayed."""

    def __init__(self, config: PlacementSettings, fleet: FleetView) -> None:
        self.config = config
        self.fleet = fleet
        self.windows: dict[str, DecayedLoad] = {}
        self.caught_up = asyncio.Event()
        self.bus: Bus | None = None  # set by follow()
        self._processed_seq = 0
        self._catch_up_to = 2**63  # known once the replay consumer exists
        self._future_engines: set[str] = set()
        self._window_warnings: set[str] = set()
        self._orphan_since: dict[str, float] = {}

    async def follow(self, bus: Bus, ingest: Bus) -> None:
        """Subscribe to the expert-load stream on `ingest` (the engine-ingest connection), `warmup_s` back."""
        self.bus = bus
        subjects = bus.subjects
        since = datetime.now(UTC) - timedelta(seconds=self.config.warmup_s)
        # By start sequence, not by start time: nats-py recreates an ordered consumer (after a NATS restart)
        # by sequence but keeps the start time, a config the server refuses (err 10094), so a consumer made
        # by time would stop delivering for good after the first restart.
        first = await first_sequence_since(bus, subjects.expert_load_stream, since)
        subscription = await ingest.js.subscribe(
            subjects.all_expert_load,
            stream=subjects.expert_load_stream,
            cb=self._on_expert_load,
            ordered_consumer=True,
            idle_heartbeat=1.0,  # two missed (a NATS restart) and the consumer is recreated: a 2-3 s gap, not 10
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            config=ConsumerConfig(opt_start_seq=first),
        )
        info = await subscription.consumer_info()
        if info.num_pending == 0:  # everything in range is on its way: caught up once we processed the last one
            self._catch_up_to = info.delivered.stream_seq
            if self._processed_seq >= self._catch_up_to:
                self.caught_up.set()

    async def _on_expert_load(self, msg: Msg) -> None:
        assert self.bus is not None
        subject = self.bus.subjects.all_expert_load
        window = await decode_stream_message(
            msg, ExpertLoad, subject, self.bus.max_payload, acked=False, subjects=self.bus.subjects
        )
        refusal = self._window_refusal(window) if window is not None else None
        if refusal is not None:
            WINDOWS_REFUSED.labels(refusal).inc()
            self._warn_window(window.engine_id, refusal)  # type: ignore[union-attr]
        elif window is not None:
            ahead = window.window_end - msg.metadata.timestamp.timestamp()
            if ahead > self.config.max_clock_skew_s:  # it would outweigh every honest window until time caught up
                FUTURE_WINDOWS.inc()
                self._warn_future(window.engine_id, ahead)
            else:
                self.windows.setdefault(window.ep_group, DecayedLoad(self.config.half_life_s)).add(window)
                WINDOWS.inc()
        self._processed_seq = msg.metadata.sequence.stream
        if msg.metadata.num_pending == 0 or self._processed_seq >= self._catch_up_to:
            self.caught_up.set()

    def _window_refusal(self, window: ExpertLoad) -> str | None:
        """Why a window cannot be kept, or None: it must come from an engine that said hello, for the group and
        model shape that hello announced. While replaying the stream after a start the hellos may not be in yet:
        windows are kept then, and `drop_orphans` removes the groups that turn out to have no live engine."""
        state = self.fleet.engines.get(window.engine_id)
        hello = state.hello if state is not None else None
        if hello is None:
            return "unknown_engine" if self.caught_up.is_set() else None
        if hello.ep_group != window.ep_group:
            return "wrong_group"
        if window.expert_counts.shape != (hello.model.num_layers, hello.model.num_experts):
            return "wrong_shape"
        return None

    def _warn_window(self, engine_id: str, reason: str) -> None:
        key = f"{engine_id}:{reason}"
        if key not in self._window_warnings and len(self._window_warnings) < 1000:
            self._window_warnings.add(key)
            log.warning(
                "expert-load window from %s refused (%s); switchyard_placement_windows_mismatched_total counts them",
                engine_id,
                reason,
            )

    def drop_orphans(self, now: float) -> list[str]:
        """Forget the windows of groups with no live engine for `orphan_window_s`; returns their names."""
        dropped = []
        for group in list(self.windows):
            if self.fleet.group(group):
                self._orphan_since.pop(group, None)
                continue
            since = self._orphan_since.setdefault(group, now)
            if now - since >= self.config.orphan_window_s:
                del self.windows[group]
                self._orphan_since.pop(group, None)
                dropped.append(group)
        if dropped:
            log.info("dropped the expert-load windows of %d group(s) with no live engine", len(dropped))
        return dropped

    def _warn_future(self, engine_id: str, ahead: float) -> None:
        if engine_id not in self._future_engines:
            self._future_engines.add(engine_id)
            log.warning(
                "engine %s sends expert-load windows ending %.0f s after the stream received them; its clock is "
                "skewed: refused (switchyard_placement_windows_refused_total counts them)",
                engine_id,
                ahead,
            )


async def first_sequence_since(bus: Bus, stream: str, since: datetime) -> int:
    """The stream sequence of the first message stored at or after `since` (one past the last if none)."""
    info = await bus.js.add_consumer(
        stream,
        ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=since.isoformat(),
            ack_policy=AckPolicy.NONE,
            inactive_threshold=10.0,
        ),
    )
    with contextlib.suppress(Exception):  # it expires by itself anyway
        await bus.js.delete_consumer(stream, info.name)
    return info.delivered.stream_seq + 1
