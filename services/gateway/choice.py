"""Local engine choices, pure functions: the router-down fallback and the prefill engine's affinity rule."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence


def least_loaded(inflight: Sequence[int], turn: int = 0) -> int:
    """Index of the engine with the fewest requests in flight; ties rotate with `turn`. -1 if none."""
    n = len(inflight)
    if n == 0:
        return -1
    low = min(inflight)
    ties = [i for i, v in enumerate(inflight) if v == low]
    return ties[turn % len(ties)]


def _weight(key: bytes, engine_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\x00" + engine_id.encode(), digest_size=8).digest(), "big")


def rendezvous_order(key: bytes, engine_ids: Sequence[str]) -> list[int]:
    """Engines ranked by highest-random-weight hashing of `key`: stable as engines come and go (only the
    keys of a departed engine move), so one prompt prefix keeps landing where its KV blocks are cached."""
    return sorted(range(len(engine_ids)), key=lambda i: _weight(key, engine_ids[i]), reverse=True)


def pick_prefill(key: bytes, engine_ids: Sequence[str], inflight: Sequence[int], load_bound: float) -> list[int]:
    """Prefill engines in the order to try: prefix-hash affinity with a load bound.

    The first choice is the highest-ranked engine (rendezvous hash of the prompt prefix `key`) whose in-flight
    count is below `ceil(load_bound * (total + 1) / n)` (consistent hashing with bounded loads): a hot prefix
    spills to its next-ranked engines instead of queueing on one. The rest follow in rank order (retries).
    """
    order = rendezvous_order(key, engine_ids)
    if not order:
        return order
    limit = math.ceil(load_bound * (sum(inflight) + 1) / len(order))
    first = next((i for i in order if inflight[i] < limit), order[0])
    return [first, *(i for i in order if i != first)]
