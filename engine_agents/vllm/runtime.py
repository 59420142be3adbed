"""The bus side of the vLLM agent: a daemon thread with its own event loop, so vLLM's loop never waits on NATS.

vLLM's processes are not asyncio services of ours: the engine core runs a busy loop, workers run the model.
Each process that has something to publish starts one `AgentThread`; the vLLM side hands it readings with
plain method calls (`post`), which are thread-safe and never block. In the engine core the thread runs the
`EngineAgent` (hello, telemetry, announce; the same class the simulated engines use) and answers `layout`
and `migrate`; in the worker of TP rank 0 it publishes expert-load windows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from switchyard.engine_agents.agent import EngineAgent, TelemetrySource
from switchyard.engine_agents.vllm.config import expert_pressure, source_counts
from switchyard.engine_agents.vllm.signatures import Finished
from switchyard.engine_agents.vllm.tracker import TrackedRequest
from switchyard.shared.bus import Bus
from switchyard.shared.errors import SchemaMismatch
from switchyard.shared.schemas import (
    CalibrationSample,
    ExpertLoad,
    Hello,
    LayoutReply,
    LayoutRequest,
    MigrateReply,
    MigrateRequest,
    PrefillSignature,
)
from switchyard.shared.settings import SwitchyardSettings

log = logging.getLogger(__name__)


class AgentThread:
    """Connects to NATS on its own thread; `submit` schedules a coroutine there from any thread."""

    def __init__(self, name: str, settings: SwitchyardSettings | None = None, role: str | None = None) -> None:
        self.name = name
        self.role = role  # `engine-<id>`: the NATS user of this engine when per-role credentials are set
        self.settings = settings or SwitchyardSettings()
        self.loop = asyncio.new_event_loop()
        self.bus: Bus | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"switchyard-{name}", daemon=True)

    def start(self, on_connect: Callable[[Bus], object], timeout_s: float = 10.0) -> bool:
        """Start the thread and run `on_connect(bus)` (a coroutine function) there; False if NATS is unreachable."""
        self._on_connect = on_connect
        self._thread.start()
        return self._ready.wait(timeout_s) and self.bus is not None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._connect())
        except Exception:
            log.exception("switchyard agent %s: cannot reach NATS at %s", self.name, self.settings.nats_servers)
            self.bus = None
            self._ready.set()
            self.loop.close()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Cancel what runs on the thread, close the connection (flushing it), and end the thread."""
        if not self._thread.is_alive() or self.loop.is_closed():
            return

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.bus is not None:
                await self.bus.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)

    async def _connect(self) -> None:
        self.bus = await Bus.connect(self.settings, name=f"switchyard-vllm-{self.name}", role=self.role)
        await self._on_connect(self.bus)  # type: ignore[misc]

    def submit(self, coroutine: object) -> None:
        if self.bus is not None:
            asyncio.run_coroutine_threadsafe(coroutine, self.loop)  # type: ignore[arg-type]


