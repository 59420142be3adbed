"""Request workloads for the simulator: when requests arrive, how long they are, which trace request they replay.

Arrivals and token lengths come from a real request trace (the Azure LLM inference CSVs or Mooncake's JSONL
trace with prefix hashes, shipped in `switchyard.data`, with a time-compression factor) or, for rate sweeps
without a trace, from a Poisson process at a given rate with each replayed trace request's own prompt/output
lengths. Which
routing-trace request each simulated request replays is drawn with replacement from the replay pool,
deterministically from the seed. Replay choices and arrivals draw from their own named streams
(`shared.streams`), never from the router's.
"""

from __future__ import annotations

import asyncio
import csv
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from switchyard.shared.streams import stream
from switchyard.simulator.core.request_burstgpt import is_burstgpt_header, read_burstgpt_csv
from switchyard.simulator.core.request_jsonl import MOONCAKE_BLOCK_TOKENS, read_request_jsonl

__all__ = [
    "RequestTrace",
    "Workload",
    "build_workload",
    "load_burstgpt_csv",
    "load_request_csv",
    "load_request_jsonl",
    "load_requests",
]


@dataclass(frozen=True)
class RequestTrace:
    """A production request trace: arrival offsets (s, from the first request) and token counts."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    source: str
    #: Per request, its prompt's prefix block hash ids (JSONL traces that carry them), and their block (tokens).
    hash_ids: tuple[np.ndarray, ...] | None = None
    hash_block: int = 0
    #: Rows of the file left out because they cannot be replayed (BurstGPT's zero-token failed requests).
    dropped: int = 0

    @property
    def duration(self) -> float:
        return float(self.arrival[-1] - self.arrival[0]) if len(self.arrival) else 0.0

    @property
    def rate(self) -> float:
        return (len(self.arrival) - 1) / self.duration if self.duration > 0 else 0.0


def load_request_csv(path: str | Path) -> RequestTrace:
    """A request CSV by its header, sorted by time: Azure's LLM inference trace (`TIMESTAMP, ContextTokens,
    GeneratedTokens`) or BurstGPT's (`load_burstgpt_csv`)."""
    path = Path(path)
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader)]
        if is_burstgpt_header(header):
            return load_burstgpt_csv(path)
        cols = {name: header.index(name) for name in ("TIMESTAMP", "ContextTokens", "GeneratedTokens")}
        rows = list(reader)
    if not rows:
        raise ValueError(f"{path}: no requests")
    ts = np.array([r[cols["TIMESTAMP"]] for r in rows], dtype="datetime64[ns]")
    order = np.argsort(ts, kind="stable")
    t = (ts[order] - ts[order][0]).astype(np.int64) / 1e9
    prompt = np.array([int(r[cols["ContextTokens"]]) for r in rows], dtype=np.int64)[order]
    output = np.array([int(r[cols["GeneratedTokens"]]) for r in rows], dtype=np.int64)[order]
    return RequestTrace(arrival=t, prompt=prompt, output=output, source=str(path))


def load_burstgpt_csv(path: str | Path) -> RequestTrace:
    """A BurstGPT CSV (`request_burstgpt`), sorted by time; zero-token rows dropped, counted in `dropped`."""
    cols = read_burstgpt_csv(path)
    order = np.argsort(cols.timestamp_s, kind="stable")
    t = cols.timestamp_s[order] - cols.timestamp_s[order][0]
    return RequestTrace(
        arrival=t, prompt=cols.prompt[order], output=cols.output[order], source=str(path), dropped=cols.dropped
    )


def load_request_jsonl(path: str | Path, hash_block: int = MOONCAKE_BLOCK_TOKENS) -> RequestTrace:
    """A JSONL request trace (`request_jsonl`), sorted by time; `hash_block`: tokens per hash id."""
    cols = read_request_jsonl(path)
    order = np.argsort(cols.timestamp_ms, kind="stable")
    t = (cols.timestamp_ms[order] - cols.timestamp_ms[order][0]) / 1e3
    ids = None if cols.hash_ids is None else tuple(cols.hash_ids[i] for i in order.tolist())
    return RequestTrace(
        arrival=t,
        prompt=cols.prompt[order],
        output=cols.output[order],
        source=str(path),
        hash_ids=ids,
        hash_block=hash_block if ids is not None else 0,
    )


def load_requests(path: str | Path) -> RequestTrace:
    """A request trace by its shape: JSONL (`.jsonl`, or a first non-blank character ``{``) or a CSV (Azure's or
    BurstGPT's, by its header)."""
    path = Path(path)
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        return load_request_jsonl(path)
    with path.open(encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    return load_request_jsonl(path) if head.startswith("{") else load_request_csv(path)


@dataclass(frozen=True)
class Workload:
    """N simulated requests, sorted by arrival: times (s), prompt/output tokens, replayed bank row."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    replay: np.ndarray
    description: str
    #: Per request, the hash ids of its prompt's prefix blocks (None: the trace has none) and their block.
    hash_ids: tuple[np.ndarray, ...] | None = None
    hash_block: int = 0

    @property
    def size(self) -> int:
        return int(self.arrival.shape[0])

    @property
    def offered_rate(self) -> float:
        span = float(self.arrival[-1] - self.arrival[0]) if self.size > 1 else 0.0
        return (self.size - 1) / span if span > 0 else 0.0


def build_workload(
    num_requests: int,
    replay_pool: np.ndarray,
    pool_prompt: np.ndarray,
    pool_output: np.ndarray,
    seed: int,
    rate: float | None = None,
    requests: RequestTrace | None = None,
    time_scale: float = 1.0,
    max_tokens: int | None = None,
) -> Workload:
    """Draw `num_requests` requests.

    - `requests` and no `rate`: the first `num_requests` of the trace (cycled, shifted by the trace's span,
      if more are asked for), arrival times divided by `time_scale`, its prompt/output lengths.
    - `requests` and `rate`: Poisson arrivals at `rate` req/s with the trace's first `num_requests` lengths.
    - `rate` only: Poisson arrivals with the replayed trace request's own lengths (`pool_prompt[i]`,
      `pool_output[i]` for pool entry i). Beware: in a routing trace, length often follows the domain (ESFT
      summaries decode ~8x longer than intents), so a locality policy then also segregates long requests.

    `max_tokens` clips prompt + output (so each request fits a decode engine's KV cache), prompt first.
    """
    if num_requests <= 0:
        raise ValueError("num_requests must be positive")
    pick = stream(seed, "workload.replay").integers(len(replay_pool), size=num_requests)
    replay = np.asarray(replay_pool)[pick]
    if rate is not None and rate <= 0:
        raise ValueError("rate must be positive")
    if rate is not None:
        arrival = np.cumsum(stream(seed, "workload.arrival").exponential(1.0 / rate, size=num_requests))
        arrival -= arrival[0]
    if requests is not None:
        n = len(requests.arrival)
        idx = np.arange(num_requests)
        prompt = requests.prompt[idx % n].copy()
        output = requests.output[idx % n].copy()
        name = Path(requests.source).name
        if requests.dropped:
            name += f" ({requests.dropped} zero-token rows dropped)"
        if rate is None:
            if time_scale <= 0:
                raise ValueError("time_scale must be positive")
            span = requests.duration + (requests.duration / max(n - 1, 1))
            arrival = (requests.arrival[idx % n] + (idx // n) * span) / time_scale
            span_n = float(arrival[-1] - arrival[0]) if num_requests > 1 else 0.0
            rate_n = (num_requests - 1) / span_n if span_n > 0 else 0.0
            desc = f"{name}, first {num_requests} requests, time / {time_scale:g} ({rate_n:.1f} req/s)"
        else:
            desc = f"Poisson {rate:g} req/s, lengths of the first {num_requests} requests of {name}"
    elif rate is not None:
        prompt = np.asarray(pool_prompt)[pick].copy()
        output = np.asarray(pool_output)[pick].copy()
        desc = f"Poisson {rate:g} req/s, lengths of the replayed trace requests"
    else:
        raise ValueError("give a positive rate or a request trace")
    prompt = np.maximum(prompt, 1)
    output = np.maximum(output, 1)
    if max_tokens is not None:
        output = np.minimum(output, max_tokens - 1)
        prompt = np.minimum(prompt, max_tokens - output)
    hash_ids = None
    if requests is not None and requests.hash_ids is not None:
        hash_ids = tuple(requests.hash_ids[i % len(requests.arrival)] for i in range(num_requests))
    return Workload(
        arrival=arrival,
        prompt=prompt,
        output=output,
        replay=replay,
        description=desc,
        hash_ids=hash_ids,
        hash_block=requests.hash_block if hash_ids is not None and requests is not None else 0,
    )


async def paced_arrivals(
    workload: Workload, speed: float, duration_s: float | None = None, repeat: bool = False
) -> AsyncIterator[tuple[int, int, float]]:
    """Yield `(cycle, i, due)` as each request of `workload` falls due, `due` in `time.monotonic()` seconds.

    Arrival times are divided by `speed`; the run stops once a request would fall due after `duration_s`
    wall seconds; with `repeat` the workload starts over, shifted by its span, each time it runs out. Both
    load generators (bus and HTTP) send on this clock, so their loads are the same.
    """
    w = workload
    span = float(w.arrival[-1] - w.arrival[0]) + 1.0 / max(w.offered_rate, 1e-9) if w.size > 1 else 1.0
    start = time.monotonic()
    cycle = 0
    while True:
        for i in range(w.size):
            due = start + (cycle * span + float(w.arrival[i])) / speed
            if duration_s is not None and due - start > duration_s:
                return
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            yield cycle, i, due
        if not repeat:
            return
        cycle += 1
