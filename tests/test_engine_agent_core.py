"""The engine-agent core's pure parts (`engine_agents.core`): what every engine kind reports the same way."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.engine_agents.core import (
    ExpertLoadWindow,
    StaticLayout,
    contiguous_ranks,
    expert_pressure,
    rank_of_expert,
    sampled,
)
from switchyard.engine_agents.core.layout import contiguous_layout
from switchyard.shared.errors import SchemaMismatch
from switchyard.shared.schemas import LayoutRequest, MigrateRequest
from tests.fleet_helpers import hello


def test_pressure_is_the_same_from_a_slot_layout_and_from_the_rank_map_it_implies() -> None:
    counts = np.arange(2 * 8, dtype=np.uint32).reshape(2, 8)
    layout = contiguous_layout(2, 8, 4)  # expert e on GPU e // 2
    by_layout = expert_pressure(counts, rank_of_expert(layout, 8), 4)
    assert by_layout == expert_pressure(counts, contiguous_ranks(8, 4), 4)
    per_rank = counts.reshape(2, 4, 2).sum(axis=2)  # the busiest rank over the mean, averaged over layers
    assert by_layout == pytest.approx(float((per_rank.max(axis=1) / per_rank.mean(axis=1)).mean()))
    assert expert_pressure(counts, contiguous_ranks(8, 1), 1) == 1.0  # one rank: balanced by definition
    assert expert_pressure(np.zeros((2, 8), np.uint32), contiguous_ranks(8, 4), 4) == 1.0  # no load


def test_a_replicated_expert_counts_on_its_lowest_rank_and_a_missing_one_is_refused() -> None:
    layout = np.array([[[0, 1], [1, 2]]])  # expert 1 on ranks 0 and 1
    assert rank_of_expert(layout, 3).tolist() == [[0, 0, 1]]
    with pytest.raises(ValueError, match="without a GPU"):
        rank_of_expert(layout, 4)


def test_a_window_takes_summed_counts_and_selections_alike() -> None:
    clock = iter([10.0, 11.0, 12.0]).__next__
    window = ExpertLoadWindow("e0", "g0", num_layers=1, num_experts=4, num_sources=1, clock=clock)
    window.add(np.array([[[0, 1]], [[1, 3]]]), np.zeros(2, np.int64))
    window.add_counts(np.array([[0, 0, 5, 0]]))
    assert window.counts.tolist() == [[1, 2, 5, 1]]
    first = window.flush()
    assert (first.seq, first.window_start, first.window_end) == (0, 10.0, 11.0)
    assert first.expert_counts.tolist() == [[1, 2, 5, 1]] and first.source_counts.shape == (1, 1, 4)
    assert window.flush().expert_counts.sum() == 0  # a new window starts empty


def test_a_static_layout_reports_its_boot_layout_and_refuses_every_step() -> None:
    slots = StaticLayout(hello("e0", "g0", ["a", "b"]), "this kind does not move experts")
    reply = slots.report(LayoutRequest(engine_group="g0"))
    assert reply.version == 0 and reply.layout.shape[1] == 2
    with pytest.raises(SchemaMismatch, match="engine_group"):
        slots.report(LayoutRequest(engine_group="g1"))
    step = MigrateRequest(plan_id="p", version=1, engine_group="g0", step=0, moves=np.zeros((0, 6), np.int32))
    refused = slots.apply(step)
    assert refused.applied == 0 and refused.failure == "this kind does not move experts"


def test_sampling_is_a_stable_share_of_request_ids() -> None:
    chosen = [sampled(f"req-{i}", 0.2) for i in range(5_000)]
    assert 0.18 < sum(chosen) / len(chosen) < 0.22
    assert not any(sampled(f"req-{i}", 0.0) for i in range(100)) and all(sampled(f"r{i}", 1.0) for i in range(100))
