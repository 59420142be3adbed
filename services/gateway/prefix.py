"""The gateway's prefix index of its prefill engines, for the prefill choice of a prefill->decode handoff.

Two indexes, as the router keeps for DP dispatch (`solver.routing.prefix`):

- a `BlockIndex` fed by the prefill engines' own KV events (`sy.engine.<id>.kv`, subscribed on the gateway's
  KV connection, its own). A message is applied only from a known prefill engine (its hello), at its hello's
  block size, and (as every bus message) only when the subject's engine is the message's `engine_id`; anything
  else is dropped and counted (`switchyard_gateway_kv_events_total`). A gap in `seq` (events lost) or a restart
  clears the engine's blocks before the message is applied: lost evictions must not leave blocks it no longer
  holds; so does a message the gateway dropped over the engine's rate (`dropped`). An engine's blocks never
  exceed its hello's `kv_blocks` (its own oldest out, counted `over_capacity`).
- a `RoutedIndex` of the gateway's own prefill choices, for engines that send no events and for text keys (no
  tokenizer for the model), which no engine's events can match.

`cached(...)` answers, per candidate, how many of the prompt's leading blocks it holds; `choice.pick_prefill`
turns that into the choice under the load bound.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from switchyard.services.gateway import metrics
from switchyard.services.gateway.registry import Engine, EngineRegistry
from switchyard.services.router.prefix import key_block_size
from switchyard.shared.schemas import KvEvents
from switchyard.shared.sequence import Seq, classify
from switchyard.solver.routing.prefix import BlockIndex, RoutedIndex

__all__ = ["PrefillPrefix"]


class PrefillPrefix:
    def __init__(
        self, registry: EngineRegistry, max_blocks: int = 500_000, routed_blocks: int = 100_000, ttl_s: float = 600.0
    ) -> None:
        self.registry = registry
        self.blocks = BlockIndex(max_blocks)
        self.routed = RoutedIndex(routed_blocks, ttl_s)
        self._seq: dict[str, int] = {}  # the last applied KvEvents seq, per reporting engine
        self._over_capacity_seen = 0

    def reports(self, engine_id: str) -> bool:
        """Whether the engine's KV events have been applied (its token keys are then matched against them)."""
        return engine_id in self._seq

    def on_kv(self, events: KvEvents, _msg: object = None) -> None:
        engine_id = events.engine_id
        engine = self.registry.engines.get(engine_id)
        if engine is None or engine.role != "prefill":  # a DP engine's events are the router's
            metrics.KV_EVENTS.labels("unknown_engine" if engine is None else "not_prefill").inc()
            return
        if events.block_size != engine.block_size:
            metrics.KV_EVENTS.labels("block_size").inc()
            return
        event, _missed = classify(self._seq.get(engine_id), events.seq)
        if event is Seq.LATE:
            metrics.KV_EVENTS.labels("late").inc()
            return
        if event is Seq.GAP or event is Seq.RESTART:
            self.blocks.cleared(engine_id)
            metrics.KV_EVENTS.labels("gap").inc()
        self._seq[engine_id] = events.seq
        for op in events.ops:
            if op.kind == "stored":
                self.blocks.stored(engine_id, op.keys.tolist(), engine.kv_blocks)
            elif op.kind == "removed":
                self.blocks.removed(engine_id, op.keys.tolist())
            else:
                self.blocks.cleared(engine_id)
        metrics.KV_EVENTS.labels("applied").inc()
        over = self.blocks.dropped_over_capacity
        if over != self._over_capacity_seen:
            metrics.KV_EVENTS.labels("over_capacity").inc()
            self._over_capacity_seen = over

    def dropped(self, engine_id: str) -> None:
        """A message of the engine's was dropped (over its rate): its blocks may be stale, so they go, and its
        next message starts afresh."""
        if self._seq.pop(engine_id, None) is not None:
            self.blocks.cleared(engine_id)

    def forget(self, engine_id: str) -> None:
        """The registry dropped the engine: so do both indexes."""
        self._seq.pop(engine_id, None)
        self.blocks.forget(engine_id)
        self.routed.forget(engine_id)

    def cached(self, keys: np.ndarray, kind: str, engines: Sequence[Engine], now: float) -> list[int]:
        """Per engine, the prompt's leading blocks it holds: by its KV events for token keys from an engine that
        sends them, else by what was routed there."""
        ids = [e.engine_id for e in engines]
        routed = self.routed.match(keys, ids, now)
        if kind != "tokens" or not any(self.reports(i) for i in ids):
            return routed.tolist()
        precise = self.blocks.match(keys, ids)
        size = key_block_size([e.block_size for e in engines])  # the keys' (app._block_size): others name other blocks
        precise[[e.block_size != size for e in engines]] = 0
        return [int(p) if self.reports(i) else int(r) for i, p, r in zip(ids, precise, routed, strict=True)]

    def chosen(self, engine_id: str, keys: np.ndarray, kind: str, now: float) -> None:
        """The prefill went to `engine_id`: remember it where no events will (text keys, a silent engine)."""
        if kind != "tokens" or not self.reports(engine_id):
            self.routed.routed(engine_id, keys.tolist(), now)
