"""Serve the API with uvicorn inside the caller's event loop (`switchyard api`, `switchyard up`, tests)."""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn

from switchyard.services.api.app import create_app
from switchyard.services.api.settings import ApiSettings
from switchyard.services.http_limits import HttpLimits
from switchyard.services.http_server import front_protocol
from switchyard.shared.bus import Bus
from switchyard.shared.json_depth import MAX_DEPTH
from switchyard.shared.settings import SwitchyardSettings


class _InProcessServer(uvicorn.Server):
    """uvicorn without its own signal handling: whoever runs the loop decides when to stop."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


async def run_api(settings: SwitchyardSettings, stop: asyncio.Event, config: ApiSettings | None = None) -> None:
    """Serve the API until `stop` is set; raises if it cannot start (e.g. NATS or the database is unreachable).

    The bus is reached once before uvicorn starts, so an unreachable one is the plain `ConnectionError` the CLI
    prints as one line, not a failed lifespan (uvicorn logs that as a traceback and exits with code 3)."""
    config = config or ApiSettings()
    probe = await Bus.connect(settings, name="switchyard-api-probe", role="api")
    await probe.close()
    server = _InProcessServer(
        uvicorn.Config(
            HttpLimits(
                create_app(settings, config), config.max_body_bytes, config.body_timeout_s, max_json_depth=MAX_DEPTH
            ),
            host=config.host,
            port=config.port,
            http=front_protocol(config.header_timeout_s, config.max_connections, {"detail": "too many connections"}),
            timeout_keep_alive=5,
            log_level=settings.log_level.lower(),
            log_config=None,  # uvicorn's loggers go through the process's own handlers (up: file + console)
            lifespan="on",
        )
    )
    serving = asyncio.create_task(server.serve())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        try:
            await serving
        except SystemExit as exc:  # uvicorn exits this way when the lifespan fails
            raise RuntimeError(f"the API did not start (exit code {exc.code}); see the log above") from None
    finally:
        stopping.cancel()
