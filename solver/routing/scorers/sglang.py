"""SGLang's cache-aware policy (sgl-project/sglang, the router `sgl-router`, now `sgl-model-gateway`), as one
rule-shaped cost: its least is the policy's choice.

Read from `sgl-router/src/policies/cache_aware.rs` (the rule) and `sgl-router/py_src/sglang_router/router_args.py`
(the defaults a launched router uses: ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
``balance_rel_threshold`` 1.5; the Rust `CacheAwareConfig::default()` differs, 0.5 / 32 / 1.1, and is not what
the CLI runs). The rule, per request:

1. *imbalanced* when ``max_load − min_load > balance_abs_threshold`` **and**
   ``max_load > min_load · balance_rel_threshold``: the least loaded engine (shortest queue);
2. else, if the best prefix match rate (matched over the request's length) is above ``cache_threshold``: the
   engine with that longest match;
3. else the engine whose tree is smallest (the most room to cache).

Switchyard's columns: a worker's load is the router's count of requests it sent there and not finished
(``outstanding``, exact, as SGLang's router counts); the match rate is ``cached_tokens / prompt_tokens`` from
whichever index answered (SGLang matches characters of the text in its approximate tree); the tree size is
``indexed_blocks``, the blocks the prefix index holds for the engine. Loads are compared over the live engines.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouteQuery
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables

__all__ = ["SglangCacheAware"]


@dataclass(frozen=True)
class SglangCacheAware:
    cache_threshold: float = 0.3
    balance_abs_threshold: float = 64.0
    balance_rel_threshold: float = 1.5
    name: str = "sglang_cache_aware"
    needs: frozenset[str] = need("outstanding", "alive", "indexed_blocks", "prompt_tokens", "cached_tokens")

    def branch(self, snap: FleetSnapshot, query: RouteQuery) -> str:
        """Which of the rule's three branches decides: ``"balance"``, ``"cache"`` or ``"smallest_tree"``."""
        load = snap.column("outstanding")
        live = load[snap.alive] if snap.alive.any() else load
        if live.size:
            high, low = float(live.max()), float(live.min())
            if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
                return "balance"
        if query.cached is not None and query.prompt_tokens > 0:
            cached = np.asarray(query.cached, dtype=np.float64)
            best = cached[snap.alive] if snap.alive.any() else cached
            if best.size and float(best.max()) / query.prompt_tokens > self.cache_threshold:
                return "cache"
        return "smallest_tree"

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        branch = self.branch(snap, query)
        if branch == "balance":
            return np.asarray(snap.column("outstanding"), dtype=np.float64)
        if branch == "cache":
            return -np.asarray(query.cached, dtype=np.float64)
        return np.asarray(snap.column("indexed_blocks"), dtype=np.float64)
