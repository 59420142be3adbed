"""The two engine roles of a live simulated fleet (see `engines`): decoders and prefill engines.

Each engine is a full protocol peer (`EngineAgent`) running the simulator's engine model on a virtual clock;
what it needs from the fleet around it (clocks, request admission, completion reports, the other engines) is
the `Fleet` protocol, which `engines.LiveFleet` implements.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import numpy as np
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from switchyard.engine_agents.core import EngineAgent, ExpertLoadWindow, expert_pressure, rank_of_expert
from switchyard.engine_agents.sim.live.fleet_types import FleetCounters, LiveFleetConfig, LiveRequest
from switchyard.engine_agents.sim.live.http_server import EngineHttpServer
from switchyard.engine_agents.sim.live.migration import SimExpertGroup
from switchyard.engine_agents.sim.live.openai_wire import ParsedRequest
from switchyard.engine_agents.sim.live.token_stream import TokenStream
from switchyard.shared.bus import Bus
from switchyard.shared.errors import RemoteError
from switchyard.shared.schemas import ExpertLoad, Hello, RouteDecodeReply, RouteDecodeRequest
from switchyard.shared.signature_json import ENGINE_KEY, SIGNATURE_KEY, signature_to_json
from switchyard.simulator.core.experts import rank_masks, token_counts
from switchyard.simulator.core.physics import cost_model
from switchyard.simulator.core.xpyd_engines import DecodeEngine, PrefillEngine
from switchyard.simulator.offline.scenario import Scenario
from switchyard.solver.placement.layouts import default_layout


class Fleet(Protocol):
    """What an engine uses of the fleet it runs in (`engines.LiveFleet`)."""

    scenario: Scenario
    config: LiveFleetConfig
    bus: Bus
    counters: FleetCounters
    signatures: np.ndarray
    decoders: dict[str, LiveDecoder]
    max_tokens: int

    def now_v(self) -> float: ...

    def to_v(self, unix: float) -> float: ...

    def wall_delay(self, v: float) -> float: ...

    def accept(self, request: ParsedRequest, engine_id: str) -> tuple[int, LiveRequest]: ...

    def abort(self, request: LiveRequest) -> None: ...

    def remember_prefill(self, request_id: str, sent_at: float) -> None: ...

    def prefill_arrival(self, request_id: object) -> float | None: ...

    def spawn_transfer(self, decoder: LiveDecoder, rid: int, request: LiveRequest) -> None: ...

    def finish(self, request: LiveRequest, tokens: int, now: float) -> None: ...


class LiveEngine:
    """Shared parts of a live engine: its agent, its step loop's wake-up event, its clock.

    Each engine keeps a virtual clock `vt` (simulated seconds since the fleet started) that advances by
    exactly each step's physics duration; the loop sleeps until the wall time that corresponds to the end of
    the step. An event loop that wakes late (a millisecond of `epoll` granularity, another engine's work)
    therefore delays the next step's *start* on the wall clock but not the simulated timeline: latencies are
    measured on `vt`, so they reflect the physics and not the machine running the simulation. `behind_s`
    says how far the wall clock has run ahead of an engine (0 when the fleet keeps up).
    """

    def __init__(self, fleet: Fleet, hello: Hello) -> None:
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


class LiveDecoder(LiveEngine):
    def __init__(self, fleet: Fleet, hello: Hello) -> None:
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


class LivePrefill(LiveEngine):
    def __init__(self, fleet: Fleet, hello: Hello) -> None:
        super().__init__(fleet, hello)
        scenario, config = fleet.scenario, fleet.config
        self.engine = PrefillEngine(
            scenario.cost,
            scenario.bank,
            token_budget=config.prefill_token_budget,
            prefix_block=config.prefix_block if config.prefix_caching else None,
        )
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
        self.engine.add(rid, request.replay, request.prompt, request.keys)
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
                request.prefix_hit = self.engine.prefix_hits.pop(int(rid), 0)  # popped: a live engine runs for long
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
