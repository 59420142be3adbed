"""A load generator that replays a request trace against a live simulated fleet and measures it.

Arrival times and prompt/output lengths come from a real request trace (the Azure CSVs, time-compressed)
or a Poisson process; each request replays a real routing-trace request (`Scenario.workload`). Requests go
to prefill engines round robin or by prefix hash (the replayed request), as a serving proxy would; every
completion that comes back on `sy.sim.completed` is kept, so TTFT and TPOT percentiles can be read at any
moment (the live table of `switchyard up`) and at the end (its summary).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from switchyard.engine_agents.sim.live.protocol import SimCompleted, SimSubmit
from switchyard.shared.bus import Bus
from switchyard.simulator.core.workload import Workload, paced_arrivals


@dataclass
class Completions:
    """Finished requests as they arrive; percentiles over all or the most recent ones."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tokens: int = 0
    by_engine: Counter[str] = field(default_factory=Counter)
    fallbacks: Counter[str] = field(default_factory=Counter)
    band_sizes: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    first_at: float = 0.0
    last_at: float = 0.0

    def add(self, done: SimCompleted) -> None:
        now = time.time()
        self.first_at = self.first_at or now
        self.last_at = now
        self.ttft.append(done.ttft_s)
        if done.output_tokens > 1:
            self.tpot.append(done.tpot_s)
        self.tokens += done.output_tokens
        self.prompt_tokens += done.prompt_tokens
        self.prefix_hit_tokens += done.prefix_hit_tokens
        self.by_engine[done.decode_engine] += 1
        if done.route_fallback:
            self.fallbacks[done.route_fallback.split(":")[0]] += 1
        if done.band_size:
            self.band_sizes.append(done.band_size)

    def __len__(self) -> int:
        return len(self.ttft)

    def summary(self, recent: int | None = None) -> dict[str, float]:
        """TTFT / TPOT percentiles in ms (over the last `recent` completions if given); prefix hit rate over all."""
        ttft = np.asarray(self.ttft[-recent:] if recent else self.ttft)
        tpot = np.asarray(self.tpot[-recent:] if recent else self.tpot)

        def pct(values: np.ndarray, q: float) -> float:
            return float(np.percentile(values, q) * 1e3) if len(values) else float("nan")

        return {
            "completed": float(len(self.ttft)),
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50),
            "tpot_p99_ms": pct(tpot, 99),
            "mean_band_size": float(np.mean(self.band_sizes)) if self.band_sizes else 0.0,
            "prefix_hit_rate": self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        }


class LoadGenerator:
    def __init__(
        self,
        bus: Bus,
        workload: Workload,
        prefill_ids: list[str],
        speed: float = 1.0,
        prefill_policy: str = "rr",
        name: str = "load",
    ) -> None:
        if prefill_policy not in ("rr", "hash"):
            raise ValueError("prefill_policy is 'rr' or 'hash'")
        if not prefill_ids:
            raise ValueError("no prefill engine to send requests to")
        self.bus = bus
        self.workload = workload
        self.prefill_ids = prefill_ids
        self.speed = speed
        self.prefill_policy = prefill_policy
        self.name = name
        self.completions = Completions()
        self.sent = 0

    def _prefill_for(self, i: int) -> str:
        if self.prefill_policy == "hash":  # the same prompt prefix (replayed request) lands on the same engine
            return self.prefill_ids[int(self.workload.replay[i]) % len(self.prefill_ids)]
        return self.prefill_ids[i % len(self.prefill_ids)]

    async def listen(self) -> None:
        await self.bus.subscribe(
            self.bus.subjects.sim_completed, SimCompleted, lambda done, _msg: self.completions.add(done)
        )

    async def run(self, duration_s: float | None = None, repeat: bool = False) -> None:
        """Send the workload's requests at their (scaled) arrival times, for at most `duration_s` wall seconds;
        with `repeat`, start the workload over (shifted by its span) each time it runs out."""
        w = self.workload
        async for cycle, i, _due in paced_arrivals(w, self.speed, duration_s, repeat):
            submit = SimSubmit(
                request_id=f"{self.name}-{cycle}-{i}",
                replay=int(w.replay[i]),
                prompt_tokens=int(w.prompt[i]),
                output_tokens=int(w.output[i]),
                sent_at=time.time(),
                hash_ids=w.hash_ids[i].tolist() if w.hash_ids is not None else None,
                hash_block=w.hash_block,
            )
            await self.bus.publish(self.bus.subjects.sim_submit(self._prefill_for(i)), submit)
            self.sent += 1

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every sent request has completed (True) or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while len(self.completions) < self.sent:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True
