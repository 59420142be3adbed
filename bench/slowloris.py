"""How long slowloris sockets stay open on `switchyard gateway` (issue 29, item 5).

Starts a private nats-server and `switchyard gateway` (configured by its environment, so
`SWITCHYARD_GATEWAY_HEADER_TIMEOUT_S` / `..._MAX_CLIENT_CONNECTIONS` apply), then opens `--sockets` connections
that each send an unfinished request head and one more header byte every `--trickle-s` seconds, and watches them
for `--observe` seconds. Reports how many the gateway turned away at once (503), how many it closed later and
when, how many were still open at the end, and whether an honest `GET /healthz` got through during the attack.

Usage: .venv/bin/python bench/slowloris.py [--sockets 5000] [--observe 30] [--trickle-s 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from switchyard.shared.embedded import EmbeddedNats, free_port

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: "


async def slow_socket(port: int, trickle_s: float, observe_until: float, stagger: float) -> tuple[str, float | None]:
    """('refused' | 'closed' | 'open' | 'connect_failed', seconds from connect to the server's close)."""
    loop = asyncio.get_running_loop()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return "connect_failed", None
    opened = loop.time()
    try:
        writer.write(HEAD)
        first = asyncio.ensure_future(reader.read(64))
        await asyncio.wait({first}, timeout=stagger)
        while not first.done() and loop.time() < observe_until:
            with contextlib.suppress(ConnectionError):
                writer.write(b"a")
            await asyncio.wait({first}, timeout=min(trickle_s, max(0.0, observe_until - loop.time())))
        if not first.done():
            first.cancel()
            return "open", None
        try:
            data = first.result()
        except ConnectionError:
            data = b""
        return ("refused" if data.startswith(b"HTTP/1.1 503") else "closed"), loop.time() - opened
    finally:
        writer.close()


async def honest(port: int) -> str:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return data.split(b"\r\n", 1)[0].decode() or "closed without an answer"
    except (OSError, TimeoutError) as exc:
        return f"no answer ({type(exc).__name__})"


async def attack(port: int, sockets: int, observe_s: float, trickle_s: float) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    observe_until = start + observe_s
    tasks = []
    for i in range(sockets):
        stagger = (i % 100) / 100 * trickle_s  # spread the trickled bytes over time
        tasks.append(asyncio.create_task(slow_socket(port, trickle_s, observe_until, stagger)))
        if i % 200 == 199:
            await asyncio.sleep(0.01)  # let the batch connect
    opened_s = loop.time() - start
    checks = {}
    for at in (2.0, observe_s / 2):
        await asyncio.sleep(max(0.0, start + at - loop.time()))
        checks[f"honest GET /healthz at {at:g} s"] = await honest(port)
    results = await asyncio.gather(*tasks)
    closed = sorted(t for kind, t in results if kind == "closed" and t is not None)
    refused = [t for kind, t in results if kind == "refused" and t is not None]
    count = {kind: sum(1 for k, _ in results if k == kind) for kind in ("refused", "closed", "open", "connect_failed")}

    def pct(values: list[float], q: float) -> float | None:
        return round(values[min(len(values) - 1, int(q * len(values)))], 2) if values else None

    return {
        "sockets": sockets,
        "observed_s": observe_s,
        "trickle_s": trickle_s,
        "all_connects_issued_in_s": round(opened_s, 2),
        **count,
        "refused_after_s_max": round(max(refused), 3) if refused else None,
        "closed_after_s": {"min": pct(closed, 0.0), "p50": pct(closed, 0.5), "max": pct(closed, 1.0)},
        **checks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sockets", type=int, default=5000)
    parser.add_argument("--observe", type=float, default=30.0)
    parser.add_argument("--trickle-s", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the gateway (a child) inherits it too
    if args.sockets + 100 > hard:
        sys.exit(f"--sockets {args.sockets} needs more than this machine's open-file limit ({hard})")
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp)) as nats:
        port = free_port()
        command = [sys.executable, "-m", "switchyard.cli", "gateway", "--nats-url", nats.url]
        gateway = subprocess.Popen([*command, "--port", str(port)], env=dict(os.environ), stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not asyncio.run(honest(port)).startswith("HTTP/1.1"):
                if gateway.poll() is not None or time.monotonic() > deadline:
                    sys.exit("the gateway did not start")
                time.sleep(0.2)
            report = asyncio.run(attack(port, args.sockets, args.observe, args.trickle_s))
        finally:
            gateway.terminate()
            gateway.wait(15)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
