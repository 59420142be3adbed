"""`sy.route.decode` over a real nats-server: round trip against a bare echo, and routes per second per replica.

Budgets (DESIGN.md, issue 5): round trip ≤ 1.3× a bare nats-py echo of the same payload sizes at p50 and p99
(and ≤ 1 ms p99); ≥ 5,000 routes/s per router replica.

Set-up, every part in its own process, so no two share an event loop:

- a private nats-server (`shared.embedded.EmbeddedNats`);
- the routing artifact: `fit_routing_artifact` on the real ESFT trace (DeepSeek-V2-Lite, 26 layers × 64
  experts, 213 requests), K = 16 decoders named `decode-00..15`, put into the KV bucket;
- 16 decode engines (`--role engines`): hello on start, on announce and every 5 s; telemetry every 100 ms
  with a random walk of running requests;
- router replicas: `switchyard router` subprocesses (policy eldr), configured by environment only;
- an echo responder (`--role echo`): a plain nats-py subscription that answers every request with a fixed
  payload of the router's reply size;
- the client: this process. Requests are the ESFT requests' real prefill counts, the full [26, 64] uint16
  matrix (`layers` None, as a prefill agent that does not know the artifact sends them), encoded once
  (3.4 KiB each); the echo gets the very same bytes.

Round trip: one request in flight, router and echo alternating request by request (so load drift on this
shared machine hits both alike), `nc.request` timed with perf_counter_ns; p50/p99 of each and their ratio.
Every router reply is decoded afterwards and must name an engine with the artifact in use.

Throughput: C client tasks each keep one request in flight for `--duration` seconds; routes/s, latency
percentiles, and the CPU time the router process(es), nats-server and client spent during the window (from
/proc), so "CPU µs per route" tells what one replica costs a core even when the 2 cores are shared.

Usage: .venv/bin/python bench/router_bus.py [--rtt-requests 2000] [--duration 5] [--concurrency 16,64]
                                            [--replicas 1,2] [--profile DIR] [--json PATH]
`--profile DIR` runs each router under cProfile and writes DIR/router-<i>.prof when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _single_core
import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "out"
DECODERS = 16
PREFIX = "bench"
ECHO_SUBJECT = f"{PREFIX}.echo"
FLOOR_SUBJECT = f"{PREFIX}.floor"
TICKS = os.sysconf("SC_CLK_TCK")


def decoder_ids() -> list[str]:
    return [f"decode-{i:02d}" for i in range(DECODERS)]


# ----- helper processes ------------------------------------------------------------------------------------


async def run_engines(url: str, model: dict) -> None:
    """16 decode engines on one connection: hello (start, announce, every 5 s), telemetry every 100 ms."""
    from switchyard.engine_agents.core.announce import AnnounceAnswerer
    from switchyard.shared.bus import Bus
    from switchyard.shared.schemas import Announce, Capacity, Hello, ModelShape, Telemetry
    from switchyard.shared.settings import SwitchyardSettings

    bus = await Bus.connect(SwitchyardSettings(nats_servers=[url], subject_prefix=PREFIX), name="bench-engines")
    shape = ModelShape(**model)
    ids = decoder_ids()
    rng = random.Random(0)
    running = dict.fromkeys(ids, 4)

    async def hello(engine_id: str) -> None:
        capacity = Capacity(max_running=64, kv_blocks=4096, block_size=16)
        message = Hello(
            engine_id=engine_id,
            role="decode",
            model=shape,
            ep_group=engine_id,
            gpus=["0"],
            capacity=capacity,
            ts=time.time(),
            agent="sim",
        )
        await bus.publish(bus.subjects.hello(engine_id), message)

    interval = bus.settings.announce_min_interval_s
    answerers = {e: AnnounceAnswerer(functools.partial(hello, e), interval) for e in ids}  # as engines answer

    async def on_announce(message: Announce, _msg: object) -> None:
        for engine_id in ids:
            if message.engine_id in (None, engine_id):
                await answerers[engine_id].on_announce()

    await bus.subscribe(bus.subjects.announce, Announce, on_announce)
    seq = 0
    while True:
        if seq % 50 == 0:
            for engine_id in ids:
                await hello(engine_id)
        for engine_id in ids:
            running[engine_id] = min(32, max(0, running[engine_id] + rng.choice((-1, 0, 1))))
            await bus.publish(
                bus.subjects.telemetry(engine_id),
                Telemetry(
                    engine_id=engine_id,
                    seq=seq,
                    ts=time.time(),
                    kv_usage=running[engine_id] / 64,
                    num_running=running[engine_id],
                    num_waiting=0,
                    waiting_prefill_tokens=0,
                    remaining_prefill_tokens=0,
                    step_time_ema=0.02,
                ),
            )
        seq += 1
        await asyncio.sleep(0.1)


async def run_echo(url: str, reply_size: int) -> None:
    """A bare nats-py responder: every request gets the same `reply_size` bytes back."""
    import nats

    nc = await nats.connect(url, name="bench-echo")
    reply = b"x" * reply_size

    async def on_request(msg) -> None:
        await msg.respond(reply)

    await nc.subscribe(ECHO_SUBJECT, cb=on_request)
    await asyncio.Event().wait()


async def run_floor(url: str) -> None:
    """Switchyard's bus layer alone: `Bus.serve` (decode and validate the request, encode the reply) answering
    a constant decision shaped like the router's, so the round trip splits into bus layer and decision."""
    from switchyard.shared.bus import Bus
    from switchyard.shared.schemas import RouteDecodeReply, RouteDecodeRequest
    from switchyard.shared.settings import SwitchyardSettings

    bus = await Bus.connect(SwitchyardSettings(nats_servers=[url], subject_prefix=PREFIX), name="bench-floor")

    def answer(request: RouteDecodeRequest) -> RouteDecodeReply:
        return RouteDecodeReply(
            request_id=request.request_id,
            engine_id="decode-07",
            policy="eldr",
            band_size=6,
            decision_us=12.345678,
            artifact_version=1,
        )

    await bus.serve(FLOOR_SUBJECT, RouteDecodeRequest, answer)
    await asyncio.Event().wait()


