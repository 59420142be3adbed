"""`switchyard up`'s embedded nats-server is closed to other local users: only the run's own per-role users.

One real `switchyard up` (embedded NATS, SQLite, simulated fleet, gateway child, load through it); while it
runs the test plays another local process: with no credentials it is refused, and with a leaked low-privilege
role's password (`gateway`, `readonly`) it can neither overwrite the routing artifact nor delete a consumer.
The run itself still routes every request with each component as its own role and no permission violation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import KeyNotFoundError, NotFoundError

from switchyard.shared.nats_auth import Credentials
from switchyard.shared.subjects import Subjects

SWITCHYARD = [sys.executable, "-m", "switchyard.cli"]
SUBJECTS = Subjects("sy")  # the default prefix: the test strips SWITCHYARD_* from up's environment
INTRUDER = "intruder"


def _listen_url(data: Path, proc: subprocess.Popen[str], deadline: float) -> str:
    """The embedded server's address, from the config `up` wrote for it, once it accepts connections."""
    config = data / "nats" / "nats-server.conf"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"up exited ({proc.returncode}): {proc.communicate()[1][-3000:]}")
        match = re.search(r'listen: "([^"]+)"', config.read_text()) if config.exists() else None
        if match:
            host, port = match.group(1).rsplit(":", 1)
            try:
                with socket.create_connection((host, int(port)), timeout=0.2):
                    return f"nats://{host}:{port}"
            except OSError:
                pass
        time.sleep(0.05)
    raise AssertionError("the embedded nats-server never listened")


async def _ignore(_exc: Exception) -> None:
    pass


async def _connect(url: str, users: Credentials, role: str, name: str = INTRUDER) -> nats.NATS:
    creds = users.users[role]
    return await nats.connect(
        url,
        user=creds["user"],
        password=creds["password"],
        inbox_prefix=f"_INBOX_{creds['user']}",
        name=f"{name}-{role}",
        allow_reconnect=False,
        error_cb=_ignore,
    )


async def _until(probe, within_s: float = 60.0):
    """`probe()`'s first result that is not None (the run sets things up while the test waits)."""
    deadline = time.monotonic() + within_s
    while True:
        with contextlib.suppress(KeyNotFoundError, NotFoundError):
            result = await probe()
            if result is not None:
                return result
        assert time.monotonic() < deadline, "the run never got there"
        await asyncio.sleep(0.1)


async def _attack(url: str, data: Path) -> None:
    """As another local process: (a) no credentials, (b) a leaked gateway's or readonly's password."""
    with pytest.raises(Exception, match="uthoriz"):  # nats-py: 'nats: 'Authorization Violation''
        await nats.connect(url, allow_reconnect=False, error_cb=_ignore, connect_timeout=2)
    users = Credentials.load(data / "nats" / "credentials.json")
    admin = await _connect(url, users, "admin", name="observer")  # to look, not to attack
    js = admin.jetstream()
    bucket, key = SUBJECTS.router_bucket, SUBJECTS.artifact_key
    kv = await _until(lambda: js.key_value(bucket))
    artifact = await _until(lambda: kv.get(key))  # fitted and published by the run's `fit` user
    stream = SUBJECTS.expert_load_stream
    await _until(lambda: _consumers(js, stream))  # placement's expert-load consumer, at least
    # The run's own consumers, and a durable one that no service recreates (an ordered consumer is replaced
    # under a new name when its heartbeats are missed, so only this one's survival is checked by name).
    await js.add_consumer(stream, ConsumerConfig(durable_name="kept", ack_policy=AckPolicy.EXPLICIT))
    consumers = [(name, c) for name in SUBJECTS.streams() for c in await _consumers(js, name) or []]
    assert len(consumers) >= 2, consumers
    try:
        for role in ("gateway", "readonly"):
            leaked = await _connect(url, users, role)
            try:
                await leaked.publish(f"$KV.{bucket}.{key}", b"steer all traffic")  # a raw KV write
                with pytest.raises(Exception):  # noqa: B017 - a refused publish: no reply, a timeout
                    await leaked.request(f"$KV.{bucket}.{key}", b"steer all traffic", timeout=0.5)
                for name, consumer in consumers:
                    with pytest.raises(Exception):  # noqa: B017 - likewise
                        await leaked.request(f"$JS.API.CONSUMER.DELETE.{name}.{consumer}", b"", timeout=0.5)
                await leaked.flush()
            finally:
                await leaked.close()
        # positive control: readonly's password is good, and it may read what it is meant to
        reader = await _connect(url, users, "readonly", name="observer")
        assert (await reader.jetstream().stream_info(stream)).config.name == stream
        await reader.close()
        await asyncio.sleep(0.3)
        now = await kv.get(key)
        assert (now.revision, now.value) == (artifact.revision, artifact.value)
        assert (await js.consumer_info(stream, "kept")).name == "kept"
    finally:
        await admin.close()


