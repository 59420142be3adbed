"""Prometheus metrics of the endpoint picker: what it answered Envoy, and why it refused.

The pieces it shares with the gateway (engine registry, local fallback) keep counting in their own
`switchyard_gateway_*` series (hellos refused, ejections, routing fallbacks); the router core's decisions count in
`switchyard_router_*` as in any replica.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "switchyard_epp_requests_total",
    "Requests the picker answered, by outcome: routed (an endpoint chosen), bad_request (400), too_large (413), "
    "unknown_model (404), unavailable (503), subset_empty (503: no eligible endpoint in the proxy's subset), "
    "shed (429).",
    ["outcome"],
)
BAD_REQUESTS = Counter(
    "switchyard_epp_bad_requests_total",
    "Request bodies refused with 400, by reason (the gateway parser's: not_json, too_deep, not_object, invalid).",
    ["reason"],
)
PROTOCOL_ERRORS = Counter(
    "switchyard_epp_protocol_errors_total",
    "ext_proc streams ended because a message broke the protocol (reason: out_of_order, no_headers, mode).",
    ["reason"],
)
SERVED_ELSEWHERE = Counter(
    "switchyard_epp_served_elsewhere_total",
    "Responses served by an endpoint other than the first one chosen (the proxy walked the fallback list).",
)
HOP_FAILURES = Counter(
    "switchyard_epp_hop_failures_total",
    "Responses showing the chosen engine could not be reached (Envoy's own 5xx for a reset or refused connection).",
)
DECISION_SECONDS = Histogram(
    "switchyard_epp_decision_seconds",
    "Time from the request's last byte at the picker to its answer (parse, prefix keys, the core's decision).",
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
)
STREAMS = Gauge("switchyard_epp_streams", "ext_proc streams open now (one per HTTP request in flight).")
SELECTIONS = Counter(
    "switchyard_epp_selections_total",
    "POST /v1/select answers (AIBrix's external routing), by outcome: selected, no_decision (Advisory, no live "
    "candidate), denied (Authoritative, no live candidate), bad_request (400), too_large (413).",
    ["outcome"],
)
SELECT_BAD_REQUESTS = Counter(
    "switchyard_epp_select_bad_requests_total",
    "POST /v1/select bodies refused with 400, by reason: not_json, too_deep, not_object, invalid (a field).",
    ["reason"],
)
