"""A live simulated xPyD fleet: many simulated MoE engines in one process, on the real bus, in scaled real time.

Each engine runs the simulator's engine model (`simulator.core.xpyd_engines`) with its physics: a step's
duration is computed, slept (divided by `speed`), then its tokens are emitted. Around it, each engine is a
full protocol peer, exactly as the vLLM agent will be:

- hello / announce / telemetry (`EngineAgent`);
- decoders publish expert-load windows (JetStream) from the expert selections they replay, a sample of
  finished requests' (prefill signature, decode pattern) pairs as routing samples for the ELDR refit
  (JetStream), and serve
  `sy.engine.<id>.migrate` on their expert slots (`engine_agents.sim.live.migration`): each decoder is its own EP
  group of `gpus_per_decoder` ranks, and its step time follows the experts of the busiest rank, so the
  placement service's per-decoder placements change its speed; while a migration step runs it is slower;
- prefill engines take requests on `sy.sim.submit.<id>`, prefill them, and at the handoff ask the router
  (`sy.route.decode`) which decoder takes the request, sending the request's real prefill expert counts as
  its signature; the KV transfer then takes its physics time before the decoder queues the request. If the
  router does not answer in time the engine picks the least-loaded decoder itself (counted as a fallback),
  so a router outage slows nothing down;
- finished requests are reported on `sy.sim.completed` with TTFT and TPOT in simulated seconds.

With `http=True` every engine also serves OpenAI-compatible HTTP on its own port (`http_server`), announced
as `Hello.base_url`, streaming its tokens at the simulated pace:

- a prefill engine given `kv_transfer_params.do_remote_decode` (vLLM's disaggregated-serving proxy's first
  hop) prefills, answers one token, and returns `kv_transfer_params` for the decode hop with the prompt's
  prefill signature (`shared.signature_json`); without it, it does the whole request itself, handing off to
  a decoder through the router as above and streaming the decoder's tokens;
- a decoder given the prefill's `kv_transfer_params` waits the KV transfer's physics time and decodes;
  without them it prefills the prompt itself inside its batch (as a recomputed request).

What a request replays (its prefill signature, its decode experts) comes from a real routing trace through
`Scenario`; nothing is drawn from a made-up distribution.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from switchyard.engine_agents.core import (
    EngineAgent,
    ExpertLoadWindow,
    expert_pressure,
    publish_expert_load,
    publish_routing_sample,
    rank_of_expert,
    routing_sample,
)
from switchyard.engine_agents.sim.live.http_server import EngineHttpServer, bind
from switchyard.engine_agents.sim.live.migration import MigrationCost, SimExpertGroup, serve_migrate
from switchyard.engine_agents.sim.live.openai_wire import BadRequest, ParsedRequest, replay_row
from switchyard.engine_agents.sim.live.protocol import SimCompleted, SimSubmit
from switchyard.engine_agents.sim.live.token_stream import TokenStream
from switchyard.shared.bus import Bus
from switchyard.shared.errors import ConfigError, RemoteError
from switchyard.shared.schemas import (
    Capacity,
    ExpertLoad,
    Hello,
    ModelShape,
    RouteDecodeReply,
    RouteDecodeRequest,
)
from switchyard.shared.signature_json import ENGINE_KEY, SIGNATURE_KEY, signature_to_json
from switchyard.shared.streams import stream
from switchyard.simulator.core.defaults import DECODE_MAX_RUNNING, TELEMETRY_INTERVAL_S, TOKEN_BUDGET
from switchyard.simulator.core.experts import rank_masks, token_counts
from switchyard.simulator.core.physics import cost_model
from switchyard.simulator.core.xpyd_engines import DecodeEngine, PrefillEngine
from switchyard.simulator.offline.scenario import Scenario
from switchyard.solver.placement.layouts import default_layout

log = logging.getLogger(__name__)

#: Prefill-only hops remembered for their decode hop (older ones, whose decode never came, are forgotten).
MAX_PREFILL_ARRIVALS = 100_000


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


def _url(sock: socket.socket | None) -> str | None:
    if sock is None:
        return None
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class _Engine:
    """Shared parts of a live engine: its agent, its step loop's wake-up event, its clock.

    Each engine keeps a virtual clock `vt` (simulated seconds since the fleet started) that advances by
    exactly each step's physics duration; the loop sleeps until the wall time that corresponds to the end of
    the step. An event loop that wakes late (a millisecond of `epoll` granularity, another engine's work)
    therefore delays the next step's *start* on the wall clock but not the simulated timeline: latencies are
    measured on `vt`, so they reflect the physics and not the machine running the simulation. `behind_s`
    says how far the wall clock has run ahead of an engine (0 when the fleet keeps up).
    """

    def __init__(self, fleet: LiveFleet, hello: Hello) -> None:
        self.fleet = fleet
        self.engine_id = hello.engine_id
        self.agent = EngineAgent(fleet.bus, hello, self.telemetry)
        self.wake = asyncio.Event()
        self.step_time_ema = 0.0
        self.vt = 0.0
        self.behind_s = 0.0
        self.server: EngineHttpServer | None = None

    @property
    def model_name(self) -> str:
        return self.fleet.scenario.model.name

    @property
    def max_model_len(self) -> int:
        return self.fleet.max_tokens

    def open(self, request: ParsedRequest) -> TokenStream:
        raise NotImplementedError

    async def _idle(self) -> None:
        """Wait for work; an idle engine's clock catches up with the present."""
        self.wake.clear()
        await self.wake.wait()
        self.vt = max(self.vt, self.fleet.now_v())

    async def _run_for(self, duration: float) -> float:
        """Advance the virtual clock by `duration` and sleep until the wall clock gets there; returns the new vt."""
        self.vt += duration
        delay = self.fleet.wall_delay(self.vt)
        if delay > 0:
            await asyncio.sleep(delay)
        self.behind_s = max(0.0, -self.fleet.wall_delay(self.vt))
        return self.vt

    def telemetry(self) -> dict[str, float | int | bool]:
        raise NotImplementedError

    def _observe_step(self, duration: float) -> None:
        self.step_time_ema = duration if self.step_time_ema == 0 else 0.9 * self.step_time_ema + 0.1 * duration


class LiveDecoder(_Engine):
    def __init__(self, fleet: LiveFleet, hello: Hello) -> None:
        super().__init__(fleet, hello)
        scenario, config = fleet.scenario, fleet.config
        self.model = scenario.model
        self.cost = cost_model(self.model, config.gpu, config.gpus_per_decoder)
        experts = self.model.num_experts
        layout = default_layout(self.model.moe_layers, experts, config.gpus_per_decoder)
        self.group = SimExpertGroup(self.engine_id, layout, config.migration)
        self._layout = self.group.layout
        masks = self._masks() if config.gpus_per_decoder > 1 else None
        self.engine = DecodeEngine(self.cost, scenario.bank, max_running=config.max_running, rank_masks=masks)
        self.window = ExpertLoadWindow(self.engine_id, self.group.group_id, self.model.moe_layers, experts, 1)
        self.rids: dict[int, LiveRequest] = {}
        self.streams: dict[int, TokenStream] = {}

    def _masks(self) -> np.ndarray:
        ranks = rank_of_expert(self.group.layout, self.model.num_experts)
        return rank_masks(self.model.moe_layers, self.model.num_experts, self.fleet.config.gpus_per_decoder, ranks)

    @property
    def load(self) -> int:
        return self.engine.num_running + self.engine.num_waiting

    def expert_pressure(self) -> float:
        """Busiest EP rank's expert load over the mean rank's, averaged over layers (1 = balanced)."""
        g = self.fleet.config.gpus_per_decoder
        counts = self.window.counts
        if g == 1 or not counts.any():
            return 1.0
        return expert_pressure(counts, rank_of_expert(self.group.layout, self.model.num_experts), g)

    def telemetry(self) -> dict[str, float | int | bool]:
        return {
            "kv_usage": min(self.engine.kv_usage, 1.0),
            "num_running": self.engine.num_running,
            "num_waiting": self.engine.num_waiting,
            "waiting_prefill_tokens": 0,
            "remaining_prefill_tokens": 0,
            "step_time_ema": self.step_time_ema,
            "expert_pressure": self.expert_pressure(),
            "migrating": self.group.migrating,
        }

    def submit(self, rid: int, request: LiveRequest) -> None:
        if request.stream is not None and request.stream.cancelled:
            self.fleet.abort(request)
            return
        self.rids[rid] = request
        self.engine.add(rid, request.replay, request.prompt, request.output, recompute=request.recompute)
        if request.stream is not None:
            self.streams[rid] = request.stream
        self.wake.set()

    def open(self, request: ParsedRequest) -> TokenStream:
        """An HTTP request: the decode hop of a disaggregated request, or a whole one prefilled here."""
        rid, live = self.fleet.accept(request, self.engine_id)
        live.decode_engine, live.routed_by = self.engine_id, "http"
        kv = request.kv_transfer_params or {}
        # When the prefill hop ran here: its arrival (a gateway strips our `switchyard_*` keys, not vLLM's).
        sent_at = self.fleet.prefill_arrival(kv.get("remote_request_id")) or kv.get("switchyard_sent_at")
        if isinstance(sent_at, (int, float)) and not isinstance(sent_at, bool) and 0 < sent_at <= live.sent_at:
            live.sent_at, live.sent_v = float(sent_at), max(self.fleet.to_v(float(sent_at)), 0.0)
        if isinstance(kv.get("remote_engine_id"), str):
            live.prefill_engine = kv["remote_engine_id"]
        if request.remote_prefill:
            self.fleet.spawn_transfer(self, rid, live)
        else:
            live.recompute = True
            self.submit(rid, live)
        assert live.stream is not None
        return live.stream

    def _stream_progress(self, finished: list[int], finished_tokens: list[int]) -> None:
        """Feed the HTTP streams this step's tokens; drop requests whose client went away."""
        for rid, tokens in zip(finished, finished_tokens, strict=True):
            stream = self.streams.pop(rid, None)
            if stream is not None:
                stream.advance(tokens, finished=True)
        gone: list[int] = []
        for rid, stream in self.streams.items():
            if stream.cancelled:
                gone.append(rid)
                continue
            generated = self.engine.generated(rid)
            if generated is not None:
                stream.advance(generated)
        for rid in gone:
            del self.streams[rid]
            self.engine.abort(rid)
            self.fleet.abort(self.rids.pop(rid))

    async def run(self) -> None:
        bank, experts = self.fleet.scenario.bank, self.model.num_experts
        while True:
            if self.group.layout is not self._layout:  # a migration step landed: new expert-to-rank map
                self._layout = self.group.layout
                if self.engine.rank_masks is not None:
                    self.engine.rank_masks = self._masks()
            plan = self.engine.begin_step()
            if plan is None:
                await self._idle()
                continue
            self.window.add_counts(token_counts(bank.decode_bits[plan.rows], experts))
            duration = plan.duration * self.group.step_time_factor
            self._observe_step(duration)
            now = await self._run_for(duration)
            out = self.engine.end_step()
            for rid in out.first:
                self.rids[rid].first_token_v = now
            for rid, tokens in zip(out.finished, out.finished_tokens, strict=True):
                self.fleet.finish(self.rids.pop(rid), tokens, now)
            if self.streams:
                self._stream_progress(out.finished, out.finished_tokens)

    def flush_window(self) -> ExpertLoad:
        return self.window.flush()


class LivePrefill(_Engine):
    def __init__(self, fleet: LiveFleet, hello: Hello) -> None:
        super().__init__(fleet, hello)
        scenario, config = fleet.scenario, fleet.config
        self.engine = PrefillEngine(scenario.cost, scenario.bank, token_budget=config.prefill_token_budget)
        self.rids: dict[int, LiveRequest] = {}
        self._handoffs: set[asyncio.Task[None]] = set()

    def telemetry(self) -> dict[str, float | int | bool]:
        queued = self.engine.queued_tokens
        return {
            "kv_usage": 0.0,
            "num_running": int(self.engine.busy),
            "num_waiting": self.engine.pending,
            "waiting_prefill_tokens": queued,
            "remaining_prefill_tokens": 0,
            "step_time_ema": self.step_time_ema,
        }

    def submit(self, rid: int, request: LiveRequest) -> None:
        self.rids[rid] = request
        self.engine.add(rid, request.replay, request.prompt)
        self.wake.set()

    def open(self, request: ParsedRequest) -> TokenStream:
        """An HTTP request: prefill only (`do_remote_decode`), or the whole request through a decoder."""
        rid, live = self.fleet.accept(request, self.engine_id)
        if request.remote_decode:
            live.prefill_only = True
            live.stream = TokenStream(1)
        self.submit(rid, live)
        assert live.stream is not None
        return live.stream

    def _prefilled(self, request: LiveRequest) -> None:
        """A prefill-only request is done: one token, and what the decode hop needs in `kv_transfer_params`."""
        assert request.stream is not None
        fleet = self.fleet
        block = fleet.scenario.cost.block_size
        request.stream.kv_transfer_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(range(-(-request.prompt // block))),
            "remote_host": fleet.config.http_host,
            "remote_port": int(self.server.sock.getsockname()[1]) if self.server else 0,
            "tp_size": 1,
            "switchyard_sent_at": request.sent_at,
            SIGNATURE_KEY: signature_to_json(fleet.signatures[request.replay]),
            ENGINE_KEY: self.engine_id,
        }
        fleet.counters.prefilled_only += 1
        fleet.remember_prefill(request.request_id, request.sent_at)
        fleet.counters.submitted -= 1  # its decode hop is the request
        request.stream.advance(1, finished=True)

    async def run(self) -> None:
        fleet = self.fleet
        while True:
            plan = self.engine.begin_step()
            if plan is None:
                await self._idle()
                continue
            self._observe_step(plan.duration)
            await self._run_for(plan.duration)
            for rid in self.engine.end_step():
                request = self.rids.pop(int(rid))
                if request.prefill_only:
                    self._prefilled(request)
                    continue
                if request.stream is not None and request.stream.cancelled:
                    fleet.abort(request)
                    continue
                task = asyncio.create_task(self.handoff(int(rid), request))
                self._handoffs.add(task)
                task.add_done_callback(self._handoffs.discard)

    async def handoff(self, rid: int, request: LiveRequest) -> None:
        """Ask the router for a decoder, move the KV cache there, queue the request on it."""
        fleet = self.fleet
        decoder = None
        try:
            reply = await fleet.bus.request(
                fleet.bus.subjects.route_decode,
                RouteDecodeRequest(
                    request_id=request.request_id,
                    prompt_tokens=request.prompt,
                    signature=fleet.signatures[request.replay],
                    prefill_engine_id=self.engine_id,
                ),
                RouteDecodeReply,
                timeout=fleet.config.route_timeout_s,
            )
            decoder = fleet.decoders.get(reply.engine_id)
            request.routed_by, request.fallback, request.band_size = reply.policy, reply.fallback, reply.band_size
            if decoder is None:
                request.fallback = f"unknown_engine:{reply.engine_id}"
        except (RemoteError, NatsTimeoutError, NoRespondersError, TimeoutError) as exc:
            request.fallback = f"router_unavailable:{type(exc).__name__}"
        if decoder is None:
            fleet.counters.route_fallbacks += 1
            decoder = min(fleet.decoders.values(), key=lambda d: d.load)
            request.routed_by = request.routed_by or "local-jsq"
        request.decode_engine = decoder.engine_id
        await asyncio.sleep(float(fleet.scenario.cost.kv_transfer_time(request.prompt)) / fleet.config.speed)
        decoder.submit(rid, request)


class LiveFleet:
    """P prefill and D decode engines of one model, replaying `scenario`'s real routing trace."""

    def __init__(self, scenario: Scenario, config: LiveFleetConfig | None = None) -> None:
        self.scenario = scenario
        self.config = config or LiveFleetConfig()
        self.counters = FleetCounters()
        self.bus: Bus = None  # type: ignore[assignment]  # set by start()
        counts = scenario.counts.prefill[scenario.replay]
        if counts.max(initial=0) > np.iinfo(np.uint16).max:
            raise ValueError("prefill counts exceed uint16")
        #: Each replay row's signature: its real prefill top-k counts [L, E].
        self.signatures = counts.astype(np.uint16)
        self.decoders: dict[str, LiveDecoder] = {}
        self.prefills: dict[str, LivePrefill] = {}
        self._next_rid = 0
        self._rng = stream(scenario.seed, "live.calibration")
        self._tasks: list[asyncio.Task[None]] = []
        self._publishes: set[asyncio.Task[None]] = set()
        self._prefill_arrivals: OrderedDict[str, float] = OrderedDict()
        self._boot = ""
        self._unix0 = time.time()
        decode_cost = cost_model(scenario.model, self.config.gpu, self.config.gpus_per_decoder)
        #: Largest prompt + output a decoder's KV cache holds (the load generator clips to it).
        self.max_tokens = decode_cost.kv_capacity_blocks * decode_cost.block_size

    def _hello(self, engine_id: str, role: str, gpus: int, base_url: str | None = None) -> Hello:
        model = self.scenario.model
        cost = cost_model(model, self.config.gpu, gpus)
        return Hello(
            engine_id=engine_id,
            role=role,  # type: ignore[arg-type]
            model=ModelShape(
                name=model.name, num_layers=model.moe_layers, num_experts=model.num_experts, top_k=model.top_k
            ),
            ep_group=engine_id,
            gpus=[f"{engine_id}-gpu{g}" for g in range(gpus)],
            capacity=Capacity(
                max_running=self.config.max_running,
                kv_blocks=max(cost.kv_capacity_blocks, 1),
                block_size=cost.block_size,
            ),
            ts=time.time(),
            agent="sim",
            agent_version="live-1",
            hello_interval_s=self.config.hello_interval_s,
            telemetry_interval_s=self.config.telemetry_interval_s,
            base_url=base_url,
        )

    # ----- requests -----

    async def _on_submit(self, submit: SimSubmit, msg: object) -> None:
        subject = getattr(msg, "subject", "")
        prefill = self.prefills.get(subject.rsplit(".", 1)[-1])
        if prefill is None or submit.replay >= self.scenario.bank.num_requests:
            self.counters.rejected += 1
            log.warning("rejected %s: unknown prefill engine or replay row %d", submit.request_id, submit.replay)
            return
        total = submit.prompt_tokens + submit.output_tokens
        if total > self.max_tokens:
            self.counters.rejected += 1
            log.warning(
                "rejected %s: %d tokens exceed a decoder's KV cache (%d)", submit.request_id, total, self.max_tokens
            )
            return
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        self.counters.submitted += 1
        prefill.submit(
            rid,
            LiveRequest(
                submit.request_id,
                submit.replay,
                submit.prompt_tokens,
                submit.output_tokens,
                submit.sent_at,
                min(self.to_v(submit.sent_at), self.now_v()),  # never in the future (clock skew)
                prefill.engine_id,
            ),
        )

    def accept(self, request: ParsedRequest, engine_id: str) -> tuple[int, LiveRequest]:
        """An HTTP request for one of the engines, checked and numbered (raises `BadRequest`)."""
        total = request.prompt_tokens + request.max_tokens
        if total > self.max_tokens:
            self.counters.rejected += 1
            raise BadRequest(
                f"This model's maximum context length is {self.max_tokens} tokens; the request needs {total} "
                f"({request.prompt_tokens} in the prompt, {request.max_tokens} to generate).",
                "max_tokens",
            )
        replay = replay_row(request, self.scenario.bank.num_requests)
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        self.counters.submitted += 1
        now = time.time()
        live = LiveRequest(
            request.request_id, replay, request.prompt_tokens, request.max_tokens, now, self.now_v(), engine_id
        )
        live.stream = TokenStream(request.max_tokens, self.config.stream_interval)
        return rid, live

    def remember_prefill(self, request_id: str, sent_at: float) -> None:
        """A prefill-only hop's arrival, so that its decode hop's TTFT starts there (bounded memory)."""
        self._prefill_arrivals[request_id] = sent_at
        while len(self._prefill_arrivals) > MAX_PREFILL_ARRIVALS:
            self._prefill_arrivals.popitem(last=False)

    def prefill_arrival(self, request_id: object) -> float | None:
        return self._prefill_arrivals.pop(request_id, None) if isinstance(request_id, str) else None

    def abort(self, request: LiveRequest) -> None:
        """A request whose client went away left the fleet unfinished."""
        self.counters.aborted += 1
        self.counters.submitted -= 1

    def spawn_transfer(self, decoder: LiveDecoder, rid: int, request: LiveRequest) -> None:
        """Move a request's prompt KV to `decoder` (its physics time), then queue it there."""

        async def transfer() -> None:
            await asyncio.sleep(float(self.scenario.cost.kv_transfer_time(request.prompt)) / self.config.speed)
            decoder.submit(rid, request)

        self._spawn(transfer())

    # ----- clocks -----

    def now_v(self) -> float:
        """The present on the fleet's virtual clock (simulated seconds since start)."""
        return (time.time() - self._unix0) * self.config.speed

    def to_v(self, unix: float) -> float:
        return (unix - self._unix0) * self.config.speed

    def wall_delay(self, v: float) -> float:
        """Wall seconds until virtual time `v` (negative: it has passed)."""
        return self._unix0 + v / self.config.speed - time.time()

    def behind_s(self) -> float:
        """How far the slowest engine lags the wall clock (simulated seconds; ~0 when the machine keeps up)."""
        engines = [*self.prefills.values(), *self.decoders.values()]
        return max((e.behind_s for e in engines), default=0.0)

    def finish(self, request: LiveRequest, tokens: int, now: float) -> None:
        """`now`: the decoder's virtual clock at the end of the request's last step."""
        first = request.first_token_v if request.first_token_v >= 0 else now
        message = SimCompleted(
            request_id=request.request_id,
            prefill_engine=request.prefill_engine,
            decode_engine=request.decode_engine,
            prompt_tokens=request.prompt,
            output_tokens=tokens,
            ttft_s=max(first - request.sent_v, 0.0),
            tpot_s=(now - first) / (tokens - 1) if tokens > 1 else 0.0,
            routed_by=request.routed_by,
            route_fallback=request.fallback,
            band_size=request.band_size,
            sent_at=request.sent_at,
        )
        self.counters.completed += 1
        self._spawn(self.bus.publish(self.bus.subjects.sim_completed, message))
        if self._rng.random() < self.config.routing_sample_fraction:
            trace_request = int(self.scenario.replay[request.replay])
            sample = routing_sample(
                request.decode_engine,
                request.request_id,
                request.prompt,
                tokens,
                self.signatures[request.replay],
                self.scenario.counts.decode[trace_request].astype(np.uint16),
            )
            self._spawn(publish_routing_sample(self.bus, sample))

    def _spawn(self, coroutine: object) -> None:
        task = asyncio.ensure_future(coroutine)  # type: ignore[arg-type]
        self._publishes.add(task)
        task.add_done_callback(self._publishes.discard)

    # ----- expert load -----

    async def _publish_load(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_window_s)
            for decoder in self.decoders.values():
                window = decoder.flush_window()
                if window.expert_counts.any():
                    await publish_expert_load(self.bus, window, f"{decoder.engine_id}-{self._boot}-{window.seq}")

    # ----- lifecycle -----

    async def start(self, bus: Bus) -> None:
        self.bus = bus
        self._unix0 = time.time()
        self._boot = f"{self._unix0:.0f}"
        await bus.ensure_streams()
        sockets = self._bind()
        for engine_id in self.config.prefill_ids():
            sock = sockets.get(engine_id)
            self.prefills[engine_id] = LivePrefill(self, self._hello(engine_id, "prefill", 1, _url(sock)))
        for engine_id in self.config.decode_ids():
            sock = sockets.get(engine_id)
            hello = self._hello(engine_id, "decode", self.config.gpus_per_decoder, _url(sock))
            self.decoders[engine_id] = LiveDecoder(self, hello)
        for engine_id, sock in sockets.items():
            engine = self.prefills.get(engine_id) or self.decoders[engine_id]
            engine.server = EngineHttpServer(engine, sock)
            await engine.server.start()
        for decoder in self.decoders.values():
            await serve_migrate(bus, decoder.engine_id, decoder.group)
        engines: list[_Engine] = [*self.decoders.values(), *self.prefills.values()]
        for engine in engines:
            await engine.agent.start()
        await bus.subscribe(f"{bus.subjects.prefix}.sim.submit.*", SimSubmit, self._on_submit)
        self._tasks = [asyncio.create_task(e.run()) for e in engines]
        self._tasks.append(asyncio.create_task(self._publish_load()))
        await bus.nc.flush()

    def _bind(self) -> dict[str, socket.socket]:
        """Each engine's listening socket (prefill engines first), or none without `http`."""
        if not self.config.http:
            return {}
        sockets: dict[str, socket.socket] = {}
        try:
            for i, engine_id in enumerate([*self.config.prefill_ids(), *self.config.decode_ids()]):
                port = self.config.http_port + i if self.config.http_port else 0
                sockets[engine_id] = bind(self.config.http_host, port)
        except OSError as exc:
            for sock in sockets.values():
                sock.close()
            raise ConfigError(f"cannot serve the engines' HTTP on {self.config.http_host}: {exc}") from exc
        return sockets

    def base_urls(self) -> dict[str, str]:
        """Each HTTP-serving engine's OpenAI base URL."""
        engines: list[_Engine] = [*self.prefills.values(), *self.decoders.values()]
        return {e.engine_id: e.server.base_url for e in engines if e.server is not None}

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        engines: list[_Engine] = [*self.prefills.values(), *self.decoders.values()]
        for engine in engines:  # open HTTP requests end with an error event, not a hang
            for request in getattr(engine, "rids", {}).values():
                if request.stream is not None:
                    request.stream.fail("the engine is stopping")
        for engine in engines:
            if engine.server is not None:
                await engine.server.stop()
        for engine in engines:
            await engine.agent.stop()
        if self._publishes:
            await asyncio.wait(self._publishes, timeout=2)

    def in_flight(self) -> int:
        return self.counters.submitted - self.counters.completed
