"""`switchyard migration` / `switchyard placement` as real processes, and a simulated engine that holds one
migrate step: what the SIGKILL tests (`test_migration_sigkill`, `test_migration_takeover`,
`test_placement_takeover`) share."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from switchyard.shared.settings import SwitchyardSettings


def start_service(
    name: str, settings: SwitchyardSettings, database_url: str | None, log: Path, *args: str, **env: str
) -> subprocess.Popen[bytes]:
    """A `switchyard <name> [args]` process on the test's bus and database (None: a service without one);
    `env` adds SWITCHYARD_* settings."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    environment.update(SWITCHYARD_SUBJECT_PREFIX=settings.subject_prefix, **env)
    command = [sys.executable, "-m", "switchyard.cli", name]
    command += ["--nats-url", settings.nats_servers[0], *args]
    command += ["--database-url", database_url] if database_url is not None else []
    with log.open("ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment)


def start_migration(settings: SwitchyardSettings, database_url: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    """A `switchyard migration` process; steps are never resent while it lives (30 s step timeout): one send
    per life."""
    env = {"SWITCHYARD_MIGRATION_RETRY_BACKOFF_S": "0.05", "SWITCHYARD_MIGRATION_STEP_TIMEOUT_S": "30", **env}
    return start_service("migration", settings, database_url, log, **env)


class HeldStep:
    """An engine's `sleep` whose `held`-th call (0-based) waits for `release`: steps take a little real time,
    and the held one stays in flight until its sender has been killed."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.calls = 0
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        self.calls += 1
        if self.calls == self.held + 1:
            self.entered.set()
            await self.release.wait()
        await asyncio.sleep(seconds)
