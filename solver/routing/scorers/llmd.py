"""llm-d's default scoring (its inference scheduler, the Gateway API Inference Extension's endpoint picker), as
three lower-is-better terms: each is minus llm-d's score in [0, 1], so the weighted sum's least is llm-d's
max-score pick.

Read from:

- the EPP default configuration that llm-d's inference-scheduling guide and the GIE chart ship
  (`default-plugins.yaml`: plugins `queue-scorer` weight 2, `kv-cache-utilization-scorer` weight 2,
  `prefix-cache-scorer` weight 3, then `max-score-picker`; llm-d/llm-d-inference-scheduler docs and
  kubernetes-sigs/gateway-api-inference-extension `config/charts/inferencepool`), the weights we take;
- the scorers (GIE `pkg/epp/scheduling/framework/plugins/scorer`): the queue scorer min-max normalises the
  engines' waiting-queue sizes, ``(max − q) / (max − min)`` (every engine 1 when all are equal); the KV scorer is
  ``1 − kv_usage``; the prefix scorer is the matched blocks over the request's blocks.

Switchyard's columns: the queue is ``waiting`` (vLLM's num_requests_waiting, as llm-d scrapes it, plus the
router's own decisions since the report), normalised over the live engines (llm-d normalises over the
candidates its filters left; liveness is ours); the prefix match is ``cached_tokens / prompt_tokens`` from
whichever index answered (llm-d counts whole blocks: the same ratio but for a partial last block; its
approximate scorer hashes at most ``maxPrefixBlocksToMatch`` blocks of a prompt, 256 by default, a cap we do not
apply). The scorers' code read: GIE `queue` scorer (``WaitingQueueSize``, min-max, 1 when all equal),
`kv-cache-utilization` scorer (``1 − KVCacheUsagePercent``), `prefix` scorer (``matchLen / len(hashes)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouteQuery
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables

__all__ = ["LLMD_WEIGHTS", "LlmdKvUtilization", "LlmdPrefix", "LlmdQueue"]

#: llm-d's default scorer weights (default-plugins.yaml): queue 2, KV utilisation 2, prefix cache 3.
LLMD_WEIGHTS = {"llmd_queue": 2.0, "llmd_kv_utilization": 2.0, "llmd_prefix": 3.0}


@dataclass(frozen=True)
class LlmdQueue:
    name: str = "llmd_queue"
    needs: frozenset[str] = need("waiting", "alive")

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        queue = snap.column("waiting")
        live = queue[snap.alive] if snap.alive.any() else queue
        if live.size == 0:
            return np.zeros(snap.size)
        low, high = float(live.min()), float(live.max())
        if high == low:
            return np.full(snap.size, -1.0)
        return -np.clip((high - queue) / (high - low), 0.0, 1.0)


@dataclass(frozen=True)
class LlmdKvUtilization:
    name: str = "llmd_kv_utilization"
    needs: frozenset[str] = need("kv_usage")

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        return np.clip(snap.kv_usage, 0.0, 1.0) - 1.0


@dataclass(frozen=True)
class LlmdPrefix:
    name: str = "llmd_prefix"
    needs: frozenset[str] = need("prompt_tokens", "cached_tokens")

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        if query.cached is None or query.prompt_tokens <= 0:
            return np.zeros(snap.size)
        return -np.clip(np.asarray(query.cached, dtype=np.float64) / float(query.prompt_tokens), 0.0, 1.0)
