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

The engines themselves are in `engine_roles`; the fleet's configuration, requests and counters in
`fleet_types`; this module holds the fleet that starts, clocks and connects them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import OrderedDict

import numpy as np

from switchyard.engine_agents.core import publish_expert_load, publish_routing_sample, routing_sample
from switchyard.engine_agents.sim.live.engine_roles import LiveDecoder, LiveEngine, LivePrefill
from switchyard.engine_agents.sim.live.fleet_types import FleetCounters, LiveFleetConfig, LiveRequest
from switchyard.engine_agents.sim.live.http_server import EngineHttpServer, bind
from switchyard.engine_agents.sim.live.migration import serve_migrate
from switchyard.engine_agents.sim.live.openai_wire import BadRequest, ParsedRequest, replay_row
from switchyard.engine_agents.sim.live.protocol import SimCompleted, SimSubmit
from switchyard.engine_agents.sim.live.token_stream import TokenStream
from switchyard.shared.bus import Bus
from switchyard.shared.errors import ConfigError
from switchyard.shared.schemas import Capacity, Hello, ModelShape
from switchyard.shared.streams import stream
from switchyard.simulator.core.physics import cost_model
from switchyard.simulator.core.prefix_cache import prefix_keys
from switchyard.simulator.offline.scenario import Scenario

log = logging.getLogger(__name__)

#: Prefill-only hops remembered for their decode hop (older ones, whose decode never came, are forgotten).
MAX_PREFILL_ARRIVALS = 100_000


def _url(sock: socket.socket | None) -> str | None:
    if sock is None:
        return None
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


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
                max_model_len=self.max_tokens,
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
        caching = self.config.prefix_caching and submit.hash_ids and submit.hash_block == self.config.prefix_block
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
                keys=prefix_keys(submit.hash_ids, submit.prompt_tokens, submit.hash_block) if caching else None,
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
            prefix_hit_tokens=request.prefix_hit,
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
        engines: list[LiveEngine] = [*self.decoders.values(), *self.prefills.values()]
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
        engines: list[LiveEngine] = [*self.prefills.values(), *self.decoders.values()]
        return {e.engine_id: e.server.base_url for e in engines if e.server is not None}

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        engines: list[LiveEngine] = [*self.prefills.values(), *self.decoders.values()]
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
