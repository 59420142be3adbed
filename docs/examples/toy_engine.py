"""A toy engine kind on the engine-agent core: all a new kind writes (docs/architecture.md, "How to add an
engine kind"). `tests/test_engine_kind_example.py` runs it against a real nats-server and a real router."""

from __future__ import annotations

import time

import numpy as np

from switchyard.engine_agents.core import EngineAgent, ExpertLoadWindow, StaticLayout, publish_expert_load
from switchyard.shared.bus import Bus
from switchyard.shared.schemas import Capacity, Hello, ModelShape

SHAPE = ModelShape(name="toy-moe", num_layers=2, num_experts=8, top_k=2)


class ToyEngine:
    """One data-parallel engine on two GPUs that never moves its experts. `step` stands in for the engine's
    own work; a real kind calls the same methods from hooks into its scheduler and model runner."""

    def __init__(self, bus: Bus, engine_id: str) -> None:
        self.bus, self.running = bus, 0
        hello = Hello(
            engine_id=engine_id,
            role="dp",
            model=SHAPE,
            ep_group=engine_id,
            gpus=[f"{engine_id}-gpu0", f"{engine_id}-gpu1"],
            capacity=Capacity(max_running=16, kv_blocks=1024, block_size=16),
            ts=time.time(),
            agent="toy",  # the kind's own name: no schema change needed
            migrates=False,  # so the placement service does not plan for it
            telemetry_interval_s=0.05,
        )
        slots = StaticLayout(hello, "toy engines never move experts")  # its boot layout; refuses every step
        self.agent = EngineAgent(bus, hello, self.telemetry, slots)  # hello, announce, telemetry, layout, migrate
        self.window = ExpertLoadWindow(engine_id, engine_id, SHAPE.num_layers, SHAPE.num_experts, num_sources=1)

    def telemetry(self) -> dict[str, float | int | bool]:
        """What the router reads every interval (the `Telemetry` fields other than engine_id, seq and ts)."""
        return {
            "kv_usage": self.running / 16,
            "num_running": self.running,
            "num_waiting": 0,
            "waiting_prefill_tokens": 0,
            "remaining_prefill_tokens": 0,
            "step_time_ema": 0.01,
        }

    def step(self, selections: np.ndarray) -> None:
        """One forward pass: `selections [T, L, k]`, the top-k expert ids of its T tokens at each layer."""
        self.window.add(selections, sources=np.zeros(len(selections), np.int64))

    async def flush(self) -> None:
        """Publish the expert load since the last flush (a real kind does this every second or so)."""
        window = self.window.flush()
        await publish_expert_load(self.bus, window, msg_id=f"{window.engine_id}-{window.window_start}-{window.seq}")
