"""Entry points that run the live simulated fleet and the load generator as their own processes.

`switchyard fleet` and `switchyard loadgen` (and `switchyard up`, in one process) call these. Both sides
build the same `Scenario` from the same trace and seed, so a load generator's replay rows mean the same
requests to the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from switchyard.engine_agents.sim.live.engines import LiveFleet, LiveFleetConfig
from switchyard.engine_agents.sim.live.http_loadgen import HttpLoadGenerator
from switchyard.engine_agents.sim.live.loadgen import LoadGenerator
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings
from switchyard.simulator.core.workload import load_requests
from switchyard.simulator.offline.scenario import prepare

log = logging.getLogger(__name__)


async def run_fleet(
    settings: SwitchyardSettings, config: LiveFleetConfig, trace: Path, seed: int, stop: asyncio.Event
) -> None:
    """Serve a live simulated fleet until `stop` is set."""
    scenario = await asyncio.to_thread(prepare, trace, gpu=config.gpu, seed=seed)
    bus = await Bus.connect(settings, name=f"{config.name}-fleet", role="fleet")
    fleet = LiveFleet(scenario, config)
    try:
        await fleet.start(bus)
        log.info("fleet %s: prefill %s, decode %s", config.name, config.prefill_ids(), config.decode_ids())
        for engine_id, url in fleet.base_urls().items():
            log.info("%s serves OpenAI HTTP at %s", engine_id, url)
        await stop.wait()
    finally:
        await fleet.stop()
        await bus.close()
    log.info("fleet %s stopped: %s", config.name, fleet.counters)


async def run_loadgen(
    settings: SwitchyardSettings,
    config: LiveFleetConfig,
    trace: Path,
    seed: int,
    num_requests: int,
    requests_csv: Path | None,
    time_scale: float,
    rate: float | None,
    stop: asyncio.Event,
) -> dict[str, float]:
    """Send `num_requests` to a fleet configured as `config`, wait for them, return TTFT/TPOT percentiles."""
    scenario = await asyncio.to_thread(prepare, trace, gpu=config.gpu, seed=seed)
    requests = await asyncio.to_thread(load_requests, requests_csv) if requests_csv else None
    fleet_limit = LiveFleet(scenario, config).max_tokens
    workload = scenario.workload(
        num_requests, seed=seed + 1, rate=rate, requests=requests, time_scale=time_scale, max_tokens=fleet_limit
    )
    bus = await Bus.connect(settings, name="loadgen", role="loadgen")
    try:
        loadgen = LoadGenerator(bus, workload, config.prefill_ids(), speed=config.speed)
        await loadgen.listen()
        await _send_until_stopped(loadgen, stop, drain_s=60.0)
        return {"sent": float(loadgen.sent), **loadgen.completions.summary()}
    finally:
        await bus.close()


async def run_http_loadgen(
    url: str,
    config: LiveFleetConfig,
    trace: Path,
    seed: int,
    num_requests: int,
    requests_csv: Path | None,
    time_scale: float,
    rate: float | None,
    stop: asyncio.Event,
    model: str | None = None,
) -> dict[str, float]:
    """Send `num_requests` as HTTP clients to `url` (a gateway or an engine); client-measured percentiles."""
    scenario = await asyncio.to_thread(prepare, trace, gpu=config.gpu, seed=seed)
    requests = await asyncio.to_thread(load_requests, requests_csv) if requests_csv else None
    fleet_limit = LiveFleet(scenario, config).max_tokens
    workload = scenario.workload(
        num_requests, seed=seed + 1, rate=rate, requests=requests, time_scale=time_scale, max_tokens=fleet_limit
    )
    async with HttpLoadGenerator(url, workload, model=model, speed=config.speed) as loadgen:
        await _send_until_stopped(loadgen, stop, drain_s=120.0)
        failed = {f"failed_{reason}": float(n) for reason, n in loadgen.stats.failed.items()}
        return {"sent": float(loadgen.sent), **loadgen.stats.summary(), **failed}


async def _send_until_stopped(loadgen: LoadGenerator | HttpLoadGenerator, stop: asyncio.Event, drain_s: float) -> None:
    """Send the whole workload unless `stop` is set first; then wait (at most `drain_s`) for what is in flight."""
    sending = asyncio.create_task(loadgen.run())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({sending, stopping}, return_when=asyncio.FIRST_COMPLETED)
    sending.cancel()
    stopping.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sending
    if not stop.is_set():
        await loadgen.drain(timeout_s=drain_s)
