"""What a group runs now, gathered the same way by placement (where a plan starts) and migration (where the
moves start).

Both need the same three inputs of `solver.placement.layouts.current_layout`: the layout the group's
coordinator reports (`LayoutProbe`), the placement last applied (the database), and the boot layout of the
group's shape. Each service used to gather them itself, with different defaults; here they are gathered once:
`recorded` reads the database inside the caller's session, `layout_now` applies the rule with the one default.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from sqlalchemy.ext.asyncio import AsyncSession

from switchyard.services.history import applied_placement, load_layout
from switchyard.shared.db.models import Placement
from switchyard.shared.schemas import LayoutReply
from switchyard.solver.placement.layouts import LayoutSource, current_layout, default_layout


class GroupShape(NamedTuple):
    """The shape of a group's slot map and how many experts it places (what its boot layout needs)."""

    num_layers: int
    num_experts: int
    num_gpus: int
    slots_per_gpu: int

    @classmethod
    def of(cls, layout: np.ndarray) -> GroupShape:
        """The shape of `layout` `[L, G, slots]`, placing experts 0..its largest id."""
        num_layers, num_gpus, slots = layout.shape
        return cls(num_layers, int(layout.max()) + 1, num_gpus, slots)

    def boot_layout(self) -> np.ndarray:
        """What such a group runs before any placement: vLLM's contiguous layout."""
        return default_layout(self.num_layers, self.num_experts, self.num_gpus, self.slots_per_gpu)


class Recorded(NamedTuple):
    """The database's word: the placement last applied and its layout (both None before any)."""

    applied: Placement | None
    layout: np.ndarray | None


class LayoutNow(NamedTuple):
    layout: np.ndarray
    source: LayoutSource
    #: What the database says the group runs: the applied layout, else the boot layout of its shape.
    recorded: np.ndarray


async def recorded(session: AsyncSession, group: str) -> Recorded:
    applied = await applied_placement(session, group)
    return Recorded(applied, await load_layout(session, applied) if applied is not None else None)


def layout_now(reported: LayoutReply | None, record: Recorded, shape: GroupShape) -> LayoutNow:
    """The layout the group runs now and where it came from: the engines' report (only of the group's
    `(L, G)`), else the applied placement, else the boot layout of `shape`."""
    on_record = record.layout if record.layout is not None else shape.boot_layout()
    layout, source = current_layout(
        reported.layout if reported is not None else None,
        record.layout,
        lambda: on_record,
        shape=(shape.num_layers, shape.num_gpus),
    )
    return LayoutNow(layout, source, on_record)
