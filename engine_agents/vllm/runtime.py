"""The bus side of the vLLM agent, built on the engine-agent core (`engine_agents.core`).

Each vLLM process that has something to publish starts one `core.AgentThread` (vLLM's loop never waits on
NATS); the vLLM side hands it readings with plain method calls, which are thread-safe and never block. In
the engine core the thread runs the core's `EngineAgent` (hello, telemetry, announce; `layout` and `migrate`
answered by a `core.StaticLayout`); in the worker of TP rank 0 it publishes expert-load windows, routing
samples and prefill signatures. What is vLLM's own here: where readings come from (the scheduler, the
worker's device counter), vLLM's expert-parallel rank order, and the CUDA copy of signature sums.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from switchyard.engine_agents.core import (
    AgentThread,
    EngineAgent,
    StaticLayout,
    TelemetrySource,
    WindowPublisher,
    publish_routing_sample,
    routing_sample,
)
from switchyard.engine_agents.vllm.config import expert_pressure, source_counts
from switchyard.engine_agents.vllm.kv_relay import KvRelay
from switchyard.engine_agents.vllm.signatures import Finished
from switchyard.engine_agents.vllm.tracker import TrackedRequest
from switchyard.shared.bus import Bus
from switchyard.shared.schemas import ExpertLoad, Hello, PrefillSignature

__all__ = ["AgentThread", "EngineCoreAgent", "ExpertLoadPublisher"]

log = logging.getLogger(__name__)

#: Why this agent refuses migrate steps (see `EngineCoreAgent`).
NO_MIGRATION = "this vLLM agent does not move experts yet (no external EPLB trigger); nothing was applied"


class EngineCoreAgent:
    """Hello and telemetry for one engine, read from its scheduler; `layout` and `migrate` answered honestly.

    This agent does not rearrange experts: vLLM's EPLB has no external trigger (see `docs/vllm-agent.md`).
    It reports vLLM's own layout, contiguous (expert e on EP rank e // ⌈E/G⌉), and refuses migrate steps
    with a reason, so a placement plan fails cleanly (nothing moved) instead of timing out.
    """

    def __init__(
        self,
        hello: Hello,
        telemetry: TelemetrySource,
        thread: AgentThread,
        ep_size: int = 1,
        kv_relay: KvRelay | None = None,
    ) -> None:
        self.hello = hello
        self.scheduler_reading = telemetry
        self.thread = thread
        self.ep_size = ep_size
        #: Gimbal's MoE pressure from the latest expert-load window of this engine's worker (1 = balanced).
        self.expert_pressure = 1.0
        self.agent: EngineAgent | None = None
        #: vLLM's KV-cache events, relayed as `KvEvents` on `sy.engine.<id>.kv` (`kv_relay.py`), when enabled.
        self.kv_relay = kv_relay
        self._relay_task: asyncio.Task[None] | None = None

    def telemetry(self) -> dict[str, float | int | bool]:
        """The scheduler's reading plus the expert pressure the worker's counts imply."""
        return {**self.scheduler_reading(), "expert_pressure": self.expert_pressure}

    def _on_window(self, window: ExpertLoad, _msg: object) -> None:
        self.expert_pressure = expert_pressure(window.expert_counts, self.ep_size)

    def start(self) -> bool:
        return self.thread.start(self._on_connect)

    async def _on_connect(self, bus: Bus) -> None:
        hello = self.hello.model_copy(update={"ts": time.time()})
        self.agent = EngineAgent(bus, hello, self.telemetry, slots=StaticLayout(hello, NO_MIGRATION))
        await self.agent.start()
        # The counts live in the worker process; its windows come back here over NATS (plain subscription).
        await bus.subscribe(bus.subjects.expert_load(self.hello.engine_id), ExpertLoad, self._on_window)
        if self.kv_relay is not None:
            self._relay_task = asyncio.create_task(self.kv_relay.run(bus))
        log.info("switchyard agent: engine %s (%s) is on the bus", self.hello.engine_id, self.hello.role)


class ExpertLoadPublisher:
    """The worker's bus side: expert-load windows every `interval_s`, routing samples, prefill signatures."""

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
        per_source = None if sources is None else functools.partial(_source_counts, sources=sources)
        self.windows = WindowPublisher(engine_id, ep_group, take_counts, interval_s, per_source)  # type: ignore[arg-type]

    @property
    def on_tick(self) -> Callable[[], None] | None:
        """Called on the agent thread after each window (the worker flushes routing samples there)."""
        return self.windows.on_tick

    @on_tick.setter
    def on_tick(self, callback: Callable[[], None] | None) -> None:
        self.windows.on_tick = callback

    def start(self) -> bool:
        return self.thread.start(self._on_connect)

    async def _on_connect(self, bus: Bus) -> None:
        self._task = asyncio.create_task(self.windows.run(bus))

    def publish_sample(self, request_id: str, state: TrackedRequest) -> None:
        """Queue one finished request's counts as a `RoutingSample` (from any thread; never blocks)."""
        bus = self.thread.bus
        if bus is None:
            return
        sample = routing_sample(
            self.engine_id, request_id, state.prefill_tokens, state.decode_tokens, state.prefill, state.decode
        )
        self.thread.submit(publish_routing_sample(bus, sample))

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


def _source_counts(counts: np.ndarray, sources: tuple[int, int, int]) -> np.ndarray | None:
    return source_counts(counts, *sources)
