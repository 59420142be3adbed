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

Cache tiers (`tiers`): the events name the tier a block is stored in or removed from (vLLM's `medium`: the
engine's KV cache, ``gpu``, or an offload connector's ``cpu``/``disk``). Each offload tier is an index of its own
(the same structure), bounded the same way: at most `max_blocks` keys per engine per tier, oldest out first. The
hello's `kv_blocks` bounds only the GPU tier (an offload tier's size is not announced), so memory is at most three
times `max_blocks` × engines. `match` is the GPU tier's; `credit` weighs every tier (`tiers.TierWeights`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from switchyard.solver.routing.prefix.slots import EngineSlots, ints
from switchyard.solver.routing.prefix.tiers import DEFAULT_WEIGHTS, TIERS, Tier, TierWeights, walk_tiers

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
        self._lower: dict[str, BlockIndex] = {}  # offload tier -> its blocks (made on the tier's first store)
        self.dropped_over_cap = 0  # keys dropped because an engine passed max_blocks (counter)
        self.dropped_over_capacity = 0  # keys dropped because an engine passed its own KV capacity (counter)

    # -- events ---------------------------------------------------------------------------------------------

    def stored(self, engine_id: str, keys: Iterable[int], capacity: int | None = None, tier: Tier = "gpu") -> None:
        """The engine cached these blocks (vLLM's BlockStored) in `tier`. `capacity`: the blocks its KV cache
        could hold at all (its hello's `kv_blocks`; the GPU tier's bound); past it, or past `max_blocks`, its own
        oldest blocks of that tier go first."""
        if tier != "gpu":
            if tier not in TIERS:
                raise ValueError(f"unknown cache tier {tier!r}")
            lower = self._lower.get(tier)
            if lower is None:
                lower = self._lower[tier] = BlockIndex(self.max_blocks)
            before = lower.dropped_over_cap
            lower.stored(engine_id, keys)
            self.dropped_over_cap += lower.dropped_over_cap - before
            return
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

    def removed(self, engine_id: str, keys: Iterable[int], tier: Tier | None = None) -> None:
        """The engine evicted these blocks (vLLM's BlockRemoved) from `tier` (None: from every tier, as when an
        answer contradicts a claim); unknown keys are ignored."""
        if tier != "gpu":
            keys = ints(keys)
            for name, lower in self._lower.items():
                if tier is None or name == tier:
                    lower.removed(engine_id, keys)
            if tier is not None:
                return
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
        """The engine dropped its whole cache (vLLM's AllBlocksCleared, or a restart): it holds nothing, in no tier."""
        for lower in self._lower.values():
            lower.cleared(engine_id)
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
        """The engine left the fleet: clear it and free its slot (in every tier)."""
        for lower in self._lower.values():
            lower.forget(engine_id)
        self.cleared(engine_id)
        slot = self._free_slot(engine_id)
        if slot is not None:
            del self._engines[slot]

    # -- queries --------------------------------------------------------------------------------------------

    def match(self, keys: Sequence[int], engine_ids: Sequence[str]) -> np.ndarray:
        """int64[len(engine_ids)]: how many leading `keys` each engine holds (0 for an engine never heard)."""
        return self._match(keys, engine_ids)

    def credit(
        self, keys: Sequence[int], engine_ids: Sequence[str], weights: TierWeights = DEFAULT_WEIGHTS
    ) -> tuple[np.ndarray, np.ndarray]:
        """(int64, float64)[len(engine_ids)]: each engine's leading `keys` held in any tier of positive weight,
        and their credit in blocks, each at its best tier's weight (see `tiers`). With no offload tier held this
        is `match` (times the GPU weight), at the cost of one check."""
        gpu = self._match(keys, engine_ids) if weights.gpu > 0 else np.zeros(len(engine_ids), dtype=np.int64)
        lower = [(weights[TIERS.index(t)], index) for t, index in self._lower.items() if index.holders]
        if not any(w > 0 for w, _ in lower):
            return gpu, gpu * weights.gpu
        tiers = [(weights.gpu, self.holders, self._slot), *((w, i.holders, i._slot) for w, i in lower)]
        depth, extra = walk_tiers(ints(keys), engine_ids, gpu, tiers)
        return depth, gpu * weights.gpu + extra

    def holds(self, key: int, engine_ids: Sequence[str]) -> bool:
        """Whether any of `engine_ids` holds `key` in any tier."""
        return super().holds(key, engine_ids) or any(i.holds(key, engine_ids) for i in self._lower.values())

    def blocks(self, engine_id: str, tier: Tier | None = None) -> int:
        """Keys the index holds for the engine, in `tier` (None: in every tier, a key in two counted twice)."""
        if tier is None:
            return sum(self.blocks(engine_id, t) for t in TIERS)
        if tier != "gpu":
            lower = self._lower.get(tier)
            return 0 if lower is None else lower.blocks(engine_id)
        slot = self._slot.get(engine_id)
        return 0 if slot is None else self._engines[slot].held

    def held(self) -> int:
        """Blocks held, summed over engines and tiers (a key two engines or two tiers hold counts twice)."""
        return sum(blocks.held for blocks in self._engines.values()) + sum(i.held() for i in self._lower.values())

    def engines(self) -> list[str]:
        """The engines any tier has a slot for."""
        return list(dict.fromkeys([*self._slot, *(e for i in self._lower.values() for e in i._slot)]))

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
