"""`switchyard gateway` as a child process of `switchyard up`.

A child and not a task: on a small machine the gateway's HTTP relaying gets a core of its own instead of
sharing the event loop with the simulated fleet and the load generator, and it runs exactly as deployed
(`switchyard gateway`). It dies with its parent (PR_SET_PDEATHSIG on Linux) and in its own session, so
Ctrl-C reaches `up`, which stops it in order; its output goes to `gateway.log` in the data dir. Given the
run's per-role credentials file, it gets its path in `SWITCHYARD_NATS_CREDENTIALS` and connects as its own
user (`gateway-<id>`, its id from `env`) when the file has one: it decides in-process and shares its decisions.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from switchyard.shared.embedded import _die_with_parent
from switchyard.shared.errors import ConfigError


class GatewayProcess:
    def __init__(
        self,
        nats_url: str,
        host: str,
        port: int,
        log_path: Path,
        nats_credentials: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.nats_url, self.host, self.port, self.log_path = nats_url, host, port, log_path
        self.nats_credentials = nats_credentials
        #: Settings over the inherited environment: its id, the in-process router's (SWITCHYARD_ROUTER_*).
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        command = [sys.executable, "-m", "switchyard.cli", "gateway", "--nats-url", self.nats_url]
        command += ["--host", self.host, "--port", str(self.port)]
        env = {**os.environ, **self.env}
        if self.nats_credentials is not None:
            env["SWITCHYARD_NATS_CREDENTIALS"] = str(self.nats_credentials.resolve())
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def _tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        lines = [line for line in text.strip().splitlines() if line.strip()]
        return lines[-1] if lines else "no output"

    async def wait_ready(self, model: str, timeout_s: float = 60.0) -> None:
        """Until `/readyz` says ready and `/v1/models` lists `model` (the fleet's hellos have arrived)."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if self.process is None or self.process.poll() is not None:
                    raise ConfigError(f"the gateway did not start on {self.url}: {self._tail()} (see {self.log_path})")
                try:
                    ready = await client.get(f"{self.url}/readyz")
                    models = await client.get(f"{self.url}/v1/models") if ready.status_code == 200 else None
                    if models is not None and model in {m.get("id") for m in models.json().get("data", [])}:
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    await self.stop()
                    raise ConfigError(f"the gateway on {self.url} was not ready after {timeout_s:.0f} s")
                await asyncio.sleep(0.1)

    def routing(self) -> str:
        """How it decided, as its own log says: `inprocess` (and whether it shared its decisions) or `remote`."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        shapes = [line.rsplit("(routing ", 1)[1].strip(" )") for line in text.splitlines() if "(routing " in line]
        if not shapes:
            return "unknown (not in its log)"
        if shapes[-1] != "inprocess":
            return shapes[-1]
        if "may not publish decisions" in text:
            return "in-process, its decisions not shared (the shared `gateway` user)"
        return "in-process, sharing its decisions"

    async def counters(self) -> dict[str, float]:
        """The gateway's own counters (`/metrics`), summed per metric and first label value; {} if unreachable."""
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                text = (await client.get(f"{self.url}/metrics")).text
        except httpx.HTTPError:
            return {}
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.type != "counter" or not family.name.startswith("switchyard_gateway_"):
                continue
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue
                label = "/".join(str(v) for v in sample.labels.values())
                key = f"{family.name.removeprefix('switchyard_gateway_')} {label}".strip()
                out[key] = out.get(key, 0.0) + sample.value
        return out

    async def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code."""
        process, self.process = self.process, None
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(process.wait, timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)
        return process.returncode
