"""Layout replies and refusals: how an engine answers `sy.engine.<id>.layout` and `.migrate`.

The control plane plans from the layout an engine group reports (`services/layout.py`), and sends
migrate steps only to groups whose hello says `migrates`. Every engine kind answers both subjects, so a
plan never waits on a timeout to learn that nobody listens:

- an engine that moves experts implements `ExpertSlots` (the simulated engines' `SimExpertGroup`);
- an engine that does not (the vLLM agent today, a new kind at first) uses `StaticLayout`: it reports the
  layout it booted with and refuses every step with a reason, so a plan fails cleanly with nothing moved.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

import numpy as np
from nats.aio.subscription import Subscription

from switchyard.shared.bus import Bus
from switchyard.shared.errors import SchemaMismatch
from switchyard.shared.schemas import Hello, LayoutReply, LayoutRequest, MigrateReply, MigrateRequest

__all__ = ["ExpertSlots", "StaticLayout", "check_group", "contiguous_layout", "serve_expert_slots"]


class ExpertSlots(Protocol):
    """An engine group's expert slots as the bus sees them (either method may be sync or async)."""

    def report(self, request: LayoutRequest) -> LayoutReply | Awaitable[LayoutReply]: ...

    def apply(self, request: MigrateRequest) -> MigrateReply | Awaitable[MigrateReply]: ...


def check_group(asked: str, own: str) -> None:
    """Refuse a layout question about another group (the reply is an `ErrorReply` naming `engine_group`)."""
    if asked != own:
        raise SchemaMismatch("engine_group", f"this engine belongs to group {own!r}")


def contiguous_layout(num_layers: int, num_experts: int, num_gpus: int) -> np.ndarray:
    """`[L, G, ⌈E/G⌉]` int32: expert e on GPU e // ⌈E/G⌉ in every layer, the boot layout of vLLM or SGLang
    without EPLB."""
    from switchyard.solver.placement import contiguous_slots  # imported on demand: it brings OR-Tools along

    gpus = max(num_gpus, 1)
    slots = -(-num_experts // gpus)
    return contiguous_slots(num_layers, num_experts, gpus, slots).astype(np.int32)


class StaticLayout:
    """The slots of an engine that does not move experts: its boot layout, and a refusal for every step.

    `layout` defaults to the contiguous layout of the hello's model over its GPUs, built on the first
    question (the control plane may never ask).
    """

    def __init__(self, hello: Hello, why: str, layout: np.ndarray | None = None) -> None:
        self.hello = hello
        self.why = why
        self._layout = layout

    @property
    def layout(self) -> np.ndarray:
        if self._layout is None:
            shape = self.hello.model
            self._layout = contiguous_layout(shape.num_layers, shape.num_experts, len(self.hello.gpus))
        return self._layout

    def report(self, request: LayoutRequest) -> LayoutReply:
        check_group(request.engine_group, self.hello.ep_group)
        return LayoutReply(engine_group=self.hello.ep_group, layout=self.layout, version=0)

    def apply(self, request: MigrateRequest) -> MigrateReply:
        return MigrateReply.refusal(request, self.why)


async def serve_expert_slots(bus: Bus, engine_id: str, slots: ExpertSlots) -> list[Subscription]:
    """Answer `sy.engine.<engine_id>.migrate` and `.layout` from `slots` (malformed requests get an ErrorReply)."""
    return [
        await bus.serve(bus.subjects.migrate(engine_id), MigrateRequest, slots.apply),  # type: ignore[arg-type]
        await bus.serve(bus.subjects.layout(engine_id), LayoutRequest, slots.report),  # type: ignore[arg-type]
    ]
