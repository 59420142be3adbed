"""Gateway settings (`SWITCHYARD_GATEWAY_*`): where it listens, its per-hop timeouts, its handoff knobs."""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_GATEWAY_", env_file=".env", extra="ignore")

    #: Where clients connect: vLLM's own default port, so the gateway can stand in for `vllm serve`.
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    #: auto: each model's fleet keeps the mode it is served in (DP, or prefill->decode) while live engines can
    #: serve it so; it changes only when they are all gone (one new hello never switches a live fleet).
    mode: Literal["auto", "dp", "disagg"] = "auto"

    #: Where routing decisions are made. inprocess: here, by the router's own core (`RouterCore`, configured by
    #: the same `SWITCHYARD_ROUTER_*` settings as `switchyard router`), sharing decisions with the other replicas
    #: over `sy.route.decided`; no bus round trip per request. remote: ask `switchyard router` replicas
    #: (`sy.route.dp`, `sy.route.decode`), for deployments that keep routing in one place (docs/gateway.md).
    router: Literal["inprocess", "remote"] = "inprocess"
    #: In-process: how often the routing artifact's key is read (one message; a gateway creates no consumer).
    artifact_poll_s: float = Field(default=1.0, gt=0)

    # --- per-hop timeouts (every upstream call has one) ---
    #: Opening a TCP connection to an engine.
    connect_timeout_s: float = Field(default=2.0, gt=0)
    #: Waiting for an engine's first byte (headers and first chunk of a stream; a whole non-streaming answer).
    first_byte_timeout_s: float = Field(default=120.0, gt=0)
    #: Between two chunks of a stream once it has started.
    read_timeout_s: float = Field(default=60.0, gt=0)
    #: The whole prefill hop of a prefill->decode handoff (it returns one token).
    prefill_timeout_s: float = Field(default=120.0, gt=0)
    #: Remote: a `sy.route.dp` / `sy.route.decode` round trip; past it the gateway chooses locally (counted).
    route_timeout_s: float = Field(default=0.25, gt=0)
    #: How long the handoff waits for a `PrefillSignature` on the bus when the prefill response carried none.
    signature_wait_s: float = Field(default=0.2, ge=0)

    # --- bounds on what an engine answers (issue 37; services/gateway/engine_http.py) ---
    #: An answer the gateway reads whole (a non-streaming completion, a prefill's, an engine's 4xx body) larger
    #: than this fails the hop (`too_large`, the engine ejected), at its declared content-length or as soon as
    #: its bytes pass it. An OpenAI completion answer is far smaller: its text plus usage, a few KiB per 1,000
    #: tokens (n choices with logprobs of a long answer a few MiB); streams are relayed chunk by chunk instead.
    max_answer_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    #: An answer's status line and headers larger than this fail the hop (`head_too_large`); vLLM's are ~200 B.
    max_answer_head_bytes: int = Field(default=64 * 1024, ge=1024)
    #: An answer's head must end within this many seconds of its first byte (`head_timeout`). Not the time to
    #: the first byte (`first_byte_timeout_s` bounds that: vLLM sends a non-streaming answer's head only when the
    #: whole answer is ready), but a head that trickles: an honest engine writes its head at once.
    head_timeout_s: float = Field(default=10.0, gt=0)

    # --- engines ---
    # Liveness is the one rule every service applies: `SWITCHYARD_LIVENESS_MISSES` and `_MAX_SILENCE_S`, which the
    # gateway's older names `SWITCHYARD_GATEWAY_HELLO_MISSES` and `_STALE_AFTER_S` still set for every service.
    #: An engine whose hops fail this many times in a row (once: an answer past a bound above, or not JSON) leaves
    #: rotation at once ...
    eject_after_failures: int = Field(default=2, ge=1)
    #: ... until its own `GET /health` answers 2xx, and then only on trial: one real request at a time until one
    #: succeeds (a failed trial ejects it again, its next check backed off; `registry.py`). Ejected engines are
    #: checked this often, each check bounded by `health_timeout_s`. A hello does not bring one back (anyone
    #: with its credentials can send one).
    health_check_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=1.0, gt=0)
    #: Prefill choice: rendezvous hash of the prompt's first this-many characters (prefix-cache affinity) ...
    affinity_prefix_chars: int = Field(default=512, ge=1)
    #: ... unless that engine already holds more than this factor times the mean in-flight count (+1).
    affinity_load_bound: float = Field(default=1.25, ge=1.0)

    # --- prefix-cache keys (issue 25; services/gateway/prompt_keys.py, services/gateway/prefix.py) ---
    #: Name each prompt's blocks (`shared.prefix_keys`) and send them with `sy.route.dp`; pick the prefill engine
    #: of a handoff by the blocks it holds (under `affinity_load_bound`). Off: no keys, the prefill choice is the
    #: rendezvous hash alone (the bench's "prefix off" side).
    prefix_keys: bool = True
    #: Tokenizers per served model, "model=path,model2=path2": a `tokenizer.json` or a directory holding one (its
    #: `tokenizer_config.json` and `chat_template.jinja`, if there, give the chat template and special tokens).
    #: A model without one gets text keys (blocks of its prompt's bytes: matched only against what was routed).
    tokenizers: str = ""
    #: Prompts of at most this many characters are tokenized on the event loop (~0.07 ms per 100 tokens here);
    #: longer ones in a worker thread (`encode_batch`, which releases the GIL), so the loop keeps serving.
    tokenize_inline_chars: int = Field(default=2048, ge=0)
    #: Worker threads for long prompts' tokenization.
    tokenize_threads: int = Field(default=2, ge=1)
    #: A long prompt is tokenized in pieces of about this many characters, cut where the tokenizer splits anyway
    #: (checked per tokenizer at startup; one that disagrees is never cut; 0: never cut): new pieces are encoded in
    #: parallel, pieces an earlier prompt had come from a cache of this many ...
    tokenize_piece_chars: int = Field(default=2048, ge=0)
    tokenize_cache_pieces: int = Field(default=4096, ge=1)
    #: Tokenize every prompt in full (exact prompt token counts for the router; ~1-3 µs a token on this machine's
    #: cores, on the request's path). Off: only the leading text this gateway has seen lead a prompt before is
    #: tokenized (no engine can hold blocks of a prefix no prompt had), so a new prompt costs ~0.1 ms, not 10 ms.
    tokenize_all: bool = False
    #: The seen-text index: leading 256-character blocks kept per model (LRU), for `prefix_routed_ttl_s`.
    tokenize_seen_blocks: int = Field(default=200_000, ge=1)
    #: The prefill prefix index: blocks kept per prefill engine from its KV events (oldest out first) ...
    prefix_index_blocks: int = Field(default=500_000, ge=1)
    #: ... and, for engines that send none (or text keys), blocks of what the gateway routed there, kept this long.
    prefix_routed_blocks: int = Field(default=100_000, ge=1)
    prefix_routed_ttl_s: float = Field(default=600.0, gt=0)

    # --- flow control under saturation (issue 42; services/gateway/admission.py, services/gateway/flow.py) ---
    #: Queue requests in the gateway while the model's fleet is saturated, and let them out by priority band and
    #: fairly across tenants; off: every request is routed at once, as before (engines queue the excess).
    admission: bool = True
    #: An engine is saturated at this many requests outstanding (running + waiting + decided since its last
    #: report); 0: its hello's `capacity.max_running` (vLLM's `max_num_seqs`), past which it queues them itself.
    saturation_concurrency: int = Field(default=0, ge=0)
    #: ... or when its KV cache usage (telemetry `kv_usage`) reaches this fraction.
    saturation_kv_usage: float = Field(default=0.95, gt=0, le=1.0)
    #: Requests queued at once (all bands and tenants); a full queue sheds the newest of a lower band, else
    #: refuses the newcomer (429 with `Retry-After`).
    queue_max_requests: int = Field(default=1024, ge=1)
    #: Requests one tenant may have queued at once (one tenant cannot fill the queue).
    queue_max_per_tenant: int = Field(default=256, ge=1)
    #: A request queued longer than this is answered 429: better a clear refusal than a client timeout.
    queue_max_wait_s: float = Field(default=30.0, gt=0)
    #: `Retry-After` (seconds) on every 429 the queue answers.
    retry_after_s: int = Field(default=1, ge=0)
    #: The band of a request without `x-switchyard-priority` (`low`, `normal` or `high`).
    default_priority: Literal["low", "normal", "high"] = "normal"
    #: Fairness counts each tenant's service in weighted tokens: prompt + this x expected output (a generated token
    #: costs a decode step; a prompt token a share of one prefill) ...
    output_token_weight: float = Field(default=2.0, ge=0)
    #: ... the expected output being `max_tokens` (or `max_completion_tokens`), else this.
    default_output_tokens: int = Field(default=256, ge=1)
    #: What a tenant's attained service counts (solver/fairness.py): `tokens` (weighted tokens), or `expert-load`
    #: (weighted tokens x the share of routed experts the request touches, from its prefill signature; charged at
    #: the tenant's recent mean when the request leaves the queue, corrected when its signature arrives; a request
    #: whose footprint is unknown counts its weighted tokens, so without signatures it is `tokens`).
    fairness: Literal["tokens", "expert-load"] = "expert-load"
    #: Tenants whose attained service is remembered (least recently seen idle ones are forgotten first): bounded
    #: memory whatever tenant ids clients send.
    max_tenants: int = Field(default=10_000, ge=1)

    # --- session affinity (issue 42; services/gateway/sessions.py) ---
    #: In process: a request naming a session (`x-switchyard-session`, `x-session-id`, `x-session-affinity`,
    #: `session-id`) goes to the engine of the session's last request while that engine is below saturation
    #: (`saturation_concurrency`), else where the core chooses ("sticky until saturated"); replicas learn each
    #: other's sessions from their shared decisions (docs/gateway.md).
    session_affinity: bool = True
    #: Sessions remembered (least recently used out first) ...
    max_sessions: int = Field(default=100_000, ge=1)
    #: ... and for how long after their last request.
    session_ttl_s: float = Field(default=600.0, gt=0)

    # --- client limits (services/http_limits.py) ---
    #: A larger request body is refused with 413 (a declared one without being read). Prompts can be long:
    #: 128k tokens of text is ~0.5 MiB of JSON, a chat with inline base64 images several MiB.
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    #: The whole request body must arrive within this many seconds of the request's start, else 408: a client
    #: sending one byte at a time cannot hold a connection (and its buffer) open for ever.
    body_timeout_s: float = Field(default=30.0, gt=0)
    #: A connection must send its request headers within this many seconds of opening (and each later request on
    #: it within this many seconds of its first byte), else it is closed: slowloris sockets cannot pile up.
    header_timeout_s: float = Field(default=10.0, gt=0)
    #: Open client connections at once (idle keep-alive ones included); one more is answered 503 and closed at
    #: once. Keep it below the process's open-file limit (`ulimit -n`), which also has the upstream pool's.
    max_client_connections: int = Field(default=2048, ge=1)

    # --- upstream connection pool ---
    #: Connections to engines open at once, all engines together (`engine_http`): a request waits for one to free
    #: up past it. Idle ones are kept per engine and dropped after 4 s, below vLLM's 5 s keep-alive.
    max_connections: int = Field(default=1024, ge=1)

    #: Identifies this gateway on the bus (announce requests, connection name, the subject of its decisions and,
    #: with per-role credentials, its user `gateway-<id>` when the file has one; see `switchyard nats-config`).
    gateway_id: str = Field(default_factory=lambda: "gateway-" + uuid.uuid4().hex[:8])
