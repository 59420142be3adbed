"""The load generator's pacing: arrivals in order, ids unique, a repeating workload shifted by its span."""

from __future__ import annotations

import asyncio

import numpy as np

from switchyard.engine_agents.sim.live.loadgen import LoadGenerator
from switchyard.engine_agents.sim.live.protocol import SimSubmit
from switchyard.shared.bus import Bus
from switchyard.simulator.core.workload import Workload


def _workload(n: int, gap_s: float) -> Workload:
    return Workload(
        arrival=np.arange(n) * gap_s,
        prompt=np.full(n, 10),
        output=np.full(n, 5),
        replay=np.arange(n) % 3,
        description="test",
    )


async def test_repeat_cycles_the_workload_until_the_duration(bus: Bus) -> None:
    got: list[SimSubmit] = []
    await bus.subscribe(f"{bus.subjects.prefix}.sim.submit.*", SimSubmit, lambda m, _: got.append(m))
    loadgen = LoadGenerator(bus, _workload(4, 0.05), ["p0", "p1"], prefill_policy="hash")
    await loadgen.run(duration_s=0.52, repeat=True)  # ~0.19 s per cycle: cycles 0, 1 and 3 of cycle 2
    await bus.nc.flush()
    for _ in range(100):  # the subscription's callbacks run on their own task: let them catch up
        if len(got) >= loadgen.sent:
            break
        await asyncio.sleep(0.01)
    ids = [m.request_id for m in got]
    assert loadgen.sent == len(got) == 11 and len(set(ids)) == 11
    assert ids[:5] == ["load-0-0", "load-0-1", "load-0-2", "load-0-3", "load-1-0"]
    assert [m.replay for m in got[:4]] == [0, 1, 2, 0]


async def test_without_repeat_the_workload_is_sent_once(bus: Bus) -> None:
    loadgen = LoadGenerator(bus, _workload(3, 0.01), ["p0"])
    await loadgen.run()
    assert loadgen.sent == 3
