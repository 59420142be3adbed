"""Hostile input at volume: >= 100,000 malformed messages on every subject against the services as processes.

The router, placement and migration services run as their own processes (`switchyard router` ...) on an
embedded nats-server and a SQLite file, each serving its Prometheus metrics. This script sends the
`tests/hostile.py` variants (wrong versions and types, bad dimensions, NaN, deep nesting, random and flipped
bytes, a few payloads at the size limit) round-robin over hello, telemetry, expert-load, routing requests
(decode and DP), plans, calibration requests, routing samples and the artifact bucket, then checks:

- every service is still running and the router still routes (a valid request after the flood);
- every request got an ErrorReply with a code and a message;
- every refused message was counted (`switchyard_bus_rejected_total`, scraped from each service);
- each service's resident memory (VmRSS) before and after.

    python bench/hostile_input.py                 # 100,000 messages (~2-4 minutes on 2 cores)
    python bench/hostile_input.py --messages 20000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
from chaos_infra import ServiceProcess, cli, free_port, service_env
from nats.js.errors import BadRequestError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/hostile.py, the generators
from tests.hostile import hostile

log = logging.getLogger("hostile")
#: Payloads at the size limit are 8 MiB each: a few per subject say what they need to.
AT_LIMIT_PER_SUBJECT = 3


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scrape(port: int) -> dict[str, float]:
    """switchyard_bus_rejected_total by subscription label (and the router's refused artifact revisions under
    "artifact"), from one service's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("switchyard_bus_rejected_total{"):
            labels, value = line.rsplit(" ", 1)
            subscription = labels.split('subscription="', 1)[1].split('"', 1)[0]
            counts[subscription] += float(value)
        elif line.startswith("switchyard_router_artifacts_refused_total{"):
            counts["artifact"] += float(line.rsplit(" ", 1)[1])
    return dict(counts)


def _valid(now: float) -> dict[str, object]:
    from switchyard.shared.schemas import (
        CalibrationRequest,
        Capacity,
        ExpertLoad,
        Hello,
        ModelShape,
        ObjectiveTerms,
        PlacementParams,
        PlacementPlan,
        RouteDecodeRequest,
        RouteDpRequest,
        RoutingSample,
        Telemetry,
    )
    from switchyard.solver.placement.layouts import default_layout

    counts = np.ones((4, 8), np.uint16)
    return {
        "hello": Hello(
            engine_id="d0",
            role="decode",
            model=ModelShape(name="tiny", num_layers=4, num_experts=8, top_k=2),
            ep_group="d0",
            gpus=["g0", "g1"],
            capacity=Capacity(max_running=64, kv_blocks=1000, block_size=16),
            ts=now,
            agent="sim",
        ),
        "telemetry": Telemetry(
            engine_id="d0",
            seq=0,
            ts=now,
            kv_usage=0.1,
            num_running=0,
            num_waiting=0,
            waiting_prefill_tokens=0,
            remaining_prefill_tokens=0,
            step_time_ema=0.01,
        ),
        "expert_load": ExpertLoad(
            engine_id="d0", ep_group="d0", seq=0, window_start=now - 1, window_end=now, expert_counts=counts
        ),
        "route_decode": RouteDecodeRequest(request_id="r", prompt_tokens=3, signature=counts),
        "route_dp": RouteDpRequest(request_id="r", prompt_tokens=3),
        "plan": PlacementPlan(
            plan_id="p1",
            version=1,
            engine_group="d0",
            created_at=now,
            source="manual",
            gpus=["g0", "g1"],
            placement=default_layout(4, 8, 2),
            moves=np.zeros((0, 6), np.int32),
            objective=ObjectiveTerms(load=1.0, comm=0.0, mig=0.0, total=1.0),
            params=PlacementParams(alpha=1.0, beta=1.0, gamma=1.0),
        ),
        "calibration_request": CalibrationRequest(request_id="c1", requested_at=now),
        "sample": RoutingSample(
            engine_id="d0",
            request_id="r",
            ts=now,
            prompt_tokens=1,
            decode_tokens=1,
            prefill_counts=counts,
            decode_counts=counts,
        ),
        "artifact": RouteDpRequest(request_id="not-an-artifact", prompt_tokens=1),  # any bytes will do there
    }


