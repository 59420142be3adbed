"""What both prefix indexes share: engine slots (one bit each), the key -> holders bitmask map, and the
match plan cached per snapshot. Each index adds its own per-engine record of keys (`_new_engine`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from switchyard.solver.routing.prefix.matching import MatchPlan, leading_matches

__all__ = ["EngineSlots", "ints"]


class EngineSlots:
    """`holders[key]` is the bitmask of the engine slots holding `key`; a forgotten engine's slot is reused."""

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}
        self._slot: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._plan_for: tuple[object, MatchPlan | None] = (None, None)  # (engine_ids, its plan), until slots change

    def engines(self) -> list[str]:
        """The engines the index has a slot for (heard from or routed to, and not forgotten)."""
        return list(self._slot)

    def __len__(self) -> int:
        """Distinct keys held by any engine."""
        return len(self.holders)

    def holds(self, key: int, engine_ids: Sequence[str]) -> bool:
        """Whether any of `engine_ids` holds `key`: for a prompt's first key, whether any can match at all."""
        return bool(self.holders.get(key, 0) & self._plan(engine_ids).active)

    def _match(self, keys: Sequence[int], engine_ids: Sequence[str]) -> np.ndarray:
        return leading_matches(self.holders, keys, self._plan(engine_ids))

    def _plan(self, engine_ids: Sequence[str]) -> MatchPlan:
        """The engines' slots prepared for matching, kept while the same `engine_ids` object is asked (a
        snapshot's tuple) and no engine gained or lost a slot."""
        asked, plan = self._plan_for
        if asked is not engine_ids or plan is None or type(engine_ids) is not tuple:
            slot = self._slot.get
            plan = MatchPlan([slot(e, -1) for e in engine_ids])
            self._plan_for = (engine_ids, plan)
        return plan

    def _slot_of(self, engine_id: str) -> int:
        """The engine's slot, claimed (and its record made by `_new_engine`) on first use."""
        slot = self._slot.get(engine_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[engine_id] = slot
            self._plan_for = (None, None)
            self._new_engine(slot)
        return slot

    def _new_engine(self, slot: int) -> None:
        raise NotImplementedError

    def _free_slot(self, engine_id: str) -> int | None:
        """Release the engine's slot (its keys must already be unset); the slot, or None if it had none."""
        slot = self._slot.pop(engine_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        self._plan_for = (None, None)
        return slot

    def _unset(self, key: int, mask: int, bit: int) -> None:
        """Clear `bit` from `key`'s holders (`mask`, as read), dropping the key when no engine is left."""
        rest = mask & ~bit
        if rest:
            self.holders[key] = rest
        else:
            self.holders.pop(key, None)


def ints(keys: Iterable[int] | np.ndarray) -> list[int]:
    """The keys as Python ints: one `tolist` for an array (a numpy scalar per key is slow to hash and convert)."""
    return keys.tolist() if isinstance(keys, np.ndarray) else [int(k) for k in keys]
