"""Placements a vLLM can load: the physical→logical expert map of vLLM PR #49572 (`eplb_config.
initial_expert_map_path`), checked against the PR's own examples and rules, round-tripped from a real placement,
and served by the history API and `switchyard placement-export` from a real database."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from typer.testing import CliRunner

from switchyard.cli import app
from switchyard.services.history import add_placement
from switchyard.shared.db import create_async_db, upgrade
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.streams import stream
from switchyard.solver.placement import DEFAULT_PARAMS, PlacementProblem, place
from switchyard.solver.placement.errors import PlacementError
from switchyard.solver.placement.layouts import default_layout
from switchyard.solver.placement.vllm_map import from_expert_map, to_expert_map
from tests.fleet_helpers import plan
from tests.test_api import api_server

#: The PR description's two examples (num_physical_experts = 6, num_logical_experts = 4).
PR_SHARED = [0, 1, 2, 3, 0, 1]
PR_PER_LAYER = [[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 2]]


def test_the_prs_examples_read_as_slot_maps_over_the_ep_ranks() -> None:
    shared = from_expert_map(PR_SHARED, num_gpus=2, num_layers=2)
    assert shared.shape == (2, 2, 3) and shared[1].tolist() == [[0, 1, 2], [3, 0, 1]]  # rank r: slots [3r, 3r+3)
    per_layer = from_expert_map(PR_PER_LAYER, num_gpus=3)
    assert per_layer[1].tolist() == [[3, 2], [1, 0], [3, 2]]
    assert to_expert_map(per_layer) == PR_PER_LAYER


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3]], "different numbers"),
        ([0, 1, 2, 3, 0], "do not divide"),
        ([[0, 1, 2, 0, 0, 1]], "logical expert 3 has no physical slot"),
        ([[0, 1, 2, -1, 0, 1]], "must lie in"),
        ([[0, 1, 2, 3, True, 1]], "integers"),
        ([[0, 1], 2], "list of ints or a list of lists"),
        ([], "non-empty"),
    ],
)
def test_what_vllm_would_refuse_is_refused(bad: object, why: str) -> None:
    with pytest.raises(PlacementError, match=why):
        from_expert_map(bad, num_gpus=2, num_layers=None if why == "different numbers" else 1, num_experts=4)


def test_a_placement_with_replicas_round_trips_through_json() -> None:
    rng = stream(0, "test.vllm_map.load")
    load = rng.gamma(0.5, 100.0, size=(3, 16)) + 1.0
    current = default_layout(3, 16, 4, slots_per_gpu=5)  # 4 empty slots per layer until replicas fill them
    problem = PlacementProblem.from_counts(load, 4, 5, current=current, redundant_slots=4)
    layout = place(problem, DEFAULT_PARAMS)
    assert (layout >= 0).all() and len(np.unique(layout[0])) == 16  # every slot filled, replicas among them
    text = json.dumps(to_expert_map(layout))
    back = from_expert_map(json.loads(text), num_gpus=4, num_layers=3, num_experts=16)
    assert np.array_equal(back, layout)
    with pytest.raises(PlacementError, match="empty"):
        to_expert_map(current)  # the empty slots: vLLM has no such physical expert


@pytest.fixture
def db_settings(settings: SwitchyardSettings, database_url: str) -> SwitchyardSettings:
    upgrade(database_url)
    return settings.model_copy(update={"database_url": database_url})


@pytest.fixture
async def sessions(db_settings: SwitchyardSettings) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine, factory = create_async_db(db_settings.resolved_database_url())
    yield factory
    await engine.dispose()


async def test_the_api_and_the_cli_export_a_recorded_placement(
    db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession], tmp_path: Path
) -> None:
    layout = default_layout(2, 8, 2)[:, ::-1, :].copy()  # the two GPUs' experts swapped
    async with sessions() as session, session.begin():
        stored = await add_placement(session, plan("g0", 1, layout), "applied")
        rejected = await add_placement(session, plan("g0", 2, layout), "rejected", store_layout=False)
    async with api_server(db_settings) as client:
        ok = await client.get(f"/v1/placements/{stored.id}/expert-map")
        assert ok.status_code == 200 and ok.json() == to_expert_map(layout)
        assert ok.json()[0] == [4, 5, 6, 7, 0, 1, 2, 3]
        assert (await client.get(f"/v1/placements/{rejected.id}/expert-map")).status_code == 409
        assert (await client.get("/v1/placements/999/expert-map")).status_code == 404
        summary = (await client.get(f"/v1/placements/{stored.id}")).json()
        assert summary["predicted_saving_s"] is None and "measured_saving_s" in summary
    out = tmp_path / "map.json"
    url = db_settings.resolved_database_url()
    invoke = CliRunner().invoke  # in a thread: the command runs its own event loop
    result = await asyncio.to_thread(
        invoke, app, ["placement-export", str(stored.id), "--database-url", url, "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert np.array_equal(from_expert_map(json.loads(out.read_text()), num_gpus=2, num_experts=8), layout)
    missing = await asyncio.to_thread(invoke, app, ["placement-export", "999", "--database-url", url])
    assert missing.exit_code == 2 and "no placement 999" in missing.output
