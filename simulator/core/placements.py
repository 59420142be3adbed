"""The placement controls a DP+EP simulation can run, by name (`switchyard sim-dp --placement`).

Every factory takes ``(num_layers, num_experts, num_gpus, tp, **options)`` and returns a fresh
`PlacementControl`. ``none`` (vLLM's contiguous layout, never moved) lives here; the moving controls
(``eplb``, ``gimbal``, …) come from `simulator.core.placement_loop`'s ``PLACEMENT_CONTROLS`` when that module
exists, imported on first use so this module stays free of the solver's heavier imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from switchyard.simulator.core.placement_control import PlacementControl, StaticPlacement

__all__ = ["PlacementFactory", "make_placement", "placement_names"]

PlacementFactory = Callable[..., PlacementControl]

#: Modules whose ``PLACEMENT_CONTROLS`` dict (name → factory) joins the registry, in order.
_PROVIDERS = ("switchyard.simulator.core.placement_loop",)


def _static(num_layers: int, num_experts: int, num_gpus: int, tp: int = 1, **options: object) -> PlacementControl:
    """``none``: the layout never moves (`options` may give one: ``layout=[L, G, slots]``)."""
    return StaticPlacement(num_layers, num_experts, num_gpus, **options)  # type: ignore[arg-type]


_BUILTIN: dict[str, PlacementFactory] = {"none": _static}


def _registry() -> dict[str, PlacementFactory]:
    registry = dict(_BUILTIN)
    for name in _PROVIDERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the provider exists but one of its imports is missing: a real error
                raise
            continue
        registry.update(module.PLACEMENT_CONTROLS)
    return registry


def placement_names() -> tuple[str, ...]:
    """Every registered placement control's name."""
    return tuple(_registry())


def make_placement(
    name: str, num_layers: int, num_experts: int, num_gpus: int, tp: int = 1, **options: object
) -> PlacementControl:
    """A fresh control `name` for an EP group of `num_gpus` ranks (DP engines of `tp` ranks each)."""
    registry = _registry()
    if name not in registry:
        raise ValueError(f"unknown placement {name!r}; choose from {', '.join(registry)}")
    return registry[name](num_layers, num_experts, num_gpus, tp, **options)
