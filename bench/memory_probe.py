"""Memory under hostile-but-valid values (issue 29, item 7): what the router and the API's fleet view hold.

Runs the router service and a fleet view as the API builds it (same process, each on its own ingest connection)
on an embedded nats-server without credentials (the worst case: a bus anyone can publish on, as
`switchyard up`'s was before its per-run credentials), then, one after the other:

- hellos from N distinct engine ids (`--heavy`: each listing 1,024 GPU names of 200 characters);
- telemetry from N distinct engine ids that never said hello;
- N/4 hellos from one engine id, each naming a new (group, rank) after the last went stale (what one engine's
  credentials allow);
- N route requests (each a new request id and a model name) to an engine that says hello and never reports.

After each it prints the entries each structure holds, the traced Python heap and VmRSS. `--http N` also sends N
varied requests to the API (history queries with new groups and cursors, paging, bad bodies, unknown paths) on
a SQLite database and prints what the process retained (tracemalloc).

    python bench/memory_probe.py                  # 20,000 of each
    python bench/memory_probe.py --messages 5000 --heavy 300 --http 4000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/fleet_helpers.py
from switchyard.services.fleet_view import FleetView
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared import schemas as s
from switchyard.shared.bus import Bus
from switchyard.shared.codec import encode
from switchyard.shared.embedded import EmbeddedNats
from switchyard.shared.settings import SwitchyardSettings
from tests.fleet_helpers import hello


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def telemetry(engine_id: str, seq: int = 1) -> s.Telemetry:
    return s.Telemetry(
        engine_id=engine_id,
        seq=seq,
        ts=time.time(),
        kv_usage=0.1,
        num_running=1,
        num_waiting=0,
        waiting_prefill_tokens=0,
        remaining_prefill_tokens=0,
        step_time_ema=0.01,
    )


def held_hello_mib(view: FleetView) -> float:
    """About what the view's stored hellos weigh (the same estimate as `services.fleet_view.hello_weight`)."""
    total = sum(2048 + sum(64 + len(g) for g in e.hello.gpus) for e in view.engines.values() if e.hello is not None)
    return total / 2**20


async def probe(messages: int, heavy: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="memory-probe-"))
    server = EmbeddedNats(folder / "nats")
    server.start()
    settings = SwitchyardSettings(
        nats_servers=[server.url], subject_prefix="m" + uuid.uuid4().hex[:6], data_dir=folder / "data"
    )
    router = RouterService(settings, RouterSettings(policy="jsq"))
    await router.start()
    ingest = await Bus.connect(settings, name="api-ingest")
    view = FleetView()
    await view.subscribe(ingest)
    bus = await Bus.connect(settings, name="attacker")
    nc, subjects = bus.nc, bus.subjects
    tracemalloc.start()

    async def report(what: str) -> None:
        await nc.flush()
        await asyncio.sleep(1.0)
        gc.collect()
        fleet = router.core.fleet
        entries = sum(len(fleet.ledger.entries(row)) for row in range(len(fleet)))
        print(
            f"{what:<58} router: rows {len(fleet):>6} (capacity {len(fleet.role):>6}) in-flight {entries:>6} | "
            f"fleet view: engines {len(view.engines):>6} slots {len(view._slots):>6} groups {len(view._members):>6} "
            f"hellos {held_hello_mib(view):6.1f} MiB | heap {tracemalloc.get_traced_memory()[0] / 2**20:6.1f} MiB "
            f"RSS {rss_mib():6.1f} MiB",
            flush=True,
        )

    async def publish_all(items: list[tuple[str, bytes]], pace: float = 0.0) -> None:
        for i, (subject, payload) in enumerate(items):
            await nc.publish(subject, payload)
            if pace or i % 500 == 499:
                await nc.flush()
                await asyncio.sleep(pace)

    await report("start")
    fakes = [hello(f"x{i}", f"g{i}", [f"gpu{i}"], role="decode") for i in range(messages)]
    await publish_all([(subjects.hello(h.engine_id), encode(h)) for h in fakes])
    del fakes  # the probe's own copies are no part of what the services hold
    await report(f"{messages} hellos, each a new engine id")
    await publish_all([(subjects.telemetry(f"t{i}"), encode(telemetry(f"t{i}"))) for i in range(messages)])
    await report(f"{messages} telemetry, each a new engine id")
    hops = messages // 4
    for i in range(hops):
        message = hello("hop", f"hop{i}", ["gpu0"], dp_rank=i % 7)
        message = message.model_copy(update={"hello_interval_s": 1e-3, "telemetry_interval_s": 1e-3})
        await nc.publish(subjects.hello("hop"), encode(message))
        if i % 100 == 99:
            await nc.flush()
            await asyncio.sleep(0.005)  # each hello after the last went stale (3 ms)
    await report(f"{hops} hellos from one engine, each a new place")
    silent = encode(hello("silent", "gs", ["gpu0"], role="dp").model_copy(update={"hello_interval_s": 0.5}))
    sent = 0
    while sent < messages:
        await nc.publish(subjects.hello("silent"), silent)  # live on hellos alone, never a report
        requests = [
            nc.request(
                subjects.route_dp,
                encode(s.RouteDpRequest(request_id=uuid.uuid4().hex, prompt_tokens=10, model="tiny-moe")),
                timeout=10,
            )
            for _ in range(200)
        ]
        await asyncio.gather(*requests, return_exceptions=True)
        sent += 200
    await report(f"{sent} route requests to an engine that never reports")
    if heavy:
        names = [f"{g:04d}-" + "x" * 195 for g in range(1024)]
        for i in range(heavy):
            message = hello(f"h{i}", f"hg{i}", names).model_copy(update={"hello_interval_s": 60.0})
            await nc.publish(subjects.hello(message.engine_id), encode(message))
            await nc.flush()
            await asyncio.sleep(0.003)  # paced: a subscriber cut off as a slow consumer would hide the growth
        await report(f"{heavy} hellos of 1,024 GPU names, each a new id")
    await router.stop()
    await bus.close()
    await ingest.close()
    server.stop()


