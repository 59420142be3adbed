"""Prefix-cache indexes: which engine holds which of a prompt's blocks, to route a request where its prefix is.

- `BlockIndex` (*precise*): fed by the engines' own KV-cache events (block stored, removed, all cleared), so
  it follows vLLM's evictions; bounded per engine, oldest block out first.
- `RoutedIndex` (*approximate*): what was routed where, with expiry; needs no cooperation from the engines.

Both answer `match(keys, engine_ids)`: for each engine, how many of the prompt's leading block keys it holds
(`shared.prefix_keys` names the blocks). The router turns that into the request input ``cached_tokens``
(`RouteQuery.cached`), which the prefix scorers read. `BlockIndex.credit` weighs blocks held in offload tiers
(CPU, disk; `tiers`) below those in the engine's KV cache. `KvApplier` applies engines' events to a `BlockIndex` by
the one sequence rule (`shared.sequence`), for the router and the gateway.
"""

from switchyard.solver.routing.prefix.applier import Applied, KvApplier
from switchyard.solver.routing.prefix.blocks import BlockIndex
from switchyard.solver.routing.prefix.routed import RoutedIndex
from switchyard.solver.routing.prefix.tiers import DEFAULT_WEIGHTS, GPU_ONLY, TIERS, TierWeights

__all__ = ["DEFAULT_WEIGHTS", "GPU_ONLY", "TIERS", "Applied", "BlockIndex", "KvApplier", "RoutedIndex", "TierWeights"]
