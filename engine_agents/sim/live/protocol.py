"""Messages of the simulated fleet's own subjects (`sy.sim.*`), which stand in for a serving proxy.

The control-plane protocol (hello, telemetry, expert_load, routing samples, route.decode, migrate,
announce) is `shared.schemas`, identical for simulated and vLLM engines. What a real deployment's proxy
does — submitting requests to a prefill engine and timing them — the simulation does over these two
subjects, so a load generator in another process can drive the fleet and measure TTFT and TPOT.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from switchyard.shared.codec import WireModel
from switchyard.shared.schemas import Count, EngineId, RequestId, Seconds, Timestamp


class SimSubmit(WireModel):
    """A request for a simulated prefill engine; `replay` is the replay-bank row whose experts it reproduces."""

    request_id: RequestId
    replay: Count
    prompt_tokens: Annotated[int, Field(gt=0)]
    output_tokens: Annotated[int, Field(gt=0)]
    sent_at: Timestamp
    #: The prompt's prefix block hash ids (a JSONL trace's `hash_ids`) and their block in tokens; with them
    #: the prefill engine's prefix cache can hit (`simulator.core.prefix_cache`).
    hash_ids: Annotated[list[Count], Field(max_length=1 << 16)] | None = None
    hash_block: Count = 0


class SimCompleted(WireModel):
    """A finished request. Latencies are in simulated seconds (wall seconds x the fleet's speed)."""

    request_id: RequestId
    prefill_engine: EngineId
    decode_engine: EngineId
    prompt_tokens: Count
    output_tokens: Count
    ttft_s: Seconds
    tpot_s: Seconds
    routed_by: str
    route_fallback: str | None = None
    band_size: Count = 0
    sent_at: Timestamp
    #: Prompt tokens its prefill engine found in its prefix cache.
    prefix_hit_tokens: Count = 0
