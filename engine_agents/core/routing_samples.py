"""Routing samples: the per-request training data of the ELDR routing fit, as every engine kind publishes it.

For a share of the requests it finishes, an engine publishes one `RoutingSample` on `sy.routing.samples`
(JetStream `SY_ROUTING_SAMPLES`): the request's prefill expert counts `c[L, E]` (its signature) and decode
expert counts `p[L, E]`. `switchyard fit --from-stream` (`services/refit.py`) refits the router's artifact
from them. (They were "calibration samples" before; "calibration" now means only the placement fit.)

A lost sample costs a little training data and nothing else, so publishing never raises.
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import TYPE_CHECKING

import numpy as np

from switchyard.engine_agents.core.stored import RESEND_FOR_S, publish_until_stored
from switchyard.shared.schemas import RoutingSample

__all__ = ["publish_routing_sample", "routing_sample", "sampled"]

if TYPE_CHECKING:  # the bus is only passed in: importing this module does not pull in NATS
    from switchyard.shared.bus import Bus

log = logging.getLogger(__name__)


def sampled(request_id: str, fraction: float) -> bool:
    """Whether `request_id` is in the sampled `fraction`: a hash of the id, so every process and run agrees."""
    return zlib.crc32(request_id.encode()) % 10_000 < fraction * 10_000


def routing_sample(
    engine_id: str,
    request_id: str,
    prompt_tokens: int,
    decode_tokens: int,
    prefill_counts: np.ndarray,
    decode_counts: np.ndarray,
    ts: float | None = None,
) -> RoutingSample:
    """One finished request's sample (`prefill_counts`, `decode_counts`: `[L, E]` non-negative ints); an over-long
    request id is cut to what the schema holds."""
    return RoutingSample(
        engine_id=engine_id,
        request_id=request_id[:128],
        ts=time.time() if ts is None else ts,
        prompt_tokens=prompt_tokens,
        decode_tokens=decode_tokens,
        prefill_counts=prefill_counts,
        decode_counts=decode_counts,
    )


async def publish_routing_sample(bus: Bus, sample: RoutingSample, resend_for_s: float = RESEND_FOR_S) -> bool:
    """Store one sample on JetStream, resent until acknowledged (`stored.publish_until_stored`); False (logged)
    if it never was. The msg-id is the engine and request id. Without the resends, a cluster node lost under load
    lost the samples in flight (tests/test_nats_cluster.py)."""
    msg_id = f"{sample.engine_id}:{sample.request_id}"
    what = f"{sample.engine_id}: routing sample {sample.request_id}"
    return await publish_until_stored(bus, bus.subjects.routing_samples, sample, msg_id, what, resend_for_s)
