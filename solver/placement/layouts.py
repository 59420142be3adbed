"""Which slot map a group runs: its default before any placement, and the one rule for "the current layout".

A slot map is `[L, G, slots]` int32, the expert id in each slot (-1: empty). The placement service (where a
plan starts from) and the migration service (where the moves start from) both ask "what does this group
run now?" and must answer alike, so the rule lives here, once:

1. what the group's engines report (`sy.engine.<id>.layout`): after a restart they run their boot layout
   again, and an operator may have moved experts by hand;
2. else the placement last *applied* (the database's record);
3. else the default the engines boot with: vLLM's contiguous layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np

from switchyard.solver.placement.problem import contiguous_slots

LayoutSource = Literal["engines", "database", "default"]


def default_layout(num_layers: int, num_experts: int, num_gpus: int, slots_per_gpu: int | None = None) -> np.ndarray:
    """What a group runs before Switchyard applied anything: vLLM's contiguous layout (expert e on GPU e // ⌈E/G⌉).

    `[num_layers, num_gpus, slots_per_gpu]` int32; `slots_per_gpu` defaults to ⌈E/G⌉ (no spare slot).
    """
    slots = -(-num_experts // num_gpus) if slots_per_gpu is None else slots_per_gpu
    return contiguous_slots(num_layers, num_experts, num_gpus, slots).astype(np.int32)


def default_layout_like(layout: np.ndarray) -> np.ndarray:
    """The default layout a group of `layout`'s shape `[L, G, slots]` ran before any placement (experts 0..max id)."""
    num_layers, num_gpus, slots = layout.shape
    return default_layout(num_layers, int(layout.max()) + 1, num_gpus, slots)


def current_layout(
    reported: np.ndarray | None,
    applied: np.ndarray | None,
    default: Callable[[], np.ndarray],
    shape: tuple[int, int] | None = None,
) -> tuple[np.ndarray, LayoutSource]:
    """The layout a group runs now, and where it came from (see the module docstring for the order).

    reported: `[L, G, slots]` from the group's coordinator, or None when no engine answered; with `shape`
    given, a report of other `(L, G)` is not believed (an engine of another model or group size).
    applied: the placement last applied, or None when the group was never placed.
    default: builds the boot layout; called only when neither of the others is there.
    """
    if reported is not None and (shape is None or tuple(reported.shape[:2]) == tuple(shape)):
        return reported, "engines"
    if applied is not None:
        return applied, "database"
    return default(), "default"
