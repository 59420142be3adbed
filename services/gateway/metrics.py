"""Prometheus metrics of the gateway, as the client sees its requests.

The five that mirror vLLM's are named after them, `vllm:` read as `switchyard_gateway_`, with vLLM's label names
(`model_name`, `engine`, plus `kind`: dp or disagg) and vLLM's buckets (vllm/v1/metrics/loggers.py): a query or
panel written for `vllm serve` reads the gateway's by swapping the prefix (`VLLM_NAMES`). Not `vllm:` itself:
Prometheus would then sum the gateway's series with the engines' it relays. `model_name` is the serving engine's
model from its hello, so clients cannot grow the label sets.
"""

from __future__ import annotations

import re

from prometheus_client import Counter, Gauge, Histogram

#: vLLM's buckets, so a quantile of the gateway's histogram and of its engines' is read on the same bounds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
_PER_ENGINE = ["model_name", "engine", "kind"]

TTFT = Histogram(
    "switchyard_gateway_time_to_first_token_seconds",
    "Time from a request's arrival at the gateway to the first byte of its answer sent to the client, by model, "
    "serving engine and kind (vLLM's vllm:time_to_first_token_seconds, seen from the client's side).",
    _PER_ENGINE,
    buckets=TTFT_BUCKETS,
)
ITL = Histogram(
    "switchyard_gateway_inter_token_latency_seconds",
    "Gap between consecutive stream chunks carrying tokens sent to the client, by model, engine and kind (vLLM's "
    "vllm:inter_token_latency_seconds, vllm:time_per_output_token_seconds in older releases).",
    _PER_ENGINE,
    buckets=ITL_BUCKETS,
)
E2E = Histogram(
    "switchyard_gateway_e2e_request_latency_seconds",
    "Time from a request's arrival at the gateway to the last byte of its answer, by model, engine and kind "
    "(vLLM's vllm:e2e_request_latency_seconds).",
    _PER_ENGINE,
    buckets=E2E_BUCKETS,
)
PROMPT_TOKENS = Counter(
    "switchyard_gateway_prompt_tokens_total",
    "Prompt tokens of the answered requests, by served model (vLLM's vllm:prompt_tokens_total): the engine's "
    "usage where its answer gives one, else the gateway's own count (exact where it tokenized, ~4 characters a "
    "token otherwise).",
    ["model_name"],
)
GENERATION_TOKENS = Counter(
    "switchyard_gateway_generation_tokens_total",
    "Tokens the engines generated for the gateway's clients, by served model (vLLM's "
    "vllm:generation_tokens_total): the engine's usage where its answer gives one (every whole answer; a stream "
    "with stream_options.include_usage), else one per streamed choice event (see docs/gateway.md).",
    ["model_name"],
)
INFLIGHT = Gauge(
    "switchyard_gateway_inflight_requests",
    "Completion requests in this gateway now (queued, routed or streaming): what vLLM shows as "
    "vllm:num_requests_running plus vllm:num_requests_waiting, as the gateway holds them.",
)
#: The gateway's metric (as exposed) -> the vLLM metric it mirrors (as `vllm serve` exposes it).
VLLM_NAMES = {
    "switchyard_gateway_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "switchyard_gateway_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "switchyard_gateway_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "switchyard_gateway_prompt_tokens_total": "vllm:prompt_tokens_total",
    "switchyard_gateway_generation_tokens_total": "vllm:generation_tokens_total",
}
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
        at = metric._labelnames.index("engine")  # prometheus_client's own: children are keyed by label tuples
        for labels in [key for key in list(metric._metrics) if key[at] == engine_id]:
            metric.remove(*labels)


_USAGE_KEY = b'"usage"'
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_CHOICE_EVENT = b'"finish_reason"'  # one per choice in every streamed event of vLLM's (null until the last)
#: Chat's opening event per choice: the role, no content yet (vLLM's, compact JSON): no token.
_ROLE_ONLY = re.compile(rb'"delta"\s*:\s*\{\s*"role"\s*:\s*"assistant"\s*,\s*"content"\s*:\s*""\s*\}')


def usage_of(body: bytes) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of the last `usage` object in an answer's bytes (None: not given).

    A regex from the last `"usage"` on, not a JSON parse: it runs on every answer. A client's text cannot fake
    it: inside a JSON string a quote is escaped, so `"completion_tokens"` matches only a key."""
    at = body.rfind(_USAGE_KEY)
    if at < 0:
        return None, None
    prompt, completion = _PROMPT.search(body, at), _COMPLETION.search(body, at)
    return (int(prompt.group(1)) if prompt else None), (int(completion.group(1)) if completion else None)


def count_answer(model: str, body: bytes, prompt_tokens: int) -> None:
    """A whole answer's tokens: its usage (vLLM always sends one), else the prompt as the gateway counted it."""
    prompt, completion = usage_of(body)
    PROMPT_TOKENS.labels(model).inc(prompt if prompt is not None else prompt_tokens)
    if completion is not None:
        GENERATION_TOKENS.labels(model).inc(completion)


class StreamTokens:
    """A stream's tokens, tallied as its chunks pass: the last usage seen (`stream_options.include_usage`; with
    `continuous_usage_stats` every chunk's, cumulative), else one token per choice event (vLLM sends one per
    decoding step: exact for a reader that keeps up without speculative decoding, an undercount where vLLM merges
    steps into one event), chat's role-only opening event not counted."""

    __slots__ = ("completion", "events", "prompt")

    def __init__(self) -> None:
        self.events = 0
        self.prompt: int | None = None
        self.completion: int | None = None

    def see(self, chunk: bytes) -> bool:
        """Tally one chunk; whether it carried a choice event (a token, or the last one's finish)."""
        events = chunk.count(_CHOICE_EVENT)
        if events and b'"role"' in chunk:
            events -= len(_ROLE_ONLY.findall(chunk))
        self.events += events
        if _USAGE_KEY in chunk:
            prompt, completion = usage_of(chunk)
            if prompt is not None:
                self.prompt = prompt
            if completion is not None:
                self.completion = completion
        return events > 0

    def count(self, model: str, prompt_tokens: int) -> None:
        """Add the stream's tokens to the counters (once, at its end, whatever the outcome: they were made)."""
        PROMPT_TOKENS.labels(model).inc(self.prompt if self.prompt is not None else prompt_tokens)
        GENERATION_TOKENS.labels(model).inc(self.completion if self.completion is not None else self.events)


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
    ["model_name"],
)
SESSIONS = Counter(
    "switchyard_gateway_session_routes_total",
    "Requests naming a known session, by what happened: sticky (sent to the session's engine), saturated (its "
    "engine had no room: routed anew), gone (its engine is no longer a candidate).",
    ["outcome"],
)