async def _consumers(js, stream: str) -> list[str] | None:
    names = [c.name for c in await js.consumers_info(stream)]
    return names or None


def test_the_embedded_bus_takes_only_the_runs_own_users(tmp_path: Path) -> None:
    data = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")} | {"COLUMNS": "200"}
    command = [*SWITCHYARD, "up", "--data-dir", str(data), "--api-port", "0", "--gateway-port", "0"]
    proc = subprocess.Popen(
        [*command, "--duration", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        url = _listen_url(data, proc, time.monotonic() + 120)
        asyncio.run(_attack(url, data))
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    # (c) the run routed every request, each component as its own role, and the server refused none of them
    sent, completed = re.search(r"(\d+) sent, (\d+) completed", out).groups()  # type: ignore[union-attr]
    assert int(sent) > 15 and completed == sent, out[-3000:]
    assert re.search(r"routing fallbacks +│ none", out), out[-3000:]
    violations = re.findall(r".*Violation.*", (data / "nats" / "nats-server.log").read_text(errors="replace"))
    assert [v for v in violations if f"python3:{INTRUDER}-" not in v] == []
    refused = "\n".join(violations)
    for role in ("gateway", "readonly"):  # what the test tried was refused by the server, for both roles
        assert f'user:{role}" - Publish Violation - Subject "$KV.{SUBJECTS.router_bucket}.' in refused
        assert f'user:{role}" - Publish Violation - Subject "$JS.API.CONSUMER.DELETE.' in refused
    # (d) the passwords are readable by this user only
    for path in (data / "nats" / "credentials.json", data / "nats" / "nats-server.conf"):
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert (data / "nats").stat().st_mode & 0o077 == 0


def test_a_real_engine_joins_services_only_under_its_own_user(tmp_path: Path) -> None:
    """`up --services-only --engines e0`: e0 gets a user of its own on the embedded bus; its hello reaches the
    API through the server's permissions, and no user exists for an engine that was not named."""
    from switchyard.shared.bus import Bus
    from switchyard.shared.embedded import free_port
    from switchyard.shared.nats_auth import engine_user
    from switchyard.shared.settings import SwitchyardSettings
    from tests.fleet_helpers import hello

    data, api_port = tmp_path / "state", free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")} | {"COLUMNS": "200"}
    command = [*SWITCHYARD, "up", "--data-dir", str(data), "--api-port", str(api_port), "--services-only"]
    proc = subprocess.Popen(
        [*command, "--engines", "e0", "--duration", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )

    async def join(url: str) -> list[str]:
        path = data / "nats" / "credentials.json"
        settings = SwitchyardSettings(nats_servers=[url], nats_credentials=path, nats_initial_connect_s=10.0)
        bus = await Bus.connect(settings, name="e0", role=engine_user("e0"))  # as the vLLM agent connects
        try:
            deadline, seen = time.monotonic() + 60, []
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}", timeout=2) as client:
                while "e0" not in seen and time.monotonic() < deadline:
                    await bus.publish(SUBJECTS.hello("e0"), hello("e0", "g0", ["gpu0"]))
                    with contextlib.suppress(httpx.HTTPError):
                        seen = [e["engine_id"] for e in (await client.get("/v1/engines")).json()]
                    await asyncio.sleep(0.2)
            return seen
        finally:
            await bus.close()

    try:
        seen = asyncio.run(join(_listen_url(data, proc, time.monotonic() + 120)))
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "control plane only" in out and "stopped cleanly" in out
    assert seen == ["e0"]
    users = Credentials.load(data / "nats" / "credentials.json").users
    assert engine_user("e0") in users and not [u for u in users if u.startswith("engine-") and u != "engine-e0"]
    violations = re.findall(r".*Violation.*", (data / "nats" / "nats-server.log").read_text(errors="replace"))
    assert violations == []