async def flood(n: int, root: Path, seed: int) -> int:
    from switchyard.services.refit import read_samples
    from switchyard.shared.bus import Bus
    from switchyard.shared.codec import ErrorReply, decode
    from switchyard.shared.embedded import EmbeddedNats
    from switchyard.shared.schemas import RouteDecodeReply, RouteDecodeRequest
    from switchyard.shared.settings import SwitchyardSettings

    nats = EmbeddedNats(root / "nats")
    url = await asyncio.to_thread(nats.start)
    database_url = f"sqlite:///{root / 'hostile.db'}"
    ports = {"router": free_port(), "placement": free_port(), "migration": free_port()}
    env = service_env(
        {
            "SWITCHYARD_NATS_SERVERS": url,
            "SWITCHYARD_DATABASE_URL": database_url,
            "SWITCHYARD_ROUTER_METRICS_PORT": str(ports["router"]),
            "SWITCHYARD_PLACEMENT_METRICS_PORT": str(ports["placement"]),
            "SWITCHYARD_MIGRATION_METRICS_PORT": str(ports["migration"]),
            "SWITCHYARD_ROUTER_POLICY": "jsq",
        }
    )
    (root / "logs").mkdir(exist_ok=True)
    procs = {name: ServiceProcess(name, cli(name), env, root / "logs" / f"{name}.log") for name in ports}
    settings = SwitchyardSettings(nats_servers=[url])
    bus = await Bus.connect(settings, name="hostile")
    try:
        await bus.ensure_streams()
        kv = await bus.ensure_kv(bus.subjects.router_bucket)
        for proc in procs.values():
            proc.start()
            proc.ready_port = ports[proc.name]
        for proc in procs.values():
            await asyncio.to_thread(proc.wait_port, 120)
        await asyncio.sleep(2.0)
        s = bus.subjects
        rss_before = {name: rss_mib(p.process.pid) for name, p in procs.items()}  # type: ignore[union-attr]
        rejected_before = {name: scrape(port) for name, port in ports.items()}
        rng = np.random.default_rng(seed)
        valid = _valid(time.time())
        streams = {
            name: hostile(message, np.random.default_rng(rng.integers(2**32)), bus.max_payload)  # type: ignore[arg-type]
            for name, message in valid.items()
        }
        sent: Counter[str] = Counter()
        refused: Counter[str] = Counter()
        at_limit: Counter[str] = Counter()
        bad_answers: list[str] = []
        names = itertools.cycle(valid)
        started = time.monotonic()
        requests: list[asyncio.Task[None]] = []

        stream_refused: Counter[str] = Counter()

        async def to_stream(name: str, subject: str, payload: bytes) -> None:
            """A payload larger than the stream's messages may be is refused by NATS itself (issue 29): it never
            reaches a consumer, so it is counted apart."""
            try:
                await bus.js.publish(subject, payload)
            except BadRequestError as exc:
                if exc.err_code != 10054:  # message size exceeds maximum allowed
                    raise
                refused[name] -= 1
                stream_refused[name] += 1

        async def ask(subject: str, payload: bytes) -> None:
            try:
                msg = await bus.nc.request(subject, payload, timeout=30)
                reply = decode(msg.data, ErrorReply)
                if not (reply.error.code and reply.error.message):
                    bad_answers.append(f"{subject}: empty error")
            except Exception as exc:
                bad_answers.append(f"{subject}: {type(exc).__name__}: {exc}")

        i = -1
        while sum(sent.values()) < n:
            i += 1
            name = next(names)
            kind, payload, is_refused = next(streams[name])
            while kind == "at_limit" and at_limit[name] >= AT_LIMIT_PER_SUBJECT:
                kind, payload, is_refused = next(streams[name])
            if kind == "at_limit":
                at_limit[name] += 1
            is_refused = is_refused or name == "artifact"  # nothing here is a RoutingArtifact
            if not is_refused:
                continue  # schema-valid hostile messages are for the CI test; here every one must be refused
            sent[name] += 1
            refused[name] += is_refused
            if name == "hello":
                await bus.nc.publish(s.hello("x9"), payload)
            elif name == "telemetry":
                await bus.nc.publish(s.telemetry("x9"), payload)
            elif name == "expert_load":
                await to_stream(name, s.expert_load("x9"), payload)
            elif name == "plan":
                await to_stream(name, s.placement_plan, payload)
            elif name == "calibration_request":
                await to_stream(name, s.calibration_request, payload)
            elif name == "sample":
                await to_stream(name, s.routing_samples, payload)
            elif name == "artifact":
                if i % 50 == 0:  # a KV revision each: a few thousand is plenty
                    await kv.put(s.artifact_key, payload)
                else:
                    sent[name] -= 1
                    refused[name] -= is_refused
            else:
                subject = s.route_decode if name == "route_decode" else s.route_dp
                requests.append(asyncio.create_task(ask(subject, payload)))
                if len(requests) >= 64:
                    await asyncio.gather(*requests)
                    requests.clear()
            if i % 10_000 == 0 and i:
                await bus.nc.flush()
                log.info("%d sent (%.0f msg/s)", i, i / (time.monotonic() - started))
        await asyncio.gather(*requests)
        await bus.nc.flush()
        elapsed = time.monotonic() - started
        await asyncio.sleep(5.0)  # the JetStream consumers catch up
        alive = {name: p.alive() for name, p in procs.items()}
        # the router still routes: a live decoder and a valid request
        hello, telemetry = valid["hello"], valid["telemetry"]
        await bus.publish(s.hello("d0"), hello.model_copy(update={"ts": time.time()}))  # type: ignore[attr-defined]
        await bus.publish(s.telemetry("d0"), telemetry.model_copy(update={"ts": time.time()}))  # type: ignore[attr-defined]
        await bus.nc.flush()
        await asyncio.sleep(0.3)
        reply = await bus.request(
            s.route_decode, RouteDecodeRequest(request_id="ok", prompt_tokens=1), RouteDecodeReply
        )
        samples = await read_samples(bus, limit=10**7)
        rss_after = {name: rss_mib(p.process.pid) for name, p in procs.items()}  # type: ignore[union-attr]
        rejected_after = {name: scrape(port) for name, port in ports.items()}
    finally:
        for proc in procs.values():
            proc.stop()
        await bus.close()
        await asyncio.to_thread(nats.stop)

    counted = {
        service: {
            k: rejected_after[service].get(k, 0) - rejected_before[service].get(k, 0) for k in rejected_after[service]
        }
        for service in ports
    }
    labels = {
        "hello": s.all_hello,
        "telemetry": s.all_telemetry,
        "expert_load": s.all_expert_load,
        "plan": s.placement_plan,
        "calibration_request": s.calibration_request,
        "route_decode": s.route_decode,
        "route_dp": s.route_dp,
        "artifact": "artifact",
    }
    print(f"{'subject':<22}{'sent':>8}{'refused':>9}  counted by service")
    for name in valid:
        label = labels.get(name)
        by = {svc: int(c[label]) for svc, c in counted.items() if label and c.get(label)}
        extra = "(switchyard_router_artifacts_refused_total)" if name == "artifact" else ""
        if name == "sample":
            extra = (
                f"(the `switchyard fit --from-stream` reader: {samples.rejected} rejected, {len(samples.samples)} kept)"
            )
        if stream_refused[name]:
            extra += f" (+{stream_refused[name]} larger than the stream takes, refused by NATS)"
        print(f"{name:<22}{sent[name]:>8}{refused[name]:>9}  {by or ''} {extra}")
    print(f"{'service':<12}{'alive':>7}{'RSS before MiB':>16}{'RSS after MiB':>15}")
    for name in ports:
        print(f"{name:<12}{alive[name]!s:>7}{rss_before[name]:>16.1f}{rss_after[name]:>15.1f}")
    problems = []
    for name, label in labels.items():
        got = [int(c.get(label, 0)) for c in counted.values() if c.get(label)]
        if not got or any(g % refused[name] for g in got if refused[name]):
            problems.append(f"{name}: {refused[name]} refused, counted {got}")
    if samples.rejected != refused["sample"] or samples.samples:
        problems.append(f"samples: {refused['sample']} refused, the reader rejected {samples.rejected}")
    problems += bad_answers[:5]
    if not all(alive.values()):
        problems.append(f"service died: {alive}")
    if reply.engine_id != "d0":
        problems.append(f"router routed to {reply.engine_id}")
    total = sum(sent.values())
    growth = max(rss_after[k] - rss_before[k] for k in ports)
    print(
        f"hostile: {total} messages in {elapsed:.0f} s, {sum(alive.values())}/{len(alive)} services alive, "
        f"router routes, {len(bad_answers)} requests without an error reply, largest RSS growth {growth:+.1f} MiB"
    )
    for problem in problems:
        print(f"problem: {problem}")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("switchyard").setLevel(logging.WARNING)
    logging.getLogger("switchyard.services.refit").setLevel(logging.ERROR)  # one line per refused sample
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return asyncio.run(flood(args.messages, args.workdir, args.seed))
    with tempfile.TemporaryDirectory(prefix="hostile-") as root:
        return asyncio.run(flood(args.messages, Path(root), args.seed))


if __name__ == "__main__":
    sys.exit(main())
