"""The approximate prefix index: what was routed to each engine, kept for a while, no engine cooperation.

Why: an engine that sends no KV events (another server, an older vLLM, events off) still caches what it
served. Recording each decision's block keys against the engine it went to predicts that cache, as llm-d's
approximate prefix scorer and SGLang's router tree do. It cannot see evictions, so entries expire after
`ttl_s` since last routed (LRU per engine) and each engine keeps at most `max_blocks` keys, least recently
routed out first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from switchyard.solver.routing.prefix.slots import EngineSlots, ints

__all__ = ["RoutedIndex"]


class RoutedIndex(EngineSlots):
    """Per engine, the block keys routed there with the time last routed; `match` for routing."""

    def __init__(self, max_blocks: int = 200_000, ttl_s: float = 600.0) -> None:
        if max_blocks < 1 or ttl_s <= 0:
            raise ValueError("max_blocks must be at least 1 and ttl_s positive")
        super().__init__()
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._lru: dict[int, OrderedDict[int, float]] = {}

    def routed(self, engine_id: str, keys: Sequence[int], now: float) -> None:
        """A request with these block keys was sent to the engine at `now` (seconds, any monotonic clock)."""
        slot = self._slot_of(engine_id)
        bit = 1 << slot
        lru = self._lru[slot]
        holders = self.holders
        for key in ints(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                holders[key] = holders.get(key, 0) | bit
            lru[key] = now
        while len(lru) > self.max_blocks:
            self._drop(lru.popitem(last=False)[0], bit)
        self.expire(engine_id, now)

    def expire(self, engine_id: str, now: float) -> None:
        """Drop the engine's keys last routed more than `ttl_s` ago."""
        slot = self._slot.get(engine_id)
        if slot is None:
            return
        lru = self._lru[slot]
        bit = 1 << slot
        horizon = now - self.ttl_s
        while lru:
            key, when = next(iter(lru.items()))
            if when >= horizon:
                break
            del lru[key]
            self._drop(key, bit)

    def forget(self, engine_id: str) -> None:
        """The engine left (or restarted): it holds nothing, its slot is free."""
        slot = self._free_slot(engine_id)
        if slot is None:
            return
        bit = 1 << slot
        for key in self._lru.pop(slot):
            self._drop(key, bit)

    def match(self, keys: Sequence[int], engine_ids: Sequence[str], now: float | None = None) -> np.ndarray:
        """int64[len(engine_ids)]: leading `keys` routed to each engine (expired ones first dropped if `now`)."""
        if now is not None:
            for engine_id in engine_ids:
                self.expire(engine_id, now)
        return self._match(keys, engine_ids)

    def blocks(self, engine_id: str) -> int:
        slot = self._slot.get(engine_id)
        return 0 if slot is None else len(self._lru[slot])

    def held(self) -> int:
        """Blocks held, summed over engines."""
        return sum(len(lru) for lru in self._lru.values())

    def _new_engine(self, slot: int) -> None:
        self._lru[slot] = OrderedDict()

    def _drop(self, key: int, bit: int) -> None:
        self._unset(key, self.holders.get(key, 0), bit)
