"""The longest-prefix match shared by both indexes: one pass over the keys with an engine bitmask."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["leading_matches"]


def leading_matches(holders: Mapping[int, int], keys: Sequence[int], slots: Sequence[int]) -> np.ndarray:
    """int64[len(slots)]: per engine slot (-1: unknown engine), how many leading `keys` it holds.

    `holders[key]` is the bitmask of the slots holding `key`. The walk stops at the first key no asked engine
    holds, so a miss costs one dict lookup; a full hit on every engine costs one lookup per key.
    """
    out = np.zeros(len(slots), dtype=np.int64)
    active = 0
    for slot in slots:
        if slot >= 0:
            active |= 1 << slot
    if not active:
        return out
    depth_of: dict[int, int] = {}  # slot -> depth where it dropped out
    get = holders.get
    depth = 0
    for key in keys:
        held = get(key, 0) & active
        if held != active:
            dropped = active & ~held
            while dropped:
                low = dropped & -dropped
                depth_of[low.bit_length() - 1] = depth
                dropped ^= low
            active = held
            if not active:
                break
        depth += 1
    while active:
        low = active & -active
        depth_of[low.bit_length() - 1] = depth
        active ^= low
    for i, slot in enumerate(slots):
        if slot >= 0:
            out[i] = depth_of.get(slot, 0)
    return out
