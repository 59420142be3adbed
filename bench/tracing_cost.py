"""What tracing costs a request: the router's `Bus.serve` callback with tracing off (as before it existed: the code
of a git revision, `--base`, loaded beside this one) and on, and the gateway's spans for one DP request when on.

Off must cost ~nothing: the request paths test `tracing is None` and skip the rest. The serve callback is timed
on a fake message and a no-op `respond` (no socket), so what differs between the rows is the code's own work.

Usage: .venv/bin/python bench/tracing_cost.py [--base 5f2eb79] [--rounds 7] [--n 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from prometheus_client import REGISTRY

from switchyard.shared import tracing
from switchyard.shared.bus import Bus
from switchyard.shared.codec import encode
from switchyard.shared.schemas import RouteDpRequest
from switchyard.shared.settings import SwitchyardSettings

REPO = Path(__file__).resolve().parents[1]


class _Nc:
    """Just enough of a nats-py client for `Bus.serve`: it hands back the callback."""

    def __init__(self) -> None:
        self.cb: Any = None

    def jetstream(self) -> None:
        return None

    async def subscribe(self, subject: str, queue: str = "", cb: Any = None) -> Any:
        self.cb = cb
        return type("Sub", (), {"pending_msgs": 0})()


class _Msg:
    def __init__(self, data: bytes, headers: dict[str, str] | None) -> None:
        self.subject, self.reply, self.data, self.headers = "sy.route.dp", "_INBOX.x", data, headers

    async def respond(self, payload: bytes) -> None:
        pass


def _bus_module_at(revision: str) -> Any:
    """`shared/bus.py` as it was at `revision`, imported under another name."""
    text = subprocess.run(
        ["git", "show", f"{revision}:shared/bus.py"], cwd=REPO, capture_output=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "bus_base.py"
    path.write_bytes(text)
    spec = importlib.util.spec_from_file_location("switchyard_bench_bus_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    register = REGISTRY.register
    REGISTRY.register = lambda _collector: None  # type: ignore[method-assign]  # its counters: already there
    try:
        spec.loader.exec_module(module)
    finally:
        REGISTRY.register = register  # type: ignore[method-assign]
    return module


async def _serve_us(bus_cls: Any, n: int, rounds: int, traced: tracing.Tracing | None, headers: Any) -> float:
    nc = _Nc()
    bus = bus_cls(nc, SwitchyardSettings(nats_servers=["nats://127.0.0.1:1"]))
    kwargs = {"tracing": traced, "span_name": "route.dp"} if traced is not None else {}
    await bus.serve("sy.route.dp", RouteDpRequest, lambda r: b"ok", **kwargs)
    msg = _Msg(encode(RouteDpRequest(request_id="r1", prompt_tokens=100, model="m")), headers)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(n):
            await nc.cb(msg)
        best = min(best, (time.perf_counter() - started) / n)
    return best * 1e6


def _gateway_spans_us(traced: tracing.Tracing, n: int, rounds: int) -> float:
    """The spans one DP request makes in the gateway when on: server, route, hop (with its traceparent)."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(n):
            with traced.server("POST /v1/completions", {}, {"http.route": "/v1/completions"}) as span:
                with traced.span("route.dp", "internal", {"switchyard.request_id": "r1"}) as route:
                    route.set_attribute("switchyard.engine_id", "e1")
                hop = traced.open("POST /v1/completions", "client", {"switchyard.engine_id": "e1"})
                traced.headers(hop)
                traced.end(hop)
                span.set_attribute("http.response.status_code", 200)
        best = min(best, (time.perf_counter() - started) / n)
    return best * 1e6


class _Dropped(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _batched(sampler: Sampler | None = None) -> tracing.Tracing:
    provider = TracerProvider(sampler=sampler, resource=Resource.create({"service.name": "bench"}))
    provider.add_span_processor(BatchSpanProcessor(_Dropped()))
    return tracing.Tracing(provider)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="5f2eb79", help="a revision whose shared/bus.py has no tracing")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--n", type=int, default=20000)
    args = parser.parse_args()
    base = _bus_module_at(args.base).Bus
    exporter = InMemorySpanExporter()
    with tracing.exporting_to(exporter):
        traced = tracing.start("bench")
    assert traced is not None
    rows = []
    for _ in range(2):  # alternating, so drift on a shared machine hits both alike
        rows.append(("serve, before tracing", await _serve_us(base, args.n, args.rounds, None, None)))
        rows.append(("serve, tracing off", await _serve_us(Bus, args.n, args.rounds, None, None)))
    headers = traced.headers(traced.open("parent"))
    rows.append(("serve, tracing on", await _serve_us(Bus, args.n // 4, args.rounds, traced, headers)))
    exporter.clear()
    rows.append(("gateway spans, in-memory", _gateway_spans_us(traced, args.n // 4, args.rounds)))
    batched = _batched()  # as a deployment exports: spans queued, a thread sends them (here: drops them)
    rows.append(("serve, batched export", await _serve_us(Bus, args.n // 4, args.rounds, batched, headers)))
    rows.append(("gateway spans, batched", _gateway_spans_us(batched, args.n // 4, args.rounds)))
    batched.close()
    unsampled = _batched(ParentBased(TraceIdRatioBased(0.0)))  # OTEL_TRACES_SAMPLER: a request not sampled
    rows.append(("gateway spans, not sampled", _gateway_spans_us(unsampled, args.n // 4, args.rounds)))
    unsampled.close()
    best: dict[str, float] = {}
    for name, us in rows:
        best[name] = min(best.get(name, us), us)
    for name, us in best.items():
        print(f"{name:30s} {us:8.2f} µs per request (best of {args.rounds} rounds)")
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