class EngineCoreAgent:
    """Hello and telemetry for one engine, read from its scheduler; `layout` and `migrate` answered honestly.

    This agent does not rearrange experts: vLLM's EPLB has no external trigger (see `docs/vllm-agent.md`).
    It reports vLLM's own layout, contiguous (expert e on EP rank e // ⌈E/G⌉), and refuses migrate steps
    with a reason, so a placement plan fails cleanly (nothing moved) instead of timing out.
    """

    def __init__(self, hello: Hello, telemetry: TelemetrySource, thread: AgentThread, ep_size: int = 1) -> None:
        self.hello = hello
        self.scheduler_reading = telemetry
        self.thread = thread
        self.ep_size = ep_size
        #: Gimbal's MoE pressure from the latest expert-load window of this engine's worker (1 = balanced).
        self.expert_pressure = 1.0
        self.agent: EngineAgent | None = None

    def telemetry(self) -> dict[str, float | int | bool]:
        """The scheduler's reading plus the expert pressure the worker's counts imply."""
        return {**self.scheduler_reading(), "expert_pressure": self.expert_pressure}

    def _on_window(self, window: ExpertLoad, _msg: object) -> None:
        self.expert_pressure = expert_pressure(window.expert_counts, self.ep_size)

    def start(self) -> bool:
        return self.thread.start(self._on_connect)

    async def _on_connect(self, bus: Bus) -> None:
        self.agent = EngineAgent(bus, self.hello.model_copy(update={"ts": time.time()}), self.telemetry)
        await self.agent.start()
        # The counts live in the worker process; its windows come back here over NATS (plain subscription).
        await bus.subscribe(bus.subjects.expert_load(self.hello.engine_id), ExpertLoad, self._on_window)
        await bus.serve(bus.subjects.layout(self.hello.engine_id), LayoutRequest, self._layout)
        await bus.serve(bus.subjects.migrate(self.hello.engine_id), MigrateRequest, self._refuse)
        log.info("switchyard agent: engine %s (%s) is on the bus", self.hello.engine_id, self.hello.role)

    def _layout(self, request: LayoutRequest) -> LayoutReply:
        if request.engine_group != self.hello.ep_group:
            raise SchemaMismatch("engine_group", f"this engine belongs to group {self.hello.ep_group!r}")
        shape = self.hello.model
        from switchyard.solver.placement import contiguous_slots  # imported on demand: it brings OR-Tools along

        gpus = max(len(self.hello.gpus), 1)
        slots = -(-shape.num_experts // gpus)
        layout = contiguous_slots(shape.num_layers, shape.num_experts, gpus, slots).astype(np.int32)
        return LayoutReply(engine_group=self.hello.ep_group, layout=layout, version=0)

    def _refuse(self, request: MigrateRequest) -> MigrateReply:
        why = "this vLLM agent does not move experts yet (no external EPLB trigger); nothing was applied"
        return MigrateReply.refusal(request, why)


class ExpertLoadPublisher:
    """Publishes the worker's accumulated expert counts as `ExpertLoad` windows every `interval_s`."""

    def __init__(
        self,
        engine_id: str,
        ep_group: str,
        take_counts: Callable[[], object],
        interval_s: float,
        thread: AgentThread,
        sources: tuple[int, int, int] | None = None,
    ) -> None:
        self.engine_id = engine_id
        #: `(dp_rank, dp_size, tp_size)` of a DP+EP deployment: windows then carry source ranks (`A[L, S, E]`).
        self.sources = sources
        self.ep_group = ep_group
        self.take_counts = take_counts  # returns a uint32 [L, E] numpy array and resets the counter
        self.interval_s = interval_s
        self.thread = thread
        self.seq = 0
        #: Called on the agent thread after each window (the worker flushes calibration samples there).
        self.on_tick: Callable[[], None] | None = None

    def start(self) -> bool:
        return self.thread.start(self._on_connect)

    async def _on_connect(self, bus: Bus) -> None:
        self._task = asyncio.create_task(self._loop(bus))

    def publish_sample(self, request_id: str, state: TrackedRequest) -> None:
        """Queue one finished request's counts as a `CalibrationSample` (from any thread; never blocks)."""
        bus = self.thread.bus
        if bus is None:
            return
        sample = CalibrationSample(
            engine_id=self.engine_id,
            request_id=request_id[:128],
            ts=time.time(),
            prompt_tokens=state.prefill_tokens,
            decode_tokens=state.decode_tokens,
            prefill_counts=state.prefill,
            decode_counts=state.decode,
        )
        self.thread.submit(self._publish_sample(bus, sample))

    def publish_signatures(self, finished: list[Finished], sums: Any) -> None:
        """Queue `PrefillSignature`s for requests whose prefill ended (`sums [R, L, E]` on the model's device).

        On a GPU the copy to the host is queued behind the step (pinned memory, non-blocking) and the agent
        thread waits for its event, so the engine thread never synchronises.
        """
        bus = self.thread.bus
        if bus is None:
            return
        if sums.device.type == "cuda":
            import torch

            host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            host.copy_(sums, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = sums, None
        self.thread.submit(self._publish_signatures(bus, finished, host, ready))

    async def _publish_signatures(self, bus: Bus, finished: list[Finished], host: Any, ready: Any) -> None:
        if ready is not None:
            await asyncio.to_thread(ready.synchronize)
        counts = host.numpy().astype(np.uint32)
        subject = bus.subjects.signature(self.engine_id)
        for request, signature in zip(finished, counts, strict=True):
            message = PrefillSignature(
                engine_id=self.engine_id,
                request_id=request.request_id[:128],
                ts=time.time(),
                prompt_tokens=request.prompt_tokens,
                cached_tokens=request.cached_tokens,
                signature=signature,
            )
            try:
                await bus.publish(subject, message)
            except Exception as exc:  # the gateway then routes this request without a signature
                log.warning("switchyard agent: signature of %s not published: %s", request.request_id, exc)

    async def _publish_sample(self, bus: Bus, sample: CalibrationSample) -> None:
        try:
            await bus.js_publish(bus.subjects.calibration_samples, sample)
        except Exception as exc:  # a lost sample costs nothing but a little calibration data
            log.warning("switchyard agent: calibration sample %s not published: %s", sample.request_id, exc)

    async def _loop(self, bus: Bus) -> None:
        start = time.time()
        subject = bus.subjects.expert_load(self.engine_id)
        while True:
            await asyncio.sleep(self.interval_s)
            end = time.time()
            counts = await asyncio.to_thread(self.take_counts)
            window = ExpertLoad(
                engine_id=self.engine_id,
                ep_group=self.ep_group,
                seq=self.seq,
                window_start=start,
                window_end=end,
                expert_counts=counts,  # type: ignore[arg-type]
                source_counts=None if self.sources is None else source_counts(counts, *self.sources),  # type: ignore[arg-type]
            )
            try:
                await bus.js_publish(subject, window, msg_id=f"{self.engine_id}-{int(start * 1e6)}-{self.seq}")
            except Exception as exc:  # JetStream briefly away: this window is lost, not the engine
                log.warning("switchyard agent: expert-load window %d not published: %s", self.seq, exc)
            self.seq += 1
            start = end
            if self.on_tick is not None:
                try:
                    self.on_tick()
                except Exception:
                    log.exception("switchyard agent: worker tick failed")
