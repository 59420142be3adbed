"""The gateway's prefix index of its prefill engines, for the prefill choice of a prefill->decode handoff.

Two indexes, as the router keeps for DP dispatch (`solver.routing.prefix`):

- a `BlockIndex` fed by the prefill engines' own KV events (`sy.engine.<id>.kv`, subscribed on the gateway's
  KV connection, its own). A message is applied only from a known prefill engine (its hello), at its hello's
  block size, and (as every bus message) only when the subject's engine is the message's `engine_id`; anything
  else is dropped and counted (`switchyard_gateway_kv_events_total`). Messages are applied by the one
  `KvApplier` (`solver.routing.prefix.applier`, the router's too): a late one is dropped, a gap in `seq` (events
  lost) or a restart clears the engine's blocks before the message is applied (lost evictions must not leave
  blocks it no longer holds); so does a message the gateway dropped over the engine's rate (`dropped`). An
  engine's blocks never exceed its hello's `kv_blocks` (its own oldest out, counted `over_capacity`).
- a `RoutedIndex` of the gateway's own prefill choices, for engines that send no events and for text keys (no
  tokenizer for the model), which no engine's events can match.

`cached(...)` answers, per candidate, how many of the prompt's leading blocks it holds; `choice.pick_prefill`
turns that into the choice under the load bound.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from switchyard.services.gateway import metrics
from switchyard.services.gateway.registry import GatewayRegistry, HttpEngine
from switchyard.services.router.prefix import key_block_size
from switchyard.shared.schemas import KvEvents
from switchyard.shared.sequence import Seq
from switchyard.solver.routing.prefix import BlockIndex, KvApplier, RoutedIndex

__all__ = ["PrefillPrefix"]


class PrefillPrefix:
    def __init__(
        self, registry: GatewayRegistry, max_blocks: int = 500_000, routed_blocks: int = 100_000, ttl_s: float = 600.0
    ) -> None:
        self.registry = registry
        self.blocks = BlockIndex(max_blocks)
        self.applier = KvApplier(self.blocks)
        self.routed = RoutedIndex(routed_blocks, ttl_s)
        self._over_capacity_seen = 0

    def reports(self, engine_id: str) -> bool:
        """Whether the engine's KV events have been applied (its token keys are then matched against them)."""
        return self.applier.reports(engine_id)

    def on_kv(self, events: KvEvents, _msg: object = None) -> None:
        engine_id = events.engine_id
        engine = self.registry.engines.get(engine_id)
        if engine is None or engine.role != "prefill":  # a DP engine's events are the router's
            metrics.KV_EVENTS.labels("unknown_engine" if engine is None else "not_prefill").inc()
            return
        if events.block_size != engine.block_size:
            metrics.KV_EVENTS.labels("block_size").inc()
            return
        event = self.applier.apply(events, engine.kv_blocks).event
        if event is Seq.LATE:
            metrics.KV_EVENTS.labels("late").inc()
            return
        if event is Seq.GAP or event is Seq.RESTART:
            metrics.KV_EVENTS.labels("gap").inc()
        metrics.KV_EVENTS.labels("applied").inc()
        over = self.blocks.dropped_over_capacity
        if over != self._over_capacity_seen:
            metrics.KV_EVENTS.labels("over_capacity").inc()
            self._over_capacity_seen = over

    def dropped(self, engine_id: str) -> None:
        """A message of the engine's was dropped (over its rate): its blocks may be stale, so they go, and its
        next message starts afresh."""
        if self.applier.reports(engine_id):
            self.applier.restart(engine_id)

    def forget(self, engine_id: str) -> None:
        """The registry dropped the engine: so do both indexes."""
        self.applier.forget(engine_id)
        self.routed.forget(engine_id)

    def cached(self, keys: np.ndarray, kind: str, engines: Sequence[HttpEngine], now: float) -> list[float]:
        """Per engine, the prompt's leading blocks it holds: by its KV events for token keys from an engine that
        sends them (each block credited at its cache tier's default weight: GPU 1, CPU 0.75, disk 0.25,
        `solver.routing.prefix.tiers`), else by what was routed there."""
        ids = [e.engine_id for e in engines]
        routed = self.routed.match(keys, ids, now)
        if kind != "tokens" or not any(self.reports(i) for i in ids):
            return routed.tolist()
        precise = self.blocks.credit(keys, ids)[1]
        size = key_block_size([e.block_size for e in engines])  # the keys' (app._block_size): others name other blocks
        precise[[e.block_size != size for e in engines]] = 0
        return [float(p) if self.reports(i) else float(r) for i, p, r in zip(ids, precise, routed, strict=True)]

    def chosen(self, engine_id: str, keys: np.ndarray, kind: str, now: float) -> None:
        """The prefill went to `engine_id`: remember it where no events will (text keys, a silent engine)."""
        if kind != "tokens" or not self.reports(engine_id):
            self.routed.routed(engine_id, keys.tolist(), now)
