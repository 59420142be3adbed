"""The discrete-event loop every offline front end runs on: a time-ordered heap merged with sorted arrivals.

One rule for ties, so that the xPyD and DP front ends order simultaneous events the same way: an arrival is
handled before any scheduled event at the same instant (a request that arrives as a step ends is queued
before the next step is formed), and scheduled events at one instant keep the order they were pushed in.
The front ends keep their handlers; the loop only decides what happens next.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import numpy as np

__all__ = ["ARRIVAL", "EventLoop"]

#: The kind `EventLoop.events` yields for an arrival (its index is the request's); front-end kinds are ≥ 0.
ARRIVAL = -1


class EventLoop:
    """Scheduled events ``(time, kind, index)`` on a heap; `events` interleaves them with the arrivals."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0  # push order: breaks ties between events at one instant

    def push(self, t: float, kind: int, index: int) -> None:
        heapq.heappush(self._heap, (t, self._seq, kind, index))
        self._seq += 1

    def events(self, arrival: np.ndarray) -> Iterator[tuple[float, int, int]]:
        """Yield ``(now, kind, index)`` in time order until no arrival and no event is left.

        `arrival` is sorted; arrival i comes as ``(arrival[i], ARRIVAL, i)``. Events pushed while a yielded
        one is handled take part in the very next choice. The caller stops when its work is done (periodic
        events, such as telemetry, never run out by themselves).
        """
        heap = self._heap
        pop = heapq.heappop
        n = len(arrival)
        nxt = 0
        while True:
            if nxt < n and (not heap or arrival[nxt] <= heap[0][0]):
                i = nxt
                nxt += 1
                yield float(arrival[i]), ARRIVAL, i
            elif heap:
                t, _, kind, index = pop(heap)
                yield t, kind, index
            else:
                return
