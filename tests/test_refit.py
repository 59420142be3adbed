"""`switchyard fit --from-stream`: the fleet's routing samples in, an artifact for its live decoders out."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np

from switchyard.services.artifacts import get_artifact_kv
from switchyard.services.refit import read_samples
from switchyard.shared.bus import Bus
from switchyard.shared.schemas import Capacity, Hello, ModelShape, RoutingSample
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.trace_files import load_trace
from switchyard.solver.eldr_fit import FitOptions, fit_routing_artifact
from switchyard.solver.signatures import request_counts
from tests.eldr_helpers import ESFT_DIR
from tests.fleet_helpers import announcing

DECODERS = ["d0", "d1", "d2"]


def _decoder(engine_id: str, top_k: int, role: str = "decode") -> Hello:
    return Hello(
        engine_id=engine_id,
        role=role,  # type: ignore[arg-type]
        model=ModelShape(name="deepseek-v2-lite", num_layers=26, num_experts=64, top_k=top_k),
        ep_group=engine_id,
        gpus=[f"{engine_id}-gpu0"],
        capacity=Capacity(max_running=64, kv_blocks=1024, block_size=16),
        ts=time.time(),
        agent="sim",
    )


async def test_a_refit_from_the_stream_serves_the_live_decoders(bus: Bus, settings: SwitchyardSettings) -> None:
    counts = request_counts(load_trace(ESFT_DIR, "esft", prefill_fraction=0.5))  # real routing, 213 requests
    await bus.ensure_streams()
    for i in range(counts.num_requests):
        sample = RoutingSample(
            engine_id=DECODERS[i % 3],
            request_id=f"r{i}",
            ts=time.time(),
            prompt_tokens=int(counts.prefill_tokens[i]),
            decode_tokens=int(counts.decode_tokens[i]),
            prefill_counts=counts.prefill[i].astype(np.uint16),
            decode_counts=counts.decode[i].astype(np.uint16),
        )
        await bus.js_publish(bus.subjects.routing_samples, sample)
    await bus.js.publish(bus.subjects.routing_samples, b"\xc1 not a sample")
    env = {**os.environ, "SWITCHYARD_SUBJECT_PREFIX": bus.subjects.prefix}
    command = [sys.executable, "-m", "switchyard.cli", "fit", "--from-stream", "--json"]
    command += ["--nats-url", settings.nats_servers[0]]
    hellos = [_decoder(d, counts.top_k) for d in DECODERS] + [_decoder("p0", counts.top_k, role="prefill")]
    async with announcing(bus, *hellos):
        fit = await asyncio.create_subprocess_exec(*command, env=env, stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(fit.communicate(), 120)
    assert fit.returncode == 0
    report = json.loads(out)
    assert (report["samples"], report["rejected_samples"]) == (counts.num_requests, 1)
    assert report["live_decoders"] == DECODERS and len(report["cluster_sizes"]) == 3

    artifact = await get_artifact_kv(bus)  # published where the routers watch
    assert artifact is not None and artifact.decoder_ids == DECODERS and artifact.model.top_k == counts.top_k
    # The same fit as on the trace's own counts: the stream loses nothing on the way.
    options = FitOptions(tau=0.1, max_pairs=5_000, holdout_fraction=0.2, restarts=3, seed=0)
    direct, _ = fit_routing_artifact(counts, 3, options, decoder_ids=DECODERS)
    assert artifact.layer_mask == direct.layer_mask
    np.testing.assert_allclose(artifact.centroids, direct.centroids, rtol=1e-6)


async def test_nothing_in_range_returns_at_once(bus: Bus) -> None:
    await bus.ensure_streams()
    empty = await read_samples(bus)
    assert (empty.samples, empty.rejected) == ([], 0)
    sample = RoutingSample(
        engine_id="d0",
        request_id="old",
        ts=time.time(),
        prompt_tokens=1,
        decode_tokens=1,
        prefill_counts=np.ones((2, 4), np.uint16),
        decode_counts=np.ones((2, 4), np.uint16),
    )
    await bus.js_publish(bus.subjects.routing_samples, sample)
    await asyncio.sleep(1.1)
    started = time.monotonic()
    assert (await read_samples(bus, since_s=1.0)).samples == []  # every sample is older than that
    assert time.monotonic() - started < 5
    assert [s.request_id for s in (await read_samples(bus)).samples] == ["old"]


async def test_without_live_decoders_the_refit_says_why(bus: Bus, settings: SwitchyardSettings) -> None:
    env = {**os.environ, "SWITCHYARD_SUBJECT_PREFIX": bus.subjects.prefix}
    command = [sys.executable, "-m", "switchyard.cli", "fit", "--from-stream"]
    command += ["--nats-url", settings.nats_servers[0]]
    fit = await asyncio.create_subprocess_exec(*command, env=env, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(fit.communicate(), 60)
    assert fit.returncode == 2 and b"no decode engine answered the announce" in err


async def test_samples_on_the_stream_of_before_the_rename_are_still_read(bus: Bus) -> None:
    """A bus deployed before the rename holds `SY_CALIBRATION` (`sy.calibration.samples`): the fit reads it too,
    older samples first, and the newest `limit` over both streams."""
    s = bus.subjects
    await bus.ensure_streams()
    assert s.legacy_routing_samples_stream not in s.streams()  # nothing creates the old stream any more
    await bus.ensure_stream(s.legacy_routing_samples_stream, [s.legacy_routing_samples])  # as an old release did

    def sample(request_id: str) -> RoutingSample:
        counts = np.ones((2, 4), np.uint16)
        return RoutingSample(
            engine_id="d0",
            request_id=request_id,
            ts=time.time(),
            prompt_tokens=1,
            decode_tokens=1,
            prefill_counts=counts,
            decode_counts=counts,
        )

    await bus.js_publish(s.legacy_routing_samples, sample("before-1"))
    await bus.js_publish(s.legacy_routing_samples, sample("before-2"))
    await bus.js.publish(s.legacy_routing_samples, b"\xc1 not a sample")
    await bus.js_publish(s.routing_samples, sample("after"))
    read = await read_samples(bus)
    assert [x.request_id for x in read.samples] == ["before-1", "before-2", "after"] and read.rejected == 1
    assert [x.request_id for x in (await read_samples(bus, limit=2)).samples] == ["before-2", "after"]
