"""Local engine choices, pure functions: the router-down fallback and the prefill engine's prefix rule."""

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


def pick_prefill(
    key: bytes,
    engine_ids: Sequence[str],
    inflight: Sequence[int],
    load_bound: float,
    cached: Sequence[float] | None = None,
) -> list[int]:
    """Prefill engines in the order to try: the most cached prefix under a load bound, then prefix-hash affinity.

    Engines under the bound are those whose in-flight count is below `ceil(load_bound * (total + 1) / n)`
    (consistent hashing with bounded loads); among them the first choice holds the most of the prompt's leading
    blocks (`cached[i]`, blocks or tokens, one unit for all), ties (and no `cached`) going to the highest-ranked by
    the rendezvous hash of the prompt prefix `key`. A hot prefix so spills to the engines under the bound instead
    of queueing on the one that holds it; with none under it, the top-ranked engine. The rest follow as retries,
    most cached first, then by rank.
    """
    order = rendezvous_order(key, engine_ids)
    if not order:
        return order
    limit = math.ceil(load_bound * (sum(inflight) + 1) / len(order))
    if cached is None or not any(cached):
        first = next((i for i in order if inflight[i] < limit), order[0])
        return [first, *(i for i in order if i != first)]
    rank = {i: r for r, i in enumerate(order)}
    under = [i for i in order if inflight[i] < limit]
    first = max(under, key=lambda i: (cached[i], -rank[i])) if under else order[0]
    rest = sorted((i for i in order if i != first), key=lambda i: (-cached[i], rank[i]))
    return [first, *rest]