# ----- process bookkeeping -----------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Procs:
    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(args, env={**os.environ, **(env or {})}, cwd=REPO, stdin=subprocess.DEVNULL)
        self.procs[name] = proc
        return proc

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def cpu(self, names: list[str]) -> float:
        return sum(cpu_seconds(self.procs[n].pid) for n in names)


def helper(role: str, *args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--role", role, *args]


def router_command(profile_dir: Path | None, index: int) -> list[str]:
    switchyard = str(Path(sys.executable).parent / "switchyard")
    if profile_dir is None:
        return [switchyard, "router"]
    return [sys.executable, "-m", "cProfile", "-o", str(profile_dir / f"router-{index}.prof"), switchyard, "router"]


def percentiles(ns: np.ndarray) -> dict[str, float]:
    p50, p90, p99, p999 = np.percentile(ns, [50, 90, 99, 99.9]) / 1e3
    return {"p50_us": p50, "p90_us": p90, "p99_us": p99, "p999_us": p999, "mean_us": float(ns.mean() / 1e3)}


# ----- the client --------------------------------------------------------------------------------------------


def esft_requests() -> tuple[list[bytes], object]:
    """The artifact fitted on ESFT (K = 16) and one encoded RouteDecodeRequest per ESFT request."""
    from eldr_data import esft_counts

    from switchyard.shared.codec import encode
    from switchyard.shared.schemas import RouteDecodeRequest
    from switchyard.solver.eldr_fit import fit_routing_artifact

    counts = esft_counts()
    artifact, _ = fit_routing_artifact(counts, DECODERS, decoder_ids=decoder_ids())
    tokens = counts.prefill_tokens
    assert counts.prefill.max() < 1 << 16
    payloads = [
        encode(
            RouteDecodeRequest(
                request_id=f"esft-{i:04d}", prompt_tokens=int(tokens[i]), signature=counts.prefill[i].astype("<u2")
            )
        )
        for i in range(counts.num_requests)
    ]
    return payloads, artifact


async def wait_routing(nc, subject: str, payload: bytes, within_s: float = 60.0) -> bytes:
    """Send requests until a router answers with the artifact in use; returns that reply."""
    from nats import errors as nats_errors

    from switchyard.shared.codec import decode_reply
    from switchyard.shared.errors import RemoteError
    from switchyard.shared.schemas import RouteDecodeReply

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            msg = await nc.request(subject, payload, timeout=1)
            reply = decode_reply(msg.data, RouteDecodeReply)
            if reply.artifact_version is not None and reply.fallback is None:
                return msg.data
        except (RemoteError, nats_errors.Error):  # no responders yet, no live engine yet
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError("no router answered with the artifact in use")


async def wait_replica(nc, subjects, replica_id: str, payloads: list[bytes], within_s: float = 60.0) -> None:
    """Route until a decision of `replica_id` shows up on sy.route.decided (it joined the queue group)."""
    seen = asyncio.Event()

    async def on_decided(msg) -> None:
        if replica_id.encode() in msg.data:
            seen.set()

    sub = await nc.subscribe(subjects.route_decided, cb=on_decided)
    deadline = time.monotonic() + within_s
    i = 0
    while not seen.is_set():
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {replica_id} never routed")
        await wait_routing(nc, subjects.route_decode, payloads[i % len(payloads)])
        i += 1
        await asyncio.sleep(0.02)
    await sub.unsubscribe()


def check_replies(replies: list[bytes]) -> dict:
    from switchyard.shared.codec import decode_reply
    from switchyard.shared.schemas import RouteDecodeReply

    decoded = [decode_reply(r, RouteDecodeReply) for r in replies]
    bad = [r for r in decoded if r.artifact_version is None or r.fallback is not None]
    engines = {r.engine_id for r in decoded}
    return {
        "replies": len(decoded),
        "with_fallback": len(bad),
        "engines_used": len(engines),
        "mean_band": float(np.mean([r.band_size for r in decoded])),
        "server_decision_us_p50": float(np.median([r.decision_us for r in decoded])),
    }


async def measure_rtt(nc, targets: dict[str, tuple[str, str]], payloads: list[bytes], n: int, procs: Procs) -> dict:
    """`targets`: label -> (subject, process name). One request in flight; the targets take turns, in an order
    that rotates every round, so drifting machine load hits each alike."""
    clock = time.perf_counter_ns
    labels = list(targets)
    times = {label: np.empty(n, dtype=np.int64) for label in labels}
    replies: list[bytes] = []
    cpu_before: dict[str, float] = {}
    for i in range(-200, n):  # 200 warm-up rounds
        if i == 0:
            cpu_before = {label: procs.cpu([name]) for label, (_, name) in targets.items()}
        payload = payloads[i % len(payloads)]
        shift = i % len(labels)
        for label in labels[shift:] + labels[:shift]:
            start = clock()
            msg = await nc.request(targets[label][0], payload, timeout=2)
            elapsed = clock() - start
            if i >= 0:
                times[label][i] = elapsed
                if label == "route":
                    replies.append(msg.data)
    result: dict = {label: percentiles(times[label]) for label in labels}
    result["cpu_us_per_request"] = {
        label: (procs.cpu([name]) - cpu_before[label]) / n * 1e6 for label, (_, name) in targets.items()
    }
    for label in labels:
        if label != "echo":
            result[f"{label}_ratio_p50"] = result[label]["p50_us"] / result["echo"]["p50_us"]
            result[f"{label}_ratio_p99"] = result[label]["p99_us"] / result["echo"]["p99_us"]
    result["check"] = check_replies(replies)
    return result


async def measure_throughput(
    nc,
    subject: str,
    payloads: list[bytes],
    concurrency: int,
    duration: float,
    procs: Procs,
    routers: list[str],
) -> dict:
    clock = time.perf_counter_ns
    latencies: list[int] = []
    replies: list[bytes] = []
    errors = 0
    stop_at = 0.0

    async def worker(w: int) -> None:
        nonlocal errors
        i = w
        while time.monotonic() < stop_at:
            start = clock()
            try:
                msg = await nc.request(subject, payloads[i % len(payloads)], timeout=5)
            except Exception:
                errors += 1
                continue
            latencies.append(clock() - start)
            if len(replies) < 2000:
                replies.append(msg.data)
            i += concurrency

    stop_at = time.monotonic() + 0.5  # warm-up
    await asyncio.gather(*[worker(w) for w in range(concurrency)])
    latencies.clear()
    replies.clear()
    cpu_before = {name: procs.cpu([name]) for name in [*routers, "nats"]}
    client_before = time.process_time()
    wall_start = time.perf_counter()
    stop_at = time.monotonic() + duration
    await asyncio.gather(*[worker(w) for w in range(concurrency)])
    wall = time.perf_counter() - wall_start
    client_cpu = time.process_time() - client_before
    cpu = {name: procs.cpu([name]) - before for name, before in cpu_before.items()}
    routes = len(latencies)
    router_cpu = sum(cpu[r] for r in routers)
    return {
        "concurrency": concurrency,
        "replicas": len(routers),
        "routes": routes,
        "errors": errors,
        "wall_s": wall,
        "routes_per_s": routes / wall,
        "routes_per_s_per_replica": routes / wall / len(routers),
        "latency": percentiles(np.asarray(latencies, dtype=np.int64)),
        "router_cpu_share": router_cpu / wall / len(routers),  # cores, per replica
        "router_cpu_us_per_route": router_cpu / routes * 1e6,
        "nats_cpu_us_per_route": cpu["nats"] / routes * 1e6,
        "client_cpu_us_per_route": client_cpu / routes * 1e6,
        "check": check_replies(replies),
    }


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def print_rtt(rtt: dict, n: int) -> None:
    c, cpu = rtt["check"], rtt["cpu_us_per_request"]
    print(f"\nround trip, 1 in flight, {n} requests to each, interleaved ({rtt['load']})")
    head = f"{'p50 µs':>7s} {'p90 µs':>7s} {'p99 µs':>7s} {'p99.9 µs':>8s}  {'÷ echo p50':>10s} {'p99':>5s}"
    print(f"  {'':28s} {head}  CPU/req")
    rows = (
        ("route", "sy.route.decode (router)"),
        ("floor", "Bus.serve, constant reply"),
        ("echo", "bare nats-py echo"),
    )
    for label, name in rows:
        p = rtt[label]
        ratios = (
            f"{rtt[label + '_ratio_p50']:9.2f}× {rtt[label + '_ratio_p99']:4.2f}×" if label != "echo" else f"{'':16s}"
        )
        print(
            f"  {name:28s} {p['p50_us']:7.0f} {p['p90_us']:7.0f} {p['p99_us']:7.0f} {p['p999_us']:8.0f}  {ratios}"
            f"  {cpu[label]:4.0f} µs"
        )
    print(
        f"  budget: router ≤ 1.3× echo at p50 and p99. In-router decision p50 {c['server_decision_us_p50']:.1f} µs; "
        f"{c['engines_used']} engines used, mean band {c['mean_band']:.1f}, {c['with_fallback']} fallbacks"
    )


def print_throughput(t: dict, duration: float) -> None:
    lat = t["latency"]
    print(
        f"\n{t['replicas']} replica(s), {t['concurrency']} in flight, {duration:.0f} s ({t['load']}): "
        f"{t['routes_per_s']:,.0f} routes/s ({t['routes_per_s_per_replica']:,.0f} per replica), {t['errors']} errors\n"
        f"  latency p50 {lat['p50_us']:.0f} µs, p90 {lat['p90_us']:.0f}, p99 {lat['p99_us']:.0f}, "
        f"p99.9 {lat['p999_us']:.0f}\n"
        f"  CPU per route: router {t['router_cpu_us_per_route']:.0f} µs "
        f"(one core: {1e6 / t['router_cpu_us_per_route']:,.0f} routes/s per replica), "
        f"nats-server {t['nats_cpu_us_per_route']:.0f} µs, client {t['client_cpu_us_per_route']:.0f} µs; "
        f"each router busy {t['router_cpu_share']:.0%} of a core; {t['check']['with_fallback']} fallbacks"
    )


def start_router(procs: Procs, env: dict[str, str], profile: Path | None, routers: list[str]) -> str:
    name = f"router-{len(routers)}"
    procs.start(name, router_command(profile, len(routers)), {**env, "SWITCHYARD_ROUTER_REPLICA_ID": name})
    routers.append(name)
    return name


async def bench(args: argparse.Namespace, tmp: Path, profile: Path | None) -> dict:
    import nats

    from switchyard.services.artifacts import put_artifact_kv
    from switchyard.shared.bus import Bus
    from switchyard.shared.embedded import EmbeddedNats
    from switchyard.shared.settings import SwitchyardSettings
    from switchyard.shared.subjects import Subjects

    payloads, artifact = esft_requests()
    subjects = Subjects(PREFIX)
    results: dict = {"machine": _single_core.machine(), "request_bytes": len(payloads[0])}
    procs = Procs()
    with EmbeddedNats(tmp / "nats") as server:
        procs.procs["nats"] = server.process  # type: ignore[assignment]
        env = {
            "SWITCHYARD_NATS_SERVERS": server.url,
            "SWITCHYARD_SUBJECT_PREFIX": PREFIX,
            "SWITCHYARD_DATA_DIR": str(tmp / "data"),
            "SWITCHYARD_LOG_LEVEL": "WARNING",
            "SWITCHYARD_ROUTER_POLICY": "eldr",
        }
        nc = await nats.connect(server.url, name="bench-client")
        try:
            bus = Bus(nc, SwitchyardSettings(nats_servers=[server.url], subject_prefix=PREFIX))
            await put_artifact_kv(bus, artifact)
            procs.start("engines", helper("engines", server.url, json.dumps(artifact.model.model_dump())))
            routers: list[str] = []
            start_router(procs, env, profile, routers)
            reply = await wait_routing(nc, subjects.route_decode, payloads[0])  # the only replica: it answered
            await asyncio.sleep(0.3)  # every engine's telemetry has arrived
            results["reply_bytes"] = len(reply)
            procs.start("echo", helper("echo", server.url, str(len(reply))))
            procs.start("floor", helper("floor", server.url))
            for subject, payload in ((ECHO_SUBJECT, b""), (FLOOR_SUBJECT, payloads[0])):
                for _ in range(300):
                    try:
                        await nc.request(subject, payload, timeout=0.5)
                        break
                    except nats.errors.Error:
                        await asyncio.sleep(0.1)
            print(results["machine"])
            print(f"request {results['request_bytes']} B (ESFT [26, 64] uint16 signature), reply {len(reply)} B")

            if args.rtt_requests:
                pids = ", ".join(f"{name} {procs.procs[name].pid}" for name in ("router-0", "floor", "echo"))
                print(f"(pids, to attach a profiler: {pids})", flush=True)
                targets = {
                    "route": (subjects.route_decode, "router-0"),
                    "floor": (FLOOR_SUBJECT, "floor"),
                    "echo": (ECHO_SUBJECT, "echo"),
                }
                rtt = await measure_rtt(nc, targets, payloads, args.rtt_requests, procs)
                results["rtt"] = rtt = {**rtt, "load": load()}
                print_rtt(rtt, args.rtt_requests)

            results["throughput"] = []
            for replicas in args.replicas:
                while len(routers) < replicas:
                    name = start_router(procs, env, profile, routers)
                    await wait_replica(nc, subjects, name, payloads)
                    await asyncio.sleep(0.3)
                for concurrency in args.concurrency:
                    t = await measure_throughput(
                        nc, subjects.route_decode, payloads, concurrency, args.duration, procs, routers
                    )
                    t["load"] = load()
                    results["throughput"].append(t)
                    print_throughput(t, args.duration)
        finally:
            await nc.close()
            procs.procs.pop("nats", None)
            procs.stop_all()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--role", choices=["bench", "engines", "echo", "floor"], default="bench", help=argparse.SUPPRESS
    )
    parser.add_argument("--rtt-requests", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    parser.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--profile", help="run routers under cProfile, writing DIR/router-<i>.prof")
    parser.add_argument("--json", help="also write the figures here (default bench/out/router_bus.json)")
    args, rest = parser.parse_known_args()
    if args.role == "engines":
        asyncio.run(run_engines(rest[0], json.loads(rest[1])))
        return
    if args.role == "echo":
        asyncio.run(run_echo(rest[0], int(rest[1])))
        return
    if args.role == "floor":
        asyncio.run(run_floor(rest[0]))
        return
    profile = Path(args.profile).resolve() if args.profile else None
    if profile:
        profile.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(bench(args, Path(tmp), profile))
    path = Path(args.json) if args.json else OUT / "router_bus.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
