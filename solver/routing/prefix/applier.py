"""One way to apply an engine's KV-cache events to a `BlockIndex`, for the router and the gateway alike.

An engine numbers its KV-event messages as it numbers its telemetry, and the one sequence rule reads them
(`shared.sequence.classify`): a late message (a small step back) is dropped, since newer events are already in;
a gap (events lost) or a restart (a new process numbering from 0, with an empty cache) clears the engine's
blocks before the message applies, because lost evictions must not leave blocks it no longer holds. Every
block an engine stores in its KV cache is bounded by the capacity its hello announced (`BlockIndex.stored`); an
op naming an offload tier (`KvOp.tier`: cpu, disk) goes to that tier's blocks, bounded per engine by the index's
`max_blocks`; a clear clears every tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from switchyard.shared.sequence import Seq, classify
from switchyard.solver.routing.prefix.blocks import BlockIndex
from switchyard.solver.routing.prefix.tiers import Tier

__all__ = ["Applied", "KvApplier"]


class _Op(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def keys(self) -> np.ndarray: ...
    @property
    def tier(self) -> Tier | None: ...


class _Events(Protocol):
    """What the applier reads of a `KvEvents` message."""

    @property
    def engine_id(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def ops(self) -> Sequence[_Op]: ...


class Applied(NamedTuple):
    """What one message did: its place in the engine's sequence (LATE: nothing applied; GAP or RESTART: the
    engine's blocks were cleared first), and the keys it stored and removed, and the clears it asked for."""

    event: Seq
    stored: int = 0
    removed: int = 0
    cleared: int = 0


class KvApplier:
    def __init__(self, blocks: BlockIndex) -> None:
        self.blocks = blocks
        self._seq: dict[str, int] = {}  # engine -> the last KV-event seq applied

    def reports(self, engine_id: str) -> bool:
        """Whether the engine's events are being applied (its sequence is followed)."""
        return engine_id in self._seq

    def last(self, engine_id: str) -> int | None:
        """The last sequence number applied for the engine (None: none followed)."""
        return self._seq.get(engine_id)

    def engines(self) -> set[str]:
        return set(self._seq)

    def apply(self, events: _Events, capacity: int | None = None) -> Applied:
        """Apply one message whose sender the caller has checked, the engine's blocks at most `capacity`."""
        engine_id = events.engine_id
        event, _missed = classify(self._seq.get(engine_id), events.seq)
        if event is Seq.LATE:
            return Applied(event)
        if event is Seq.GAP or event is Seq.RESTART:
            self.blocks.cleared(engine_id)
        self._seq[engine_id] = events.seq
        stored = removed = cleared = 0
        for op in events.ops:
            if op.kind == "stored":
                self.blocks.stored(engine_id, op.keys.tolist(), capacity, op.tier or "gpu")
                stored += len(op.keys)
            elif op.kind == "removed":
                self.blocks.removed(engine_id, op.keys.tolist(), op.tier or "gpu")
                removed += len(op.keys)
            else:
                self.blocks.cleared(engine_id)
                cleared += 1
        return Applied(event, stored, removed, cleared)

    def restart(self, engine_id: str) -> bool:
        """The engine's blocks are unknown (a message of its was dropped, or it was quarantined): they go, and its
        next message starts afresh. Whether its sequence was being followed."""
        followed = self._seq.pop(engine_id, None) is not None
        self.blocks.cleared(engine_id)
        return followed

    def forget(self, engine_id: str) -> None:
        """The engine is gone: its sequence and blocks go."""
        self._seq.pop(engine_id, None)
        self.blocks.forget(engine_id)
