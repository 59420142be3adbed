"""`switchyard placement-export`: a recorded placement as the expert map a vLLM loads at start.

A command of its own, beside `switchyard placement` (which runs the placement service), so that name keeps its
meaning. It reads the history database directly: no API needs to run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from switchyard.cli.options import DatabaseUrl, DataDir, load_settings

__all__ = ["placement_export"]


def placement_export(
    placement_id: Annotated[int, typer.Argument(min=1, help="The placement's id (GET /v1/placements lists them).")],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write the map to this file (default: standard output).")
    ] = None,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Export a recorded placement as vLLM's initial expert map (eplb_config.initial_expert_map_path, PR #49572).

    One physical-to-logical list per MoE layer, physical slots in EP-rank order; docs/vllm-agent.md says what a
    vLLM needs to load it. Exit 2 if the placement does not exist or has no loadable layout.
    """
    import asyncio

    from switchyard.services.expert_map import ExpertMapUnavailable, expert_map, expert_map_json
    from switchyard.shared.db import create_async_db

    settings = load_settings(None, database_url, data_dir)

    async def read() -> list[list[int]]:
        engine, sessions = create_async_db(settings.resolved_database_url())
        try:
            async with sessions() as session:
                return await expert_map(session, placement_id)
        finally:
            await engine.dispose()

    try:
        rows = asyncio.run(read())
    except ExpertMapUnavailable as exc:
        typer.echo(f"switchyard placement-export: error: {exc}", err=True)
        raise typer.Exit(2) from None
    text = expert_map_json(rows)
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {len(rows)} layers x {len(rows[0])} physical experts to {out}", err=True)
