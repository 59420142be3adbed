"""Announce flood: what `N` announces from the read-only credential cost a running control plane.

Starts a nats-server with the generated per-role configuration, the placement and router services and a
simulated fleet (`switchyard fleet`, no HTTP) as processes, waits until every engine has said hello, then
publishes `--announces` announces as the `readonly` user as fast as it can (loopback only), waits `--settle-s`,
and reports: hellos the engines published during the flood (counted by a raw admin subscription, not by any
service), the slow-consumer cut-offs nats-server logged by connection name, and route requests sent to the
router during the flood (`sy.route.dp`, one every 50 ms, 0.5 s timeout) answered vs timed out.

    .venv/bin/python bench/announce_flood.py --announces 20000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import nats
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos_infra import ServiceProcess, cli, service_env

#: `... - cid:21 - "v2.16.0:python3:<name>" - "$G/user:<user>" - Slow Consumer Detected: ...`
SLOW = re.compile(r'"[^"]*:([^":]+)" - (?:"[^"]*" - )?Slow Consumer Detected')


def slow_consumers(log: str) -> Counter[str]:
    """nats-server's slow-consumer cut-offs, by client connection name."""
    return Counter(SLOW.findall(log)) + Counter(
        "?" for line in log.splitlines() if "Slow Consumer" in line and not SLOW.search(line)
    )


def _ms(values: list[float], q: float) -> str:
    return f"{float(np.percentile(values, q)) * 1e3:.1f} ms" if values else "-"


def cpu_s(process: ServiceProcess) -> float:
    """User + system CPU seconds the process has used so far (Linux `/proc/<pid>/stat`)."""
    assert process.process is not None
    fields = Path(f"/proc/{process.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args: argparse.Namespace) -> int:
    from switchyard.shared.codec import encode
    from switchyard.shared.embedded import EmbeddedNats
    from switchyard.shared.nats_auth import SERVICE_ROLES, Credentials, render_authorization
    from switchyard.shared.schemas import Announce, RouteDpRequest
    from switchyard.shared.subjects import Subjects

    root = Path(tempfile.mkdtemp(prefix="announce-flood-"))
    subjects = Subjects("p" + uuid.uuid4().hex[:8])
    engines = [f"sim-p{i}" for i in range(args.prefill)] + [f"sim-d{i}" for i in range(args.decode)]
    credentials = Credentials.generate([*SERVICE_ROLES, "fleet"])
    credentials.save(root / "credentials.json")
    server = EmbeddedNats(
        root / "nats", extra_config=render_authorization(subjects, credentials, fleet_engines=engines)
    )
    url = server.start()
    env = service_env(
        {
            "SWITCHYARD_NATS_SERVERS": url,
            "SWITCHYARD_NATS_CREDENTIALS": str(root / "credentials.json"),
            "SWITCHYARD_SUBJECT_PREFIX": subjects.prefix,
            "SWITCHYARD_DATABASE_URL": f"sqlite:///{root / 'switchyard.db'}",
            "SWITCHYARD_LOG_LEVEL": "INFO",
            **(
                {"SWITCHYARD_ANNOUNCE_MIN_INTERVAL_S": args.announce_min_interval_s}
                if args.announce_min_interval_s
                else {}
            ),
        }
    )
    (root / "logs").mkdir()
    fleet = ["fleet", "--no-http", "--prefill", str(args.prefill), "--decode", str(args.decode)]
    procs = {
        name: ServiceProcess(name, argv, env, root / "logs" / f"{name}.log")
        for name, argv in {"placement": cli("placement"), "router": cli("router"), "fleet": cli(*fleet)}.items()
    }

    def user(role: str) -> dict[str, str]:
        c = credentials.users[role]
        return {"user": c["user"], "password": c["password"], "inbox_prefix": f"_INBOX_{c['user']}"}

    async def quiet(_exc: Exception) -> None:
        pass

    hellos: Counter[str] = Counter()
    try:
        for p in procs.values():
            p.start()
        watch = await nats.connect(url, name="flood-watch", error_cb=quiet, **user("admin"))

        async def on_hello(msg) -> None:
            hellos[msg.subject.split(".")[2]] += 1

        await watch.subscribe(subjects.all_hello, cb=on_hello)
        deadline = time.monotonic() + 120
        placement_log = procs["placement"].log
        while not (
            set(engines) <= set(hellos)
            and placement_log.exists()
            and "placement service ready" in placement_log.read_text(errors="replace")
            and "serving" in procs["router"].log.read_text(errors="replace")
        ):
            if time.monotonic() > deadline:
                raise SystemExit(f"not up in 120 s; logs in {root / 'logs'}")
            await asyncio.sleep(0.2)
        await asyncio.sleep(args.settle_s)
        before_log = server.log_path.read_text(errors="replace")
        hellos.clear()
        cpu_before = {name: cpu_s(p) for name, p in procs.items()}
        flooder = await nats.connect(url, name="flood-readonly", error_cb=quiet, **user("readonly"))
        prober = await nats.connect(url, name="flood-probe", error_cb=quiet, **user("gateway"))
        answered = timed_out = 0
        round_trips: list[float] = []
        flooding = True

        async def probe() -> None:
            nonlocal answered, timed_out
            i = 0
            while flooding:
                i += 1
                request = encode(RouteDpRequest(request_id=f"probe-{i}", prompt_tokens=100))
                try:
                    sent = time.perf_counter()
                    await prober.request(subjects.route_dp, request, timeout=0.5)
                    round_trips.append(time.perf_counter() - sent)
                    answered += 1
                except Exception:
                    timed_out += 1
                await asyncio.sleep(0.05)

        probes = asyncio.create_task(probe())
        announce = encode(Announce(requester="flood"))
        started = time.monotonic()
        for i in range(args.announces):
            await flooder.publish(subjects.announce, announce)
            if i % 500 == 499:
                await flooder.flush()
        await flooder.flush()
        flood_s = time.monotonic() - started
        while time.monotonic() - started < args.max_wait_s:  # the engines answer announces they took in
            last = sum(hellos.values())
            await asyncio.sleep(args.settle_s)
            if sum(hellos.values()) - last <= len(engines):  # at most each engine's periodic hello: done
                break
        answer_s = time.monotonic() - started - args.settle_s
        flooding = False
        await probes
        cpu = {name: round(cpu_s(p) - cpu_before[name], 2) for name, p in procs.items()}
        log = server.log_path.read_text(errors="replace")[len(before_log) :]
        cut = slow_consumers(log)
        print(
            f"announce flood: {args.announces} announces in {flood_s:.2f} s, answered for {answer_s:.1f} s; "
            f"hellos published {sum(hellos.values())} "
            f"({dict(sorted(hellos.items()))}); slow-consumer cut-offs {dict(cut) or 0}; "
            f"route probes answered {answered} (p50 {_ms(round_trips, 50)}, p99 {_ms(round_trips, 99)}), "
            f"timed out {timed_out}; CPU s during flood + settle {cpu}"
        )
        print(f"logs: {root}")
        await flooder.close()
        await prober.close()
        await watch.close()
    finally:
        for p in procs.values():
            p.stop()
        server.stop()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--announces", type=int, default=20_000)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=7)
    parser.add_argument(
        "--settle-s", type=float, default=3.0, help="done: a window this long with at most one hello per engine"
    )
    parser.add_argument("--max-wait-s", type=float, default=90.0)
    parser.add_argument("--announce-min-interval-s", default="", help="SWITCHYARD_ANNOUNCE_MIN_INTERVAL_S for all")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
