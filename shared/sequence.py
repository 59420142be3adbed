"""How a consumer reads an engine's telemetry sequence numbers (one rule for every service).

Engines number their telemetry from 0 at every start and add one per message. A consumer that knows the
last number it accepted can therefore tell the next message, lost messages (a jump forward), a message
that arrived late (a small step back: drop it, newer data is already in), and an engine restart (a big
step back: the engine starts over, and what the consumer derived from its old run is void).
"""

from __future__ import annotations

from enum import Enum


class Seq(Enum):
    FIRST = "first"
    NEXT = "next"
    GAP = "gap"
    LATE = "late"
    RESTART = "restart"


def classify(last: int | None, seq: int) -> tuple[Seq, int]:
    """What `seq` means after `last` (None: nothing accepted yet), and how many messages were missed.

    A step back counts as a restart when it lands below half of `last` or more than 1,000 back: late
    messages over NATS are reordered by a few, never by that much.
    """
    if last is None or last < 0:
        return Seq.FIRST, 0
    if seq == last + 1:
        return Seq.NEXT, 0
    if seq > last:
        return Seq.GAP, seq - last - 1
    if seq < max(last // 2, last - 1000):
        return Seq.RESTART, 0
    return Seq.LATE, 0
