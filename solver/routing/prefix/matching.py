"""The longest-prefix match shared by both indexes: one pass over the keys with an engine bitmask.

How it stays cheap (bench/prefix_index.py; issue 25's budget is 50 µs p50 for 512 keys over 64 engines): the
keys become Python ints once (`ndarray.tolist`, not one numpy scalar per lookup), and the walk runs in C
(``map(holders.get)`` → ``accumulate(&)`` → ``takewhile``): ``chain[k]`` is the set of asked engines holding the
first k keys, stopping at the first key none holds. The chain only shrinks, and a strictly smaller set has
fewer bits, so each engine's depth is found by bisecting on the bit count (a few probes per distinct set), and
the sets become per-engine depths with one numpy gather each. The engines' slots are prepared once per fleet
(`MatchPlan`), which the indexes cache while their slots do not change.

A full hit (an asked engine holds the last key) looks every key up at once and, when all keys have the same
holders (one engine's cached prompt, or one prefix on all), needs no running AND: ~40% less than the chain.

Tried and dropped: the walk in uint64 chunks (`np.fromiter` of the masks, `np.bitwise_and.accumulate`), no
faster than the C iterator chain here and slower on a partial hit (it looks up a whole chunk past the end).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from itertools import accumulate, repeat, takewhile
from operator import and_

import numpy as np

__all__ = ["MatchPlan", "leading_matches"]


def _fewer_bits(mask: int) -> int:
    return -mask.bit_count()


class MatchPlan:
    """The asked engines' slots, prepared for `leading_matches`: their bitmask and a gather index."""

    __slots__ = ("active", "gather", "nbytes", "size")

    def __init__(self, slots: Sequence[int]) -> None:
        slots = [int(s) for s in slots]
        self.size = len(slots)
        self.active = 0
        for slot in slots:
            if slot >= 0:
                self.active |= 1 << slot
        top = max(slots, default=-1) + 1  # bit `top` is never set: the unknown engines (-1) read it
        self.nbytes = top // 8 + 1
        self.gather = np.array([s if s >= 0 else top for s in slots], dtype=np.intp)

    def depths(self, regions: list[tuple[int, int]]) -> np.ndarray:
        """int64[size]: each engine's depth from (engines, depth) pairs of disjoint engine sets."""
        out = np.zeros(self.size, dtype=np.int64)
        for engines, depth in regions:
            bits = np.unpackbits(
                np.frombuffer(engines.to_bytes(self.nbytes, "little"), dtype=np.uint8), bitorder="little"
            )
            out[bits.take(self.gather).astype(bool)] = depth
        return out


def leading_matches(
    holders: Mapping[int, int],
    keys: Sequence[int] | np.ndarray,
    slots: Sequence[int] | MatchPlan,
) -> np.ndarray:
    """int64[len(slots)]: per engine slot (-1: unknown engine), how many leading `keys` it holds.

    `holders[key]` is the bitmask of the slots holding `key`. The walk stops at the first key no asked engine
    holds, so a miss costs one dict lookup; a full hit on every engine costs one lookup per key.
    """
    plan = slots if isinstance(slots, MatchPlan) else MatchPlan(slots)
    active = plan.active
    if not active or not len(keys):
        return np.zeros(plan.size, dtype=np.int64)
    get = holders.get
    if not get(int(keys[0]), 0) & active:  # a miss: one lookup
        return np.zeros(plan.size, dtype=np.int64)
    if isinstance(keys, np.ndarray):
        keys = keys.tolist()
    if get(keys[-1], 0) & active:  # an asked engine holds the last key: most likely a full hit
        masks = list(map(get, keys, repeat(0)))
        if masks.count(masks[0]) == len(masks):  # every key held by the same engines: one region
            held = masks[0] & active
            return plan.depths([(held, len(keys))])
        chain = list(takewhile(bool, accumulate(masks, and_, initial=active)))
    else:
        chain = list(takewhile(bool, accumulate(map(get, keys, repeat(0)), and_, initial=active)))
    # chain[k]: the asked engines holding keys[:k]; len(chain) − 1 keys are held by someone
    regions: list[tuple[int, int]] = []
    start, end = 0, len(chain)
    while start < end:
        engines = chain[start]
        stop = bisect_right(chain, -engines.bit_count(), lo=start, key=_fewer_bits)  # first smaller set
        dropped = engines & ~chain[stop] if stop < end else engines
        if stop - 1 > 0 and dropped:
            regions.append((dropped, stop - 1))
        start = stop
    return plan.depths(regions)
