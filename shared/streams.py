"""Named, independent random streams derived from one seed.

Why: two consumers seeded with the same integer (`default_rng(seed)` twice) draw the *same* numbers. In the
simulator that made the `random` decode baseline pick decoder ``⌊u·D⌋`` for the request whose replayed trace
row was ``⌊u·N⌋`` drawn from the same ``u``: with a task-ordered replay pool, `random` acted as a task
router. Every consumer of randomness therefore asks for its own stream by name; streams of different names
(or different seeds) are statistically independent children of one `numpy.random.SeedSequence`, and a
stream depends only on (seed, name), so adding a consumer never shifts another one's draws.
"""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["STREAMS", "stream", "stream_seed"]

#: The simulator's consumers, one stream each (other names are allowed; these are the ones in use).
STREAMS = (
    "split",  # calibration / replay split of the routing trace
    "workload.replay",  # which trace request each simulated request replays
    "workload.arrival",  # Poisson inter-arrival times
    "router",  # the decode policy's draws (random, p2c samples, tie-breaks)
    "dp.telemetry",  # DP engines' telemetry phases
    "live.calibration",  # the live fleet's routing-sample draws (named before the rename; kept, so seeds agree)
    "fig4",  # same-domain vs mixed batch sampling
)


def _key(name: str) -> int:
    if not name:
        raise ValueError("a random stream needs a name")
    return zlib.crc32(name.encode())


def stream_seed(seed: int, name: str) -> np.random.SeedSequence:
    """The `SeedSequence` of stream `name` under `seed` (a spawn child keyed by the name's CRC-32)."""
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    return np.random.SeedSequence(entropy=seed, spawn_key=(_key(name),))


def stream(seed: int, name: str) -> np.random.Generator:
    """A fresh generator for consumer `name`: independent of every other name's stream under any seed."""
    return np.random.default_rng(stream_seed(seed, name))
