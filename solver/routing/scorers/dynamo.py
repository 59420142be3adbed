"""Dynamo's KV router cost (ai-dynamo/dynamo `lib/kv-router`), as two lower-is-better terms in KV blocks:

    cost = overlap_score_weight · prefill_blocks + decode_blocks

Read from Dynamo's router documentation (`docs/router/kv_cache_routing.md`, "Cost Calculation": prefill blocks
are the tokens still to prefill over the block size, decode blocks the worker's active blocks; lowest cost
wins, softmax sampling over the range-normalised costs when ``router_temperature`` > 0) and the default
selector (`lib/kv-router/src/scheduling/selector/default.rs`). Defaults taken: ``--router-kv-overlap-score-weight``
1 (the weight of `DynamoPrefill`), ``--router-temperature`` 0 (profile ``dynamo``'s picker:
`pickers.SoftmaxSample`), vLLM's block size 16 (``block_tokens``). Newer releases
(`lib/kv-router/src/scheduling/config.rs`) split the deprecated weight into ``overlap_score_credit`` and
``prefill_load_scale``: ``prefill_load_scale · max(0, prefill blocks − credit · cached blocks) + decode blocks``,
the same cost at their defaults (1 and 1); their host/disk cache tiers, overlap-credit decay and per-request
term in the decode cost are not modelled here (their defaults not checked).

Switchyard's columns for Dynamo's own bookkeeping (its router counts the prefill tokens and blocks of the
sequences it routed; ours reads the engines' reports plus its in-flight ledger):

- `DynamoPrefill`: ``(remaining_prefill + waiting_prefill + inflight_tokens + uncached prompt) / block_tokens``,
  the engine's prefill backlog plus this request's prompt less what that engine has cached
  (``prompt_tokens − cached_tokens``);
- `DynamoDecode`: ``kv_usage · kv_blocks + (inflight_tokens + prompt_tokens) / block_tokens``, the blocks in use
  (``kv_blocks`` is the engine's KV size from its hello), those of requests sent since its last report, and the
  request's own (the same on every engine; Dynamo's reuse-aware count would drop its blocks already active).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouteQuery
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables

__all__ = ["DYNAMO_BLOCK_TOKENS", "DYNAMO_OVERLAP_WEIGHT", "DYNAMO_TEMPERATURE", "DynamoDecode", "DynamoPrefill"]

#: Dynamo's defaults: ``--router-kv-overlap-score-weight`` 1, ``--router-temperature`` 0; vLLM's block size 16.
DYNAMO_OVERLAP_WEIGHT = 1.0
DYNAMO_TEMPERATURE = 0.0
DYNAMO_BLOCK_TOKENS = 16


def _uncached(snap: FleetSnapshot, query: RouteQuery) -> np.ndarray:
    prompt = float(query.prompt_tokens)
    if query.cached is None:
        return np.full(snap.size, prompt)
    return np.maximum(prompt - np.asarray(query.cached, dtype=np.float64), 0.0)


@dataclass(frozen=True)
class DynamoPrefill:
    block_tokens: int = DYNAMO_BLOCK_TOKENS
    name: str = "dynamo_prefill"
    needs: frozenset[str] = need(
        "remaining_prefill", "waiting_prefill", "inflight_tokens", "prompt_tokens", "cached_tokens"
    )

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        backlog = snap.column("remaining_prefill") + snap.column("waiting_prefill") + snap.column("inflight_tokens")
        return (backlog + _uncached(snap, query)) / self.block_tokens


@dataclass(frozen=True)
class DynamoDecode:
    block_tokens: int = DYNAMO_BLOCK_TOKENS
    name: str = "dynamo_decode"
    needs: frozenset[str] = need("kv_usage", "kv_blocks", "inflight_tokens", "prompt_tokens")

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        active = np.clip(snap.kv_usage, 0.0, 1.0) * snap.column("kv_blocks")
        return active + (snap.column("inflight_tokens") + float(query.prompt_tokens)) / self.block_tokens