def _http_request(i: int, rng: random.Random) -> tuple[str, str, bytes | None]:
    group = uuid.uuid4().hex[: rng.randint(1, 32)]
    kind = i % 9
    if kind == 0:
        return "GET", f"/v1/placements?engine_group={group}&since=2020-01-0{1 + i % 9}T00:00:{i % 60:02d}", None
    if kind == 1:
        return "GET", f"/v1/migrations?engine_group={group}&cursor={uuid.uuid4().hex}", None
    if kind == 2:
        return "GET", f"/v1/calibrations?engine_group={group}&limit={1 + i % 500}&x{i}=y", None
    if kind == 3:
        return "GET", f"/v1/engines?offset={i}&limit={1 + i % 500}&role=dp&ep_group={group}", None
    if kind == 4:
        return "GET", f"/v1/placements/{1 + i}", None
    if kind == 5:
        return "GET", f"/v1/no-such-route/{group}", None
    if kind == 6:
        return "POST", "/v1/calibrations", f'{{"engine_group": "{group}", "bad": [{"1," * 1000}1]}}'.encode()
    if kind == 7:
        return "GET", f"/v1/placements/current?engine_group={group}", None
    return "GET", f"/v1/migrations/{i}?{group}={group}", None


async def probe_http(requests: int) -> None:
    import httpx

    from switchyard.services.api.app import create_app
    from switchyard.services.api.settings import ApiSettings

    folder = Path(tempfile.mkdtemp(prefix="memory-probe-http-"))
    server = EmbeddedNats(folder / "nats")
    server.start()
    settings = SwitchyardSettings(
        nats_servers=[server.url],
        subject_prefix="a" + uuid.uuid4().hex[:6],
        data_dir=folder / "data",
        database_url=f"sqlite+aiosqlite:///{folder}/db.sqlite",
    )
    token = "t" * 32
    app = create_app(settings, ApiSettings(token=token))
    rng = random.Random(0)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:

            async def send(start: int, count: int) -> dict[int, int]:
                codes: dict[int, int] = {}
                for i in range(start, start + count):
                    method, url, body = _http_request(i, rng)
                    headers = {"Authorization": f"Bearer {token}"} if method == "POST" else None
                    response = await api.request(method, url, content=body, headers=headers)
                    codes[response.status_code] = codes.get(response.status_code, 0) + 1
                return codes

            await send(0, 500)  # warm: first-use caches, lazily built routes
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.take_snapshot()
            rss_before = rss_mib()  # after the first snapshot and before the second: neither counts
            codes = await send(1000, requests)
            gc.collect()
            rss_after = rss_mib()
            after = tracemalloc.take_snapshot()
            grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
            print(
                f"HTTP: {requests} requests {dict(sorted(codes.items()))}: heap {grown / 2**20:+.2f} MiB, "
                f"RSS {rss_before:.1f} -> {rss_after:.1f} MiB"
            )
    server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--heavy", type=int, default=0, help="hellos of 1,024 long GPU names, each a new id")
    parser.add_argument("--http", type=int, default=0, help="varied HTTP requests to the API")
    args = parser.parse_args()
    asyncio.run(probe(args.messages, args.heavy))
    if args.http:
        asyncio.run(probe_http(args.http))


if __name__ == "__main__":
    main()
