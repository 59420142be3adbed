"""The simulator's one scheduling core: its O(1) decode-only fast path makes the general path's decisions, and
the event loop's tie rule is the one both front ends rely on."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.shared.routing_trace import RoutingTrace, split_phases
from switchyard.simulator.core.experts import ReplayBank
from switchyard.simulator.core.loop import ARRIVAL, EventLoop
from switchyard.simulator.core.physics import cost_model
from switchyard.simulator.core.xpyd_engines import DecodeEngine
from tests.eldr_helpers import random_experts


def _bank(seed: int, requests: int = 16) -> ReplayBank:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 30, requests)
    req = np.repeat(np.arange(requests), lengths)
    trace = RoutingTrace.from_arrays(random_experts(rng, len(req), 26, 64, 6), req, 64)
    return ReplayBank.from_trace(split_phases(trace, 0.5))


def _run(fast: bool, seed: int, kv_blocks: int, max_running: int) -> list[tuple[object, ...]]:
    """Every step's plan and output, with requests (some without their prompt's KV) arriving over time."""
    bank = _bank(seed)
    engine = DecodeEngine(cost_model("deepseek-v2-lite", "H100"), bank, max_running=max_running, kv_blocks=kv_blocks)
    engine.fast = fast
    rng = np.random.default_rng(seed + 100)
    pending = [
        (int(rng.integers(0, 10)), rid, int(rng.integers(bank.num_requests)), int(rng.integers(1, 90)))
        for rid in range(40)
    ]
    pending.sort()
    log: list[tuple[object, ...]] = []
    step = 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            _, rid, replay, prompt = pending.pop(0)
            engine.add(rid, replay, prompt, int(rng.integers(1, 40)), recompute=rid % 3 == 0)
        plan = engine.begin_step()
        if plan is not None:
            assert engine.used_blocks == engine.blocks_held() <= engine.kv_blocks
            out = engine.end_step()
            assert engine.used_blocks == engine.blocks_held()
            log.append(
                (
                    plan.duration,
                    plan.batch,
                    plan.distinct_sum,
                    plan.kv_tokens,
                    plan.recompute_tokens,
                    tuple(plan.admitted),
                    tuple(plan.preempted),
                    tuple(sorted(out.first)),
                    tuple(sorted(zip(out.finished, out.finished_tokens, strict=True))),
                )
            )
        step += 1
        assert step < 100_000, "the engine never drained"
    return log


@pytest.mark.parametrize(("seed", "kv_blocks", "max_running"), [(0, 20, 8), (1, 400, 32), (2, 12, 64)])
def test_fast_path_is_the_general_scheduler(seed: int, kv_blocks: int, max_running: int) -> None:
    fast = _run(True, seed, kv_blocks, max_running)
    general = _run(False, seed, kv_blocks, max_running)
    assert fast == general
    assert any(step[6] for step in fast) or kv_blocks > 100, "a tight KV cache must exercise preemption"


def test_event_loop_puts_arrivals_first_then_push_order() -> None:
    loop = EventLoop()
    loop.push(1.0, 0, 7)
    loop.push(1.0, 2, 8)
    loop.push(0.5, 1, 9)
    seen = []
    for now, kind, index in loop.events(np.array([0.5, 1.0, 2.0])):
        seen.append((now, kind, index))
        if (kind, index) == (ARRIVAL, 2):
            loop.push(2.0, 0, 10)  # at the same instant as the handled arrival: still next
    assert seen == [
        (0.5, ARRIVAL, 0),
        (0.5, 1, 9),
        (1.0, ARRIVAL, 1),
        (1.0, 0, 7),
        (1.0, 2, 8),
        (2.0, ARRIVAL, 2),
        (2.0, 0, 10),
    ]


def test_the_simulated_router_grace_is_the_router_default() -> None:
    from switchyard.services.router.settings import RouterSettings
    from switchyard.simulator.core.defaults import INFLIGHT_GRACE_S

    assert RouterSettings.model_fields["inflight_grace_s"].default == INFLIGHT_GRACE_S
