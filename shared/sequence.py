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


#: Late messages are at most this many behind: NATS keeps one publisher's order, so a step back at all
#: needs a reconnect. A bigger step back is a restart (or a forged jump forward before it, which must not
#: make the engine's real messages "late" until its counter catches up: one forged +300 silenced an engine
#: for 30 s), so it is accepted and the consumer starts over from it.
MAX_REORDER = 32


def classify(last: int | None, seq: int) -> tuple[Seq, int]:
    """What `seq` means after `last` (None: nothing accepted yet), and how many messages were missed.

    A step back counts as a restart when it lands below half of `last` or more than `MAX_REORDER` back.
    """
    if last is None or last < 0:
        return Seq.FIRST, 0
    if seq == last + 1:
        return Seq.NEXT, 0
    if seq > last:
        return Seq.GAP, seq - last - 1
    if seq < max(last // 2, last - MAX_REORDER):
        return Seq.RESTART, 0
    return Seq.LATE, 0
