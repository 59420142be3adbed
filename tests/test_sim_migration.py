"""The simulated engines' migration model and load windows, spoken to over a real NATS server."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest

from switchyard.engine_agents.sim.live.migration import (
    ExpertLoadWindow,
    MigrationCost,
    SimExpertGroup,
    expert_load_counts,
    serve_migrate,
)
from switchyard.services.migration.planner import plan_steps
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode, decode_reply, encode
from switchyard.shared.errors import RemoteError
from switchyard.shared.schemas import ExpertLoad, MigrateReply, MigrateRequest
from switchyard.solver.placement.layouts import default_layout

BASE = default_layout(4, 4, 2)  # every layer [[0, 1], [2, 3]]
SWAPPED = BASE.copy()
SWAPPED[0] = [[2, 1], [0, 3]]
SWAP = plan_steps(BASE, SWAPPED)[0]  # layer 0: experts 0 and 2 trade GPUs, through the scratch slot


def _request(step: int = 0, moves: np.ndarray = SWAP, version: int = 1, plan_id: str = "p1") -> MigrateRequest:
    return MigrateRequest(plan_id=plan_id, version=version, engine_group="g0", step=step, moves=moves)


def _group(**cost: float) -> SimExpertGroup:
    return SimExpertGroup("g0", default_layout(4, 4, 2), MigrationCost(time_scale=0.0, **cost))


def test_a_full_rearrangement_costs_what_gimbal_measured() -> None:
    cost = MigrationCost()
    layers = 48
    first = sum(cost.step_seconds(layers, first=(step == 0)) for step in range(layers))
    later = sum(cost.step_seconds(layers, first=False) for _ in range(layers))
    assert first == pytest.approx(1.08) and later == pytest.approx(0.72)


async def test_steps_apply_once_over_nats_and_duplicates_get_the_first_answer(bus: Bus) -> None:
    group = _group()
    await serve_migrate(bus, "e0", group)
    subject = bus.subjects.migrate("e0")
    first = await bus.request(subject, _request(), MigrateReply, timeout=2)
    again = await bus.request(subject, _request(), MigrateReply, timeout=2)
    assert first == again and first.applied == len(SWAP) and first.failure is None
    assert group.layout[0].tolist() == [[2, 1], [0, 3]]
    assert group.applied_keys() == [("p1", 0)] and group.requests == 2
    assert first.duration_s == pytest.approx(MigrationCost().step_seconds(4, first=True))
    again_as_new_step = await bus.request(subject, _request(step=1), MigrateReply)
    assert "does not hold it" in again_as_new_step.failure  # the swap's sources moved on
    assert group.layout[0].tolist() == [[2, 1], [0, 3]]


async def test_bad_steps_are_refused_and_leave_the_slots_alone(bus: Bus) -> None:
    group = _group()
    await serve_migrate(bus, "e0", group)
    subject = bus.subjects.migrate("e0")
    wrong_source = np.array([[1, 3, 0, 0, 1, 1]], dtype=np.int32)
    reply = await bus.request(subject, _request(moves=wrong_source), MigrateReply)
    assert reply.applied == 0 and "source slot (0, 0) does not hold it" in reply.failure
    other = MigrateRequest(plan_id="p1", version=1, engine_group="g9", step=1, moves=SWAP)
    assert "not 'g9'" in (await bus.request(subject, other, MigrateReply)).failure
    np.testing.assert_array_equal(group.layout, default_layout(4, 4, 2))
    assert group.applications == []
    await bus.request(subject, _request(step=2, version=5), MigrateReply)
    stale = await bus.request(subject, _request(step=0, version=4, plan_id="old"), MigrateReply)
    assert "stale plan: version 4 < applied version 5" in stale.failure
    assert group.applied_keys() == [("p1", 2)]
    raw = msgpack.packb({"v": 1, "plan_id": "x", "version": 1, "engine_group": "g0", "step": 0, "moves": {}})
    msg = await bus.nc.request(subject, raw, timeout=2)
    with pytest.raises(RemoteError) as info:  # malformed moves: an ErrorReply naming the field
        decode_reply(msg.data, MigrateReply)
    assert (info.value.code, info.value.field) == ("array", "moves")


async def test_engines_run_slower_while_a_step_is_in_flight() -> None:
    release = asyncio.Event()
    entered = asyncio.Event()

    async def held_sleep(_seconds: float) -> None:
        entered.set()
        await release.wait()

    group = SimExpertGroup("g0", default_layout(1, 4, 2), MigrationCost(slowdown=3.0), sleep=held_sleep)
    assert group.step_time_factor == 1.0
    first = asyncio.create_task(group.apply(_request()))
    await entered.wait()
    duplicate = asyncio.create_task(group.apply(_request()))  # a retry while the step is still in flight
    await asyncio.sleep(0)
    assert group.migrating and group.step_time_factor == 3.0
    assert group.layout[0].tolist() == [[0, 1], [2, 3]]  # not applied until the step completes
    release.set()
    assert (await first) == (await duplicate)
    assert group.step_time_factor == 1.0 and group.layout[0].tolist() == [[2, 1], [0, 3]]
    assert group.applied_keys() == [("p1", 0)]


def test_load_counts_per_source_rank() -> None:
    # 3 tokens, 2 layers, top-2, 4 experts; tokens 0 and 1 came from DP rank 0, token 2 from rank 1.
    selections = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 1]], [[3, 0], [1, 2]]])
    sources = np.array([0, 0, 1])
    a, b = expert_load_counts(selections, sources, num_experts=4, num_sources=2)
    assert a.shape == (2, 2, 4) and a.dtype == np.uint32
    assert a[0].tolist() == [[2, 1, 1, 0], [1, 0, 0, 1]]
    assert a[1].tolist() == [[0, 1, 2, 1], [0, 1, 1, 0]]
    assert b.tolist() == [[3, 1, 1, 1], [0, 2, 3, 1]]
    assert b.sum() == selections.size
    with pytest.raises(ValueError, match="source ranks"):
        expert_load_counts(selections, np.array([0, 0, 2]), num_experts=4, num_sources=2)


def test_load_window_emits_valid_messages_with_increasing_seq() -> None:
    now = iter([10.0, 11.0, 12.5])
    window = ExpertLoadWindow("e0", "g0", num_layers=2, num_experts=4, num_sources=2, clock=lambda: next(now))
    window.add(np.array([[[0, 1], [2, 3]]]), np.array([1]))
    window.add(np.array([[[0, 3], [2, 1]]]), np.array([0]))
    first = decode(encode(window.flush()), ExpertLoad)
    assert (first.seq, first.window_start, first.window_end) == (0, 10.0, 11.0)
    assert first.expert_counts.tolist() == [[2, 1, 0, 1], [0, 1, 2, 1]]
    assert first.source_counts[:, 1].tolist() == [[1, 1, 0, 0], [0, 0, 1, 1]]
    second = window.flush()
    assert (second.seq, second.window_start, int(second.expert_counts.sum())) == (1, 11.0, 0)
