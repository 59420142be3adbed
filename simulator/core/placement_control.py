"""Where the experts of a simulated DP+EP fleet live, and who decides when they move.

A DP+EP simulation (`offline.dp`, lock-step fleet) asks a `PlacementControl` for the layout in force, feeds it
every step's expert selections by source DP engine (the window a real placement service reads from the
engines' `ExpertLoad` reports), and asks it at every telemetry tick whether to move. A move is executed by the
simulation, which prices it (the steps it pauses or slows) and tells the control when it is applied. So the
three placements the seed compares are three controls over one fleet model:

- ``none``: vLLM's default contiguous layout, never moved (`StaticPlacement`);
- ``eplb``: load-only rebalancing on a period, as vLLM's EPLB does;
- ``gimbal``: the placement service's online greedy (calibrated weights, source-aware communication,
  migration cost) on the service's own trigger rules.

Layouts are slot maps ``[L, G, slots]`` (expert id per slot, -1 empty), as plans, engines and the database
hold them (`solver.placement`). No clock and no I/O here: the simulation passes times in.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from switchyard.solver.placement.layouts import default_layout

__all__ = ["PlacementControl", "StaticPlacement"]


class PlacementControl(Protocol):
    """The placement policy of one simulated EP group (see the module docstring)."""

    name: str

    def layout(self) -> np.ndarray:
        """The slot map in force, `[L, G, slots]` int32."""
        ...

    def observe(self, now: float, load: np.ndarray, running: int = 0, waiting: int = 0) -> None:
        """One step's expert selections, `[L, S, E]` float: tokens of source DP engine s routed to expert e;
        with the requests running and waiting (not admitted) at the group's engines in that step."""
        ...

    def replan(self, now: float) -> np.ndarray | None:
        """A slot map to migrate to now, or None. Not called again until the simulation calls `applied`."""
        ...

    def applied(self, now: float, layout: np.ndarray) -> None:
        """The migration to `layout` finished at `now`: it is the layout in force from now on."""
        ...


class StaticPlacement:
    """A layout that never moves: vLLM's contiguous default unless one is given (placement ``none``)."""

    name = "none"

    def __init__(self, num_layers: int, num_experts: int, num_gpus: int, layout: np.ndarray | None = None) -> None:
        self._layout = default_layout(num_layers, num_experts, num_gpus) if layout is None else np.asarray(layout)

    def layout(self) -> np.ndarray:
        return self._layout

    def observe(self, now: float, load: np.ndarray, running: int = 0, waiting: int = 0) -> None:
        return None

    def replan(self, now: float) -> np.ndarray | None:
        return None

    def applied(self, now: float, layout: np.ndarray) -> None:
        self._layout = np.asarray(layout)
