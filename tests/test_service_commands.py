"""`switchyard placement` and `switchyard api` deploy on their own: they start, serve, and stop cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from switchyard.shared.bus import Bus
from switchyard.shared.embedded import free_port
from switchyard.shared.settings import SwitchyardSettings


def _env(settings: SwitchyardSettings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    return {**env, "SWITCHYARD_SUBJECT_PREFIX": settings.subject_prefix, **extra}


def _command(name: str, settings: SwitchyardSettings, tmp_path: Path) -> list[str]:
    url = f"sqlite:///{tmp_path / 'switchyard.sqlite'}"
    cli = [sys.executable, "-m", "switchyard.cli", name]
    return [*cli, "--nats-url", settings.nats_servers[0], "--database-url", url]


def test_api_command_serves_and_stops_on_sigterm(bus: Bus, settings: SwitchyardSettings, tmp_path: Path) -> None:
    """(`bus` only so that the streams the process creates are deleted afterwards.)"""
    port = free_port()
    log = tmp_path / "api.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*_command("api", settings, tmp_path), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(settings, SWITCHYARD_API_TOKEN="t"),
        )
    try:
        deadline = time.monotonic() + 60
        ready = None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert ready is not None and ready.status_code == 200, log.read_text()[-2000:]
        assert httpx.get(f"http://127.0.0.1:{port}/v1/placements").json() == {"items": [], "next_cursor": None}
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    assert process.returncode == 0, log.read_text()[-2000:]


def test_placement_command_starts_and_stops_on_sigterm(bus: Bus, settings: SwitchyardSettings, tmp_path: Path) -> None:
    log = tmp_path / "placement.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            _command("placement", settings, tmp_path), stdout=out, stderr=subprocess.STDOUT, env=_env(settings)
        )
    try:
        deadline = time.monotonic() + 60
        while "placement service ready" not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()[-2000:]
            time.sleep(0.2)
        assert "placement service ready" in log.read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    assert process.returncode == 0, log.read_text()[-2000:]
