"""Refit the ELDR routing artifact from what the fleet measured: routing samples on `SY_ROUTING_SAMPLES`.

Engines publish a `RoutingSample` (prefill and decode expert counts) for a fraction of the requests they
finish. `switchyard fit --from-stream` reads them back, asks the fleet who its decoders are and what model
they serve (an `Announce`, then their hellos), and fits one centroid per live decoder with the same code as
the offline fit on a trace. The stored artifact then reaches the routers through the KV bucket, which they
watch. So the routing follows the traffic the fleet actually serves, not the trace it was first fitted on.

Upgrades: before the rename, the samples were `CalibrationSample`s on `sy.calibration.samples`, stream
`SY_CALIBRATION`. The message is the same, so where a bus still holds that stream its samples are read too
(older first), until they age out (a week) or an operator deletes the stream; nothing writes to it any more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode
from switchyard.shared.errors import WireError
from switchyard.shared.schemas import Announce, Hello, RoutingSample
from switchyard.solver.signatures import RequestCounts

log = logging.getLogger(__name__)


class RefitError(ValueError):
    """Not enough (or inconsistent) data on the bus to fit from."""


@dataclass(frozen=True)
class StreamSamples:
    samples: list[RoutingSample]
    rejected: int  # messages on the stream that did not decode


async def read_samples(bus: Bus, since_s: float | None = None, limit: int = 20_000) -> StreamSamples:
    """The newest `limit` routing samples (of the last `since_s` seconds, if given), those still on the stream
    of before the rename included (see the module's docstring)."""
    s = bus.subjects
    legacy = await _legacy_samples(bus, since_s, limit)
    current = await _read_stream(bus, s.routing_samples, s.routing_samples_stream, since_s, limit)
    samples = [*legacy.samples, *current.samples]
    return StreamSamples(samples[-limit:], legacy.rejected + current.rejected)


async def _legacy_samples(bus: Bus, since_s: float | None, limit: int) -> StreamSamples:
    """The samples on `SY_CALIBRATION`, where a bus deployed before the rename still has it; none otherwise."""
    s = bus.subjects
    try:
        return await _read_stream(bus, s.legacy_routing_samples, s.legacy_routing_samples_stream, since_s, limit)
    except NotFoundError:
        return StreamSamples([], 0)
    except NatsTimeoutError:  # e.g. credentials of before the rename that may not read it: the new ones do
        stream = s.legacy_routing_samples_stream
        log.warning("stream %s (routing samples of before the rename) not readable; skipped", stream)
        return StreamSamples([], 0)


async def _read_stream(bus: Bus, subject: str, stream: str, since_s: float | None, limit: int) -> StreamSamples:
    """The newest `limit` samples on one stream (raises `NotFoundError` if the stream does not exist)."""
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
    samples: list[RoutingSample] = []
    rejected = 0
    done = asyncio.Event()

    async def on_message(msg: object) -> None:
        nonlocal rejected
        try:
            samples.append(decode(msg.data, RoutingSample, bus.max_payload))  # type: ignore[attr-defined]
        except WireError as exc:
            rejected += 1
            log.warning("routing sample %d on %s rejected: %s", msg.metadata.sequence.stream, stream, exc)  # type: ignore[attr-defined]
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


def counts_from_samples(samples: list[RoutingSample], top_k: int, model_name: str) -> RequestCounts:
    """The samples as the fit's training set; samples of a shape other than the most common one are left out."""
    if not samples:
        raise RefitError("the routing-sample stream holds no sample yet (engines publish a share of finished requests)")
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
