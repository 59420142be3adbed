"""The precise prefix index: each engine's cached blocks as its own KV-cache events report them.

Why bounded per engine: the events come from the engines, and an engine (or a credential speaking for one)
could report blocks without end. Each engine holds at most `max_blocks` keys, and at most the blocks its KV
cache could hold at all (`stored(..., capacity)`: its hello's `kv_blocks`); past that its oldest stored key
is dropped first, as if evicted. One engine can so fill only its own share: memory is at most
`max_blocks` × engines, whatever one engine sends.

Layout (memory, ~110 bytes a block): `holders` maps a key to the bitmask of the engine slots holding it
(several engines holding one prefix cost one entry); each engine keeps its stored keys in arrival order in a
growable uint64 ring, removals left there as stale entries (skipped, and compacted away when the ring fills).
A key stored again while held keeps its first position (vLLM stores a block once while it is cached); a key
removed and stored again may leave its older entry first in the ring, so it can be dropped over the cap early.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from switchyard.solver.routing.prefix.slots import EngineSlots, ints

__all__ = ["BlockIndex"]

#: Default bound on one engine's blocks: 2 M blocks of 16 tokens is 32 M tokens, past any one engine's HBM.
DEFAULT_MAX_BLOCKS = 2_000_000


class _EngineBlocks:
    """One engine's stored keys, oldest first (a ring with stale entries), and how many it holds."""

    __slots__ = ("head", "held", "ring", "tail")

    def __init__(self, capacity: int) -> None:
        self.ring = np.zeros(max(capacity, 16), dtype=np.uint64)
        self.head = 0  # index of the oldest entry
        self.tail = 0  # one past the newest (monotone; positions are mod len(ring))
        self.held = 0

    def push(self, key: int) -> None:
        if self.tail - self.head == len(self.ring):
            raise OverflowError("ring full")  # the index compacts or grows before this
        self.ring[self.tail % len(self.ring)] = key
        self.tail += 1

    def pop(self) -> int:
        key = int(self.ring[self.head % len(self.ring)])
        self.head += 1
        return key

    def entries(self) -> int:
        return self.tail - self.head

    def reset(self, keys: Sequence[int], capacity: int) -> None:
        self.ring = np.zeros(max(capacity, 16, 2 * len(keys)), dtype=np.uint64)
        self.ring[: len(keys)] = np.asarray(keys, dtype=np.uint64)
        self.head, self.tail = 0, len(keys)


class BlockIndex(EngineSlots):
    """Which engine holds which block key, fed by stored/removed/cleared events; `match` for routing."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        super().__init__()
        self.max_blocks = max_blocks
        self._engines: dict[int, _EngineBlocks] = {}
        self.dropped_over_cap = 0  # keys dropped because an engine passed max_blocks (counter)
        self.dropped_over_capacity = 0  # keys dropped because an engine passed its own KV capacity (counter)

    # -- events ---------------------------------------------------------------------------------------------

    def stored(self, engine_id: str, keys: Iterable[int], capacity: int | None = None) -> None:
        """The engine cached these blocks (vLLM's BlockStored). `capacity`: the blocks it could hold at all (its
        hello's `kv_blocks`); past it, or past `max_blocks`, its own oldest blocks go first."""
        cap = self.max_blocks if capacity is None else max(1, min(capacity, self.max_blocks))
        slot = self._slot_of(engine_id)
        bit = 1 << slot
        blocks = self._engines[slot]
        holders = self.holders
        for key in ints(keys):
            mask = holders.get(key, 0)
            if mask & bit:
                continue
            holders[key] = mask | bit
            if blocks.entries() == len(blocks.ring):
                self._make_room(slot, blocks)
            blocks.push(key)
            blocks.held += 1
            if blocks.held > cap:
                self._drop_oldest(slot, blocks)
                if cap < self.max_blocks:
                    self.dropped_over_capacity += 1
                else:
                    self.dropped_over_cap += 1

    def removed(self, engine_id: str, keys: Iterable[int]) -> None:
        """The engine evicted these blocks (vLLM's BlockRemoved); unknown keys are ignored."""
        slot = self._slot.get(engine_id)
        if slot is None:
            return
        bit = 1 << slot
        blocks = self._engines[slot]
        holders = self.holders
        for key in ints(keys):
            mask = holders.get(key, 0)
            if mask & bit:
                self._unset(key, mask, bit)
                blocks.held -= 1

    def cleared(self, engine_id: str) -> None:
        """The engine dropped its whole cache (vLLM's AllBlocksCleared, or a restart): it holds nothing."""
        slot = self._slot.get(engine_id)
        if slot is None:
            return
        bit = 1 << slot
        blocks = self._engines[slot]
        while blocks.entries():
            key = blocks.pop()
            mask = self.holders.get(key, 0)
            if mask & bit:
                self._unset(key, mask, bit)
        blocks.held = 0

    def forget(self, engine_id: str) -> None:
        """The engine left the fleet: clear it and free its slot."""
        self.cleared(engine_id)
        slot = self._free_slot(engine_id)
        if slot is not None:
            del self._engines[slot]

    # -- queries --------------------------------------------------------------------------------------------

    def match(self, keys: Sequence[int], engine_ids: Sequence[str]) -> np.ndarray:
        """int64[len(engine_ids)]: how many leading `keys` each engine holds (0 for an engine never heard)."""
        return self._match(keys, engine_ids)

    def blocks(self, engine_id: str) -> int:
        """Keys the index holds for the engine."""
        slot = self._slot.get(engine_id)
        return 0 if slot is None else self._engines[slot].held

    def held(self) -> int:
        """Blocks held, summed over engines (a key two engines hold counts twice)."""
        return sum(blocks.held for blocks in self._engines.values())

    # -- internals ------------------------------------------------------------------------------------------

    def _new_engine(self, slot: int) -> None:
        self._engines[slot] = _EngineBlocks(min(self.max_blocks, 1024))

    def _drop_oldest(self, slot: int, blocks: _EngineBlocks) -> None:
        bit = 1 << slot
        while blocks.entries():
            key = blocks.pop()
            mask = self.holders.get(key, 0)
            if mask & bit:
                self._unset(key, mask, bit)
                blocks.held -= 1
                return

    def _make_room(self, slot: int, blocks: _EngineBlocks) -> None:
        """The ring is full: keep only the keys still held, in order, and grow if it is mostly live."""
        bit = 1 << slot
        get = self.holders.get
        order: list[int] = []
        while blocks.entries():
            order.append(blocks.pop())
        live: list[int] = []
        seen: set[int] = set()
        for key in reversed(order):  # a key stored twice keeps its newest place
            if get(key, 0) & bit and key not in seen:
                seen.add(key)
                live.append(key)
        live.reverse()
        capacity = len(blocks.ring)
        if len(live) * 2 > capacity:
            capacity = min(2 * capacity, 2 * self.max_blocks + 16)
        blocks.reset(live, capacity)
