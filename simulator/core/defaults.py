"""The simulator's default settings, each owned here once and named for what it mirrors.

Fleets, options, engines, the live fleet and the CLI read these names rather than repeating the numbers, so
that a default changes in one place. The in-flight grace is the routing layer's own default
(`solver.routing.defaults`, which the router's setting also reads), named here for the simulator.
"""

from __future__ import annotations

from switchyard.solver.routing.defaults import DEFAULT_INFLIGHT_GRACE_S

__all__ = [
    "COORDINATOR_INTERVAL_S",
    "DECODE_MAX_RUNNING",
    "DP_MAX_RUNNING",
    "INFLIGHT_GRACE_S",
    "TELEMETRY_INTERVAL_S",
    "TOKEN_BUDGET",
]

#: vLLM `max_num_seqs` default: requests one disaggregated decode engine runs at once.
DECODE_MAX_RUNNING = 256
#: vLLM `max_num_seqs` default for the API server on GPUs with >= 70 GiB: one DP engine's running requests.
DP_MAX_RUNNING = 1024
#: vLLM `max_num_batched_tokens` default (same condition): tokens one step computes (prefill chunking).
TOKEN_BUDGET = 8192
#: The bus contract's telemetry period: `sy.engine.<id>.telemetry` about every 100 ms.
TELEMETRY_INTERVAL_S = 0.1
#: vLLM's DP coordinator: `min_stats_update_interval_ms` = 100.
COORDINATOR_INTERVAL_S = 0.1
#: The router's in-flight grace (`SWITCHYARD_ROUTER_INFLIGHT_GRACE_S` default): a decision's prompt tokens
#: count as in flight until a report received at least this long after it.
INFLIGHT_GRACE_S = DEFAULT_INFLIGHT_GRACE_S
