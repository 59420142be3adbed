"""A recorded placement as vLLM's proposed initial expert map (`solver.placement.vllm_map`), for the history API
(`GET /v1/placements/{id}/expert-map`) and `switchyard placement-export`."""

from __future__ import annotations

import json

from sqlalchemy.ext.asyncio import AsyncSession

from switchyard.services.history import load_layout
from switchyard.shared.db import Placement
from switchyard.solver.placement.errors import PlacementError
from switchyard.solver.placement.vllm_map import to_expert_map

__all__ = ["ExpertMapUnavailable", "expert_map", "expert_map_json"]


class ExpertMapUnavailable(LookupError):
    """No such placement (`missing`), or it has no layout vLLM can load (a rejected plan, an empty slot)."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


async def expert_map(session: AsyncSession, placement_id: int) -> list[list[int]]:
    """Placement `placement_id`'s per-layer physical→logical map (raises `ExpertMapUnavailable`)."""
    row = await session.get(Placement, placement_id)
    if row is None:
        raise ExpertMapUnavailable(f"no placement {placement_id}", missing=True)
    if not row.details.get("layout_stored", True):
        raise ExpertMapUnavailable(f"placement {placement_id} was rejected and has no stored layout")
    try:
        return to_expert_map(await load_layout(session, row))
    except PlacementError as exc:
        raise ExpertMapUnavailable(f"placement {placement_id}: {exc}") from None


def expert_map_json(rows: list[list[int]]) -> str:
    """The file vLLM reads: one line per MoE layer, so a diff of two maps reads layer by layer."""
    return "[\n" + ",\n".join("  " + json.dumps(row) for row in rows) + "\n]\n"
