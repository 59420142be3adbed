"""The placement controls a DP+EP simulation can run, by name (`switchyard sim-dp --placement`).

Every factory takes ``(num_layers, num_experts, num_gpus, tp, **options)`` and returns a fresh
`PlacementControl`: ``none`` (vLLM's contiguous layout, never moved), ``eplb``, ``gimbal`` and its variants
(`simulator.core.placement_loop`). Options every control accepts: ``ranks_per_node`` (GPUs per NVLink domain)
and ``nvlink_cost`` (a token over NVLink as a fraction of one over the network); the rest are the classes'
own keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable

from switchyard.simulator.core.placement_control import PlacementControl
from switchyard.simulator.core.placement_loop import PLACEMENT_CONTROLS

__all__ = ["PlacementFactory", "make_placement", "placement_names"]

PlacementFactory = Callable[..., PlacementControl]


def placement_names() -> tuple[str, ...]:
    """Every registered placement control's name."""
    return tuple(PLACEMENT_CONTROLS)


def make_placement(
    name: str, num_layers: int, num_experts: int, num_gpus: int, tp: int = 1, **options: object
) -> PlacementControl:
    """A fresh control `name` for an EP group of `num_gpus` ranks (DP engines of `tp` ranks each)."""
    factory = PLACEMENT_CONTROLS.get(name)
    if factory is None:
        raise ValueError(f"unknown placement {name!r}; choose from {', '.join(PLACEMENT_CONTROLS)}")
    return factory(num_layers, num_experts, num_gpus, tp, **options)
