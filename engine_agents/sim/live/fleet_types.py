"""A live simulated fleet's configuration, the requests it carries and its counters (see `engines`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from switchyard.engine_agents.sim.live.migration import MigrationCost
from switchyard.engine_agents.sim.live.token_stream import TokenStream
from switchyard.simulator.core.defaults import DECODE_MAX_RUNNING, TELEMETRY_INTERVAL_S, TOKEN_BUDGET
from switchyard.simulator.core.request_jsonl import MOONCAKE_BLOCK_TOKENS


@dataclass(frozen=True)
class LiveFleetConfig:
    prefill: int = 2
    decode: int = 4
    #: Expert-parallel ranks per decoder (each decoder is its own EP group, placed from its own load).
    gpus_per_decoder: int = 2
    gpu: str = "H100"
    #: Simulated seconds per wall second (0.5: half speed, for slow machines).
    speed: float = 1.0
    max_running: int = DECODE_MAX_RUNNING
    prefill_token_budget: int = TOKEN_BUDGET
    telemetry_interval_s: float = TELEMETRY_INTERVAL_S
    hello_interval_s: float = 5.0
    load_window_s: float = 2.0
    #: Fraction of finished requests published as routing samples (`RoutingSample`).
    routing_sample_fraction: float = 0.1
    route_timeout_s: float = 0.5
    name: str = "sim"
    migration: MigrationCost = field(default_factory=MigrationCost)
    #: Serve OpenAI-compatible HTTP on each engine (announced as `Hello.base_url`).
    http: bool = False
    http_host: str = "127.0.0.1"
    #: The first engine's port (prefill engines first, then decoders, one port each); 0: free ports.
    http_port: int = 0
    #: Tokens per streamed chunk after the first, as vLLM's `--stream-interval`.
    stream_interval: int = 1
    #: vLLM's prefix caching on the prefill engines (their KV then what the weights leave), for submits that
    #: carry hash ids of `prefix_block` tokens (Mooncake's 512); others are prefilled whole.
    prefix_caching: bool = True
    prefix_block: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1 or self.gpus_per_decoder < 1:
            raise ValueError("a fleet needs at least one prefill engine, one decoder and one GPU per decoder")
        if self.speed <= 0:
            raise ValueError("speed must be positive")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")

    def prefill_ids(self) -> list[str]:
        return [f"{self.name}-p{i}" for i in range(self.prefill)]

    def decode_ids(self) -> list[str]:
        return [f"{self.name}-d{i}" for i in range(self.decode)]


@dataclass
class LiveRequest:
    request_id: str
    replay: int
    prompt: int
    output: int
    sent_at: float  # unix time the load generator sent it
    sent_v: float  # the same instant on the fleet's virtual clock
    prefill_engine: str
    #: Its prompt's prefix-cache keys (`prefix_cache.prefix_keys`), and the tokens its prefill found cached.
    keys: tuple[int, ...] | None = None
    prefix_hit: int = 0
    decode_engine: str = ""
    routed_by: str = ""
    fallback: str | None = None
    band_size: int = 0
    first_token_v: float = -1.0
    #: An HTTP request's tokens (None for requests submitted on the bus).
    stream: TokenStream | None = None
    #: Prefill only (`do_remote_decode`): answer at the end of prefill with the decode hop's KV params.
    prefill_only: bool = False
    recompute: bool = False


@dataclass
class FleetCounters:
    submitted: int = 0
    completed: int = 0
    rejected: int = 0
    route_fallbacks: int = 0
    #: HTTP requests answered at the end of prefill (their decode hop counts in `submitted`).
    prefilled_only: int = 0
    #: HTTP requests dropped because their client went away.
    aborted: int = 0
