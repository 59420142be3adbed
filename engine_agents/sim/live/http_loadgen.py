"""An HTTP load generator: the workload as OpenAI clients would send it, timed as those clients see it.

Each request of a `Workload` becomes a streaming `POST /v1/completions` to one base URL (a gateway, or a
single engine) at its scaled arrival time, through one pooled `httpx.AsyncClient`. The prompt is a list of
token ids of the workload's length (so any engine counts it exactly), `max_tokens` its output length, and
`switchyard_replay` its replay-bank row (a simulated engine replays that request's experts; a real one
ignores the field). `stream_options.include_usage` gives the exact number of tokens generated.

Client-side latencies are measured from the request's *scheduled* send time, so a load generator that falls
behind shows as latency instead of silently sending less (no coordinated omission): TTFT to the first
content chunk, TPOT as (last chunk - first chunk) / (tokens - 1). A request that fails (status, transport
error, a stream with no `[DONE]`) is counted by reason, never retried.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import numpy as np

from switchyard.simulator.core.workload import Workload, paced_arrivals
from switchyard.simulator.offline.metrics import percentile

#: Token ids of the synthetic prompts are drawn below this (any real vocabulary is larger).
PROMPT_VOCAB = 30000


@dataclass
class ClientStats:
    """What the clients saw; latencies in wall seconds."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: Counter[str] = field(default_factory=Counter)

    def __len__(self) -> int:
        return len(self.ttft)

    def summary(self, recent: int | None = None, scale: float = 1.0) -> dict[str, float]:
        """Percentiles in milliseconds, times `scale` (the fleet's speed, to compare with simulated time)."""
        ttft = np.asarray(self.ttft[-recent:] if recent else self.ttft) * scale
        tpot = np.asarray(self.tpot[-recent:] if recent else self.tpot) * scale
        return {
            "completed": float(len(self.ttft)),
            "failed": float(sum(self.failed.values())),
            "ttft_p50_ms": percentile(ttft, 50) * 1e3,
            "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "tpot_p50_ms": percentile(tpot, 50) * 1e3,
            "tpot_p99_ms": percentile(tpot, 99) * 1e3,
        }


def prompt_ids(replay: int, length: int) -> list[int]:
    """A prompt of `length` token ids that depends only on the replayed request (same row, same prefix)."""
    return np.random.default_rng(replay).integers(0, PROMPT_VOCAB, size=length).tolist()


async def discover_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model `GET /v1/models` lists."""
    try:
        response = await client.get(f"{url}/v1/models")
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise ConnectionError(f"cannot list the models at {url}/v1/models: {exc}") from exc
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


class HttpLoadGenerator:
    def __init__(
        self,
        url: str,
        workload: Workload,
        model: str | None = None,
        speed: float = 1.0,
        name: str = "http",
        max_connections: int = 1024,
        timeout_s: float = 120.0,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.url = url.rstrip("/")
        self.workload = workload
        self.model = model
        self.speed = speed
        self.name = name
        self.stats = ClientStats()
        self.sent = 0
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._timeout = httpx.Timeout(timeout_s, connect=10.0, pool=None)
        self._client: httpx.AsyncClient | None = None
        self._inflight: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> HttpLoadGenerator:
        self._client = httpx.AsyncClient(limits=self._limits, timeout=self._timeout)
        if self.model is None:
            self.model = await discover_model(self._client, self.url)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._inflight:
            task.cancel()
        if self._inflight:
            await asyncio.wait(self._inflight)
        if self._client is not None:
            await self._client.aclose()

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def body(self, i: int) -> dict[str, object]:
        w = self.workload
        return {
            "model": self.model,
            "prompt": prompt_ids(int(w.replay[i]), int(w.prompt[i])),
            "max_tokens": int(w.output[i]),
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "switchyard_replay": int(w.replay[i]),
        }

    async def one(self, request_id: str, body: dict[str, object], due: float) -> None:
        """Send one request; `due` is its scheduled send time (`time.monotonic()`), the latencies' origin."""
        assert self._client is not None, "use `async with HttpLoadGenerator(...)`"
        first = last = 0.0
        tokens, done = 0, False
        try:
            async with self._client.stream(
                "POST", f"{self.url}/v1/completions", json=body, headers={"x-request-id": request_id}
            ) as response:
                if response.status_code != 200:
                    self.stats.failed[f"http_{response.status_code}"] += 1
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        self.stats.failed["stream_error"] += 1
                        return
                    if chunk.get("usage") and not chunk.get("choices"):
                        tokens = int(chunk["usage"]["completion_tokens"])
                        continue
                    if any(c.get("text") for c in chunk.get("choices", [])):
                        last = time.monotonic()
                        first = first or last
        except httpx.HTTPError as exc:
            self.stats.failed[type(exc).__name__] += 1
            return
        if not done or not first:
            self.stats.failed["incomplete_stream"] += 1
            return
        self.stats.ttft.append(first - due)
        if tokens > 1:
            self.stats.tpot.append((last - first) / (tokens - 1))
        self.stats.tokens += tokens

    async def run(self, duration_s: float | None = None, repeat: bool = False) -> None:
        """Send the workload at its (scaled) arrival times for at most `duration_s` wall seconds; with
        `repeat`, start over (shifted by its span) each time it runs out. Returns once everything is sent."""
        async for cycle, i, due in paced_arrivals(self.workload, self.speed, duration_s, repeat):
            task = asyncio.create_task(self.one(f"{self.name}-{cycle}-{i}", self.body(i), due))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            self.sent += 1

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every sent request has finished (True) or `timeout_s` passes (False)."""
        if not self._inflight:
            return True
        _, pending = await asyncio.wait(set(self._inflight), timeout=timeout_s)
        return not pending
