"""What every engine kind shares, so a new kind (SGLang, a toy) writes only what is its own.

An engine kind is the code that puts one kind of inference engine on the bus. Every kind does the same
control-plane duties; only where the readings come from differs. This package holds the duties:

- `agent.EngineAgent`: hello (on start, periodically, on `announce`), telemetry with sequence numbers, and
  the engine's `layout` / `migrate` subjects when given its expert slots;
- `announce`: the one rule by which every engine kind answers announces, at a bounded rate;
- `thread.AgentThread`: the bus on a daemon thread with its own event loop, for engines whose own loop is
  not asyncio (vLLM's engine core and workers; SGLang's scheduler would be the same);
- `expert_load`: expert-load windows (`ExpertLoadWindow` accumulates, `WindowPublisher` publishes what a
  device counter accumulated), Gimbal's expert pressure from a window and an expert-to-rank map;
- `layout`: layout replies and refusals: `StaticLayout` for an engine that does not move experts (it reports
  its boot layout and refuses migrate steps with a reason), `serve_expert_slots` for one that does;
- `routing_samples`: the per-request routing training data (`RoutingSample`) the ELDR refit reads.

The kind itself keeps its hooks into the engine (vLLM: `engine_agents/vllm/plugin.py`) and its config
parsing. `docs/architecture.md` ("How to add an engine kind") walks through a minimal one.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Name -> submodule. Loaded on first use, so that a process importing one pure part (vLLM's config reader
#: imports `expert_load` in every vLLM process) does not pull in NATS.
_EXPORTS = {
    "AnnounceAnswerer": "announce",
    "AnnounceGate": "announce",
    "EngineAgent": "agent",
    "TelemetrySource": "agent",
    "ExpertLoadWindow": "expert_load",
    "WindowPublisher": "expert_load",
    "contiguous_ranks": "expert_load",
    "expert_load_counts": "expert_load",
    "expert_pressure": "expert_load",
    "publish_expert_load": "expert_load",
    "rank_of_expert": "expert_load",
    "ExpertSlots": "layout",
    "StaticLayout": "layout",
    "check_group": "layout",
    "contiguous_layout": "layout",
    "serve_expert_slots": "layout",
    "publish_routing_sample": "routing_samples",
    "routing_sample": "routing_samples",
    "sampled": "routing_samples",
    "AgentThread": "thread",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
