"""Refit the ELDR routing artifact from what the fleet measured: calibration samples on `SY_CALIBRATION`.

Engines publish a `CalibrationSample` (prefill and decode expert counts) for a fraction of the requests they
finish. `switchyard fit --from-stream` reads them back, asks the fleet who its decoders are and what model
they serve (an `Announce`, then their hellos), and fits one centroid per live decoder with the same code as
the offline fit on a trace. The stored artifact then reaches the routers through the KV bucket, which they
watch. So the routing follows the traffic the fleet actually serves, not the trace it was first fitted on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from nats.js.api import ConsumerConfig, DeliverPolicy

from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode
from switchyard.shared.errors import WireError
from switchyard.shared.schemas import Announce, CalibrationSample, Hello
from switchyard.solver.signatures import RequestCounts

log = logging.getLogger(__name__)


class RefitError(ValueError):
    """Not enough (or inconsistent) data on the bus to fit from."""


@dataclass(frozen=True)
class StreamSamples:
    samples: list[CalibrationSample]
    rejected: int  # messages on the stream that did not decode


async def read_samples(bus: Bus, since_s: float | None = None, limit: int = 20_000) -> StreamSamples:
    """The newest `limit` samples on the calibration stream (of the last `since_s` seconds, if given)."""
    subject, stream = bus.subjects.calibration_samples, bus.subjects.calibration_stream
    info = await bus.js.stream_info(stream)
    last = info.state.last_seq
    if info.state.messages == 0:
        return StreamSamples([], 0)
    if since_s is not None:
        start = datetime.fromtimestamp(time.time() - since_s, UTC)
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start)
    else:
        first = max(info.state.first_seq, last - limit + 1)
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first)
    samples: list[CalibrationSample] = []
    rejected = 0
    done = asyncio.Event()

    async def on_message(msg: object) -> None:
        nonlocal rejected
        try:
            samples.append(decode(msg.data, CalibrationSample, bus.max_payload))  # type: ignore[attr-defined]
        except WireError as exc:
            rejected += 1
            log.warning("calibration sample %d rejected: %s", msg.metadata.sequence.stream, exc)  # type: ignore[attr-defined]
        if msg.metadata.sequence.stream >= last:  # type: ignore[attr-defined]
            done.set()

    subscription = await bus.js.subscribe(subject, stream=stream, cb=on_message, ordered_consumer=True, config=config)
    try:
        info = await subscription.consumer_info()
        if info.num_pending or info.delivered.consumer_seq:  # something is in range: it ends with message `last`
            await asyncio.wait_for(done.wait(), timeout=60.0)
    finally:
        await subscription.unsubscribe()
    return StreamSamples(samples[-limit:], rejected)


async def fleet_hellos(bus: Bus, wait_s: float = 1.5) -> dict[str, Hello]:
    """Every engine that answers an announce within `wait_s`, by engine id."""
    hellos: dict[str, Hello] = {}

    def on_hello(hello: Hello, _msg: object) -> None:
        hellos[hello.engine_id] = hello

    subscription = await bus.subscribe(bus.subjects.all_hello, Hello, on_hello)
    try:
        await bus.publish(bus.subjects.announce, Announce(requester="switchyard-fit"))
        await asyncio.sleep(wait_s)
    finally:
        await subscription.unsubscribe()
    return hellos


def decoders_of(hellos: dict[str, Hello]) -> tuple[list[str], int, str]:
    """The live decoders (role decode, else dp), sorted, with the top-k and model name they agree on."""
    decoders = [h for h in hellos.values() if h.role == "decode"] or [h for h in hellos.values() if h.role == "dp"]
    if not decoders:
        raise RefitError("no decode engine answered the announce: is the fleet up, on this NATS and prefix?")
    models = {(h.model.name, h.model.top_k) for h in decoders}
    if len(models) > 1:
        raise RefitError(f"the decoders serve different models {sorted(models)}: fit one group at a time")
    ((name, top_k),) = models
    return sorted(h.engine_id for h in decoders), top_k, name


def counts_from_samples(samples: list[CalibrationSample], top_k: int, model_name: str) -> RequestCounts:
    """The samples as the fit's calibration set; samples of a shape other than the most common one are left out."""
    if not samples:
        raise RefitError("the calibration stream holds no sample yet (engines publish a fraction of finished requests)")
    shapes = Counter(s.prefill_counts.shape for s in samples)
    shape, _ = shapes.most_common(1)[0]
    kept = [s for s in samples if s.prefill_counts.shape == shape]
    if len(kept) < len(samples):
        log.warning("%d samples of other shapes than %s left out", len(samples) - len(kept), list(shape))
    return RequestCounts(
        prefill=np.stack([s.prefill_counts for s in kept]).astype(np.int64),
        decode=np.stack([s.decode_counts for s in kept]).astype(np.int64),
        top_k=top_k,
        model_name=model_name,
    )
