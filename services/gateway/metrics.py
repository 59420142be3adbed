"""Prometheus metrics of the gateway, as the client sees its requests (labels: engine, route kind, and the model the
engine serves: from its hello, so clients cannot grow the label sets)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_GAP = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

TTFT = Histogram(
    "switchyard_gateway_ttft_seconds",
    "Time from a request's arrival to its first byte of answer sent to the client, by serving engine, kind and model "
    "(vLLM's vllm:time_to_first_token_seconds, seen from the client's side).",
    ["engine", "kind", "model"],
    buckets=_LATENCY,
)
ITL = Histogram(
    "switchyard_gateway_itl_seconds",
    "Gap between consecutive stream chunks sent to the client (inter-token latency; vLLM's "
    "vllm:inter_token_latency_seconds), by engine, kind and model.",
    ["engine", "kind", "model"],
    buckets=_GAP,
)
E2E = Histogram(
    "switchyard_gateway_e2e_seconds",
    "Time from a request's arrival to the last byte of its answer (vLLM's vllm:e2e_request_latency_seconds), by "
    "serving engine, kind and model.",
    ["engine", "kind", "model"],
    buckets=_LATENCY,
)
REQUESTS = Counter(
    "switchyard_gateway_requests_total",
    "Requests by route kind (dp|disagg) and outcome (ok, client_error, upstream_error, unavailable, aborted).",
    ["kind", "outcome"],
)
BAD_REQUESTS = Counter("switchyard_gateway_bad_requests_total", "Request bodies refused with status 400.", ["reason"])
FALLBACKS = Counter(
    "switchyard_gateway_routing_fallbacks_total",
    "Engine choices made locally instead of by the router, by route kind and reason.",
    ["kind", "reason"],
)
UPSTREAM_ERRORS = Counter(
    "switchyard_gateway_upstream_errors_total",
    "Failed upstream calls, by engine, hop (dp, prefill, decode) and reason.",
    ["engine", "hop", "reason"],
)
RETRIES = Counter(
    "switchyard_gateway_retries_total", "Requests retried on another engine before the first byte.", ["hop"]
)
CLIENT_ABORTS = Counter(
    "switchyard_gateway_client_aborts_total", "Client disconnects that aborted an upstream request.", ["kind"]
)
ENGINES_REFUSED = Counter(
    "switchyard_gateway_engines_refused_total",
    "Hellos from a new engine id ignored because the registry held max_engines engines, none dead and idle.",
)
SIGNATURES = Counter(
    "switchyard_gateway_signatures_total",
    "Where a handoff's prefill signature came from (response, bus) or that none came (missing).",
    ["source"],
)
HELLOS_REFUSED = Counter(
    "switchyard_gateway_hellos_refused_total",
    "Engine hellos refused because the engine manifest lists the engine otherwise (role, model, base_url, "
    "ep_group, dp_rank) or not at all (unlisted).",
    ["reason"],
)
EJECTIONS = Counter(
    "switchyard_gateway_engine_ejections_total",
    "Engines taken out of rotation after failing hops in a row, an answer no honest engine sends, or a failed trial.",
)
RESTORATIONS = Counter(
    "switchyard_gateway_engine_restorations_total",
    "Ejected engines fully back in rotation: their health check passed, then a real request on trial succeeded.",
)
TRIALS = Counter(
    "switchyard_gateway_engine_trials_total",
    "Ejected engines on trial (one real request at a time) by outcome: started (its health check passed), passed "
    "(a request succeeded: back in rotation), failed (ejected again, its next check backed off).",
    ["outcome"],
)
MODE_SWITCHES = Counter(
    "switchyard_gateway_mode_switches_total",
    "A model's fleet mode changed (to dp or disagg) because its current mode had no live engines left.",
    ["to"],
)


def forget_engine(engine_id: str) -> None:
    """Drop an engine's children of the per-engine metrics once the registry forgets it: engine ids come and go
    (and on a bus without credentials anyone names new ones), so label sets kept for every id ever served grow
    without end."""
    for metric in (TTFT, ITL, E2E, UPSTREAM_ERRORS):
        for labels in [key for key in list(metric._metrics) if key[0] == engine_id]:  # prometheus_client's children
            metric.remove(*labels)


KV_EVENTS = Counter(
    "switchyard_gateway_kv_events_total",
    "KvEvents messages from prefill engines, by outcome: applied, gap (events lost: the engine's blocks cleared "
    "first), late, unknown_engine (no hello), not_prefill (a DP or decode engine's: dropped), block_size (not its "
    "hello's block size), over_capacity (applied, but past its hello's kv_blocks: its oldest blocks out), rate "
    "(any engine's message dropped before decoding: over its keys/s bucket; its blocks cleared).",
    ["outcome"],
)
ODD_BLOCK_SIZE = Counter(
    "switchyard_gateway_odd_block_size_total",
    "Candidate engines passed over by a prompt's block keys because their hello's block size is not the one most "
    "candidates announce (the keys are taken at that one; an odd engine is credited no cached prefix).",
)
PROMPT_KEYS_FAILED = Counter(
    "switchyard_gateway_prompt_keys_failed_total",
    "Requests routed without prefix-cache block keys because computing them failed (a bug: see the debug log).",
)
PREFILL_CHOICES = Counter(
    "switchyard_gateway_prefill_choices_total",
    "Prefill engine choices at a handoff, by what decided: prefix (an engine held the most of the prompt's "
    "blocks), hash (no engine under the load bound held any: rendezvous hash), off (prefix keys disabled).",
    ["by"],
)


# ----- flow control (issue 42: services/gateway/flow.py) and scaling signals -----
_WAIT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
QUEUE_DEPTH = Gauge(
    "switchyard_gateway_queue_depth",
    "Requests queued in this gateway while their model's fleet is saturated, by priority band (low, normal, high).",
    ["band"],
)
QUEUED = Counter("switchyard_gateway_queued_total", "Requests that waited in the gateway's queue, by band.", ["band"])
QUEUE_WAIT = Histogram(
    "switchyard_gateway_queue_wait_seconds",
    "How long requests waited in the gateway's queue before leaving (routed or shed), by band.",
    ["band"],
    buckets=_WAIT,
)
QUEUE_LEFT = Counter(
    "switchyard_gateway_queue_abandoned_total", "Queued requests whose client disconnected, by band.", ["band"]
)
SHED = Counter(
    "switchyard_gateway_shed_total",
    "Requests answered 429 by flow control, by band and reason: queue_full, tenant_full (that tenant's queued "
    "limit), shed (a higher band took its place), expired (waited past queue_max_wait_s).",
    ["band", "reason"],
)
FLEET_SATURATION = Gauge(
    "switchyard_gateway_fleet_saturation",
    "Each model's fleet saturation as this gateway reads it: the mean over its live engines of max(outstanding "
    "requests / concurrency limit, KV usage / its limit). 1: every engine at its limit. An autoscaler's signal.",
    ["model"],
)
INFLIGHT = Gauge(
    "switchyard_gateway_inflight_requests", "Completion requests in this gateway now (queued, routed or streaming)."
)
PROMPT_TOKENS = Counter(
    "switchyard_gateway_prompt_tokens_total",
    "Prompt tokens of the DP requests routed, by served model (`unnamed`: a request naming none); the exact count "
    "where tokenized, else ~4 characters a token.",
    ["model"],
)
SESSIONS = Counter(
    "switchyard_gateway_session_routes_total",
    "Requests naming a known session, by what happened: sticky (sent to the session's engine), saturated (its "
    "engine had no room: routed anew), gone (its engine is no longer a candidate).",
    ["outcome"],
)
