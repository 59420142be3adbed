"""Router settings (`SWITCHYARD_ROUTER_*`).

Routing is chosen and weighted here, without code: a named decode profile and DP profile
(`solver.routing.profiles`), each re-weightable by scorer name from a JSON object, and Gimbal's parameters.
The experiment-only ELDR variants (`eldr-vanilla`, `eldr-tau0`) are simulator options and are refused.
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from switchyard.services.router.affinity import AffinityLimits
from switchyard.services.router.kv_trust import DEFAULT_BURST_KEYS, DEFAULT_KEYS_PER_S, Claims
from switchyard.solver.routing import profiles
from switchyard.solver.routing.defaults import DEFAULT_INFLIGHT_GRACE_S
from switchyard.solver.routing.dispatch import GimbalParams
from switchyard.solver.routing.framework import Profile
from switchyard.solver.routing.prefix import DEFAULT_WEIGHTS, TierWeights
from switchyard.solver.routing.prefix.blocks import DEFAULT_MAX_BLOCKS

#: Which prefix index the router matches a request's block keys against (`services.router.prefix`): `precise`
#: (the engines' KV events), `approximate` (this replica's own decisions) or `off`. One constant, so the
#: default can follow the measurements (docs/prefix-routing.md).
PrefixIndexMode = Literal["precise", "approximate", "off"]
DEFAULT_PREFIX_INDEX: PrefixIndexMode = "precise"

#: Every DP profile name (`solver.routing.profiles.DP_PROFILES`), checked when the settings load.
DpProfileName = Literal[profiles.DP_PROFILES]  # type: ignore[valid-type]
_G = GimbalParams()  # the defaults' one owner is GimbalParams


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SWITCHYARD_ROUTER_", env_file=".env", extra="ignore", populate_by_name=True
    )

    #: Decode profile for `sy.route.decode`: eldr, jsq, p2c, rr, random, domain (`solver.routing.profiles`).
    policy: str = "eldr"
    #: The same, by its newer name; when set it wins over `policy`.
    decode_profile: str | None = None
    #: Scorer name -> weight for the decode profile (JSON object), e.g. {"load": 1.0}; 0 removes a scorer.
    decode_weights: dict[str, float] = Field(default_factory=dict)
    #: DP profile for `sy.route.dp`: `switchyard` (Gimbal's pressure rule, Algorithm 1, plus the request's
    #: uncached prompt on each engine; without block keys it decides as `gimbal`); `gimbal`; the peers' llm-d,
    #: dynamo, sglang-cache; vLLM's own DP load balancer (4·waiting + running, this replica's decisions counted
    #: as waiting until telemetry); vllm-main; jsq; rr.
    dp_rule: DpProfileName = "switchyard"
    #: The same, by its newer name; when set it wins over `dp_rule`.
    dp_profile: DpProfileName | None = None
    #: Scorer name -> weight for the DP profile (JSON object), e.g. {"kv_penalty": 2.0}.
    dp_weights: dict[str, float] = Field(default_factory=dict)
    #: Weight of the `gimbal-affinity` profile's expert-affinity term (prefill tokens of pressure one prompt's worth
    #: of affinity is worth; unset: the profile's 64, docs/expert-affinity.md; 0: pressure alone). Wins over an
    #: `expert_affinity` entry in `dp_weights`; refused for a profile without the term.
    affinity_weight: float | None = Field(default=None, ge=0)
    #: Expert affinity's signature cache: prefix block keys held at most, and the bytes of the signatures they point
    #: at (one signature per request, 8 bytes per expert and layer).
    affinity_cache_keys: int = Field(default=4096, ge=1)
    affinity_cache_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    #: Half-life of each engine's recent expert traffic (the signatures of the requests this replica sent it).
    affinity_half_life_s: float = Field(default=10.0, gt=0)
    #: Requests routed by this replica whose engine's signature is still awaited, at most, and for how long; an
    #: engine's signature is believed only for a request sent to it, once.
    affinity_pending: int = Field(default=16384, ge=1)
    affinity_pending_ttl_s: float = Field(default=120.0, gt=0)
    #: Layers × experts of one signature at most (DeepSeek-V3: 58 × 256 = 14,848); a larger one is refused.
    affinity_max_features: int = Field(default=65536, ge=1)
    #: Gimbal: KV usage above which the KV-first rule may trigger...
    gimbal_kv_high: float = Field(default=_G.kv_high, gt=0, le=1)
    #: ...when the max-min KV usage gap across live engines exceeds this.
    gimbal_kv_spread: float = Field(default=_G.kv_spread, ge=0, le=1)
    #: Gimbal: token-equivalent cost of a half-full KV cache (c_kv).
    gimbal_kv_cost_tokens: float = Field(default=_G.kv_cost_tokens, ge=0)
    #: Gimbal: lower bound on free KV in P_kv's denominator.
    gimbal_kv_floor: float = Field(default=_G.kv_floor, gt=0, le=1)
    #: Gimbal: token-equivalent cost per unit of expert imbalance above 1 (c_moe).
    gimbal_moe_cost_tokens: float = Field(default=_G.moe_cost_tokens, ge=0)
    #: Fresh load data: an engine not heard from (hello or telemetry) for longer than this is not routed to by
    #: load, though it stays live (telemetry arrives every ~100 ms). Liveness itself is `SWITCHYARD_LIVENESS_*`.
    #: The older name `SWITCHYARD_ROUTER_STALE_AFTER_S` is still read.
    fresh_load_s: float = Field(
        default=1.0,
        gt=0,
        validation_alias=AliasChoices("SWITCHYARD_ROUTER_FRESH_LOAD_S", "SWITCHYARD_ROUTER_STALE_AFTER_S"),
    )
    #: An engine silent for this long is forgotten entirely (a new hello brings it back).
    forget_after_s: float = Field(default=300.0, gt=0)
    #: Engines the router keeps at most (ids are the senders' word): a new one beyond this is refused while
    #: every known engine is live, and forgets the stale ones otherwise.
    max_engines: int = Field(default=4096, ge=1)
    #: Decisions counted in flight per engine at most, until its telemetry settles them (the oldest beyond it
    #: is dropped): an engine that says hello but never reports cannot hold every request routed to it.
    max_inflight_per_engine: int = Field(default=1024, ge=1)
    #: A decision stops counting as in flight once a telemetry received this long after it arrives.
    inflight_grace_s: float = Field(default=DEFAULT_INFLIGHT_GRACE_S, ge=0)
    #: Other replicas' shared decisions are believed only up to what an honest replica could decide (issue 37,
    #: `services/router/decision_bounds.py`). Bytes per second per sender, checked before decoding: 2 MiB/s is
    #: ~25,000 decisions/s of ~80 bytes, five times what one gateway process serves.
    peer_decision_bytes_per_s: float = Field(default=2 * 1024 * 1024, gt=0)
    #: Per (sender, engine): decisions per second, and decisions counted at once (until the engine's telemetry
    #: settles them, ~0.1 s + inflight_grace_s). 1000/s and 256 (vLLM's default max_num_seqs, 1/4 s of 1000/s)
    #: are far above what one replica sends one engine (tens to hundreds of requests a second).
    peer_decisions_per_s: float = Field(default=1000.0, gt=0)
    peer_inflight_per_engine: int = Field(default=256, ge=1)
    #: Prompt tokens one shared decision counts at most (also at most the engine's kv_blocks × block_size).
    peer_max_prompt_tokens: int = Field(default=1_048_576, ge=1)
    #: A request in the exact ledger (routed with `progress`) with no first token after this long, or no end
    #: after `progress_decode_ttl_s`, is dropped (counted): its gateway died or never reports. An honest gateway
    #: reports an end when an engine's first byte is late (SWITCHYARD_GATEWAY_FIRST_BYTE_TIMEOUT_S, 120 s).
    progress_ttl_s: float = Field(default=300.0, gt=0)
    progress_decode_ttl_s: float = Field(default=3600.0, gt=0)
    #: Label -> traffic share, required by the oracle `domain` policy (a JSON object in the environment).
    domain_shares: dict[str, float] = Field(default_factory=dict)
    #: Decisions are shared with the other replicas (`sy.route.decided`) at the end of a burst of requests, in
    #: the replies' socket write, at most one message per this interval; none waits more than twice it
    #: (0: at the end of every burst).
    share_interval_s: float = Field(default=0.002, ge=0, le=0.1)
    #: The prefix index DP profiles reading `cached_tokens` see: precise, approximate or off (see above). Keys of
    #: kind "text" (no tokenizer at the gateway) are matched approximately whatever this says.
    prefix_index: PrefixIndexMode = DEFAULT_PREFIX_INDEX
    #: The precise index holds at most this many blocks per engine (oldest out first): one engine's events
    #: cannot grow it past its own share.
    prefix_max_blocks: int = Field(default=DEFAULT_MAX_BLOCKS, ge=1)
    #: The approximate index: blocks per engine at most, and how long a routed block counts as cached.
    prefix_routed_max_blocks: int = Field(default=200_000, ge=1)
    prefix_routed_ttl_s: float = Field(default=600.0, gt=0)
    #: The precise index's credit for a matched block by the cache tier holding it (KV events' `tier`; vLLM's
    #: `medium`): in the engine's KV cache (gpu), in its CPU offload tier (cpu: a copy back instead of
    #: recompute), in a storage tier (disk). A block in several tiers counts once, at its best; a tier of weight 0
    #: counts as not held (gpu 1, cpu 0, disk 0: the GPU-only match). Defaults: Dynamo's (docs/prefix-routing.md).
    prefix_tier_gpu: float = Field(default=DEFAULT_WEIGHTS.gpu, ge=0, le=1)
    prefix_tier_cpu: float = Field(default=DEFAULT_WEIGHTS.cpu, ge=0, le=1)
    prefix_tier_disk: float = Field(default=DEFAULT_WEIGHTS.disk, ge=0, le=1)
    #: Per engine, KV-event keys per second at most (a message costs 1 + its keys), and the bucket's depth: a
    #: message past it is dropped and the engine's blocks cleared (`services.router.kv_trust`). An honest
    #: engine stays under ~10K keys/s (docs/prefix-routing.md, "Trust in KV events").
    kv_rate_keys_per_s: float = Field(default=DEFAULT_KEYS_PER_S, gt=0)
    kv_rate_burst_keys: float = Field(default=DEFAULT_BURST_KEYS, ge=1)
    #: Where the answers are seen (the in-process gateway): credit a KV claim only once an answer's
    #: `usage.prompt_tokens_details.cached_tokens` confirms it (vLLM: `--enable-prompt-tokens-details`). Off:
    #: claims are believed as sent.
    prefix_confirm: bool = True
    #: Requests riding on one engine's unconfirmed claims at a time, at most.
    prefix_confirm_probes: int = Field(default=2, ge=1)
    #: A claim is contradicted when the answer reports fewer than this share of the cached tokens it promised.
    prefix_confirm_ratio: float = Field(default=0.5, gt=0, le=1)
    #: Contradictions within `prefix_quarantine_s` that clear an engine's blocks and ignore its KV events for
    #: `prefix_quarantine_s`.
    prefix_confirm_strikes: int = Field(default=3, ge=1)
    prefix_quarantine_s: float = Field(default=60.0, gt=0)
    #: Whether decoders the routing artifact does not name (added after the fit) serve every ELDR band. Off by
    #: default: they take a request only when its band has no live engine, so a phantom decoder announced on
    #: the bus cannot draw the traffic (finding 1 of issue 15). Turn on to give new capacity traffic at once.
    unnamed_decoders_in_bands: bool = False
    #: Identifies this replica on `sy.route.decided`.
    replica_id: str = Field(default_factory=lambda: "router-" + uuid.uuid4().hex[:8])
    #: Seed of the replica's random choices (random, p2c, tie-breaks).
    seed: int = 0
    #: Serve Prometheus metrics on this port (unset: don't; 0: any free port).
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"

    @field_validator("policy", "decode_profile")
    @classmethod
    def _known_policy(cls, value: str | None) -> str | None:
        if value is not None:
            profiles.decode_profile(value)  # unknown names and the simulator's experiment variants: a clear ValueError
        return value

    @model_validator(mode="after")
    def _resolve(self) -> RouterSettings:
        if self.decode_profile is not None:
            self.policy = self.decode_profile
        if self.dp_profile is not None:
            self.dp_rule = self.dp_profile
        if self.policy == "domain" and not self.domain_shares:
            raise ValueError("the domain policy needs SWITCHYARD_ROUTER_DOMAIN_SHARES (JSON label -> share)")
        self.build_decode_profile()  # weights naming no scorer of the profile are refused here, not at first use
        self.build_dp_profile()
        return self

    def claims(self) -> Claims:
        """The confirmation of KV claims these settings configure."""
        return Claims(
            self.prefix_confirm_probes, self.prefix_confirm_ratio, self.prefix_confirm_strikes, self.prefix_quarantine_s
        )

    def gimbal_params(self) -> GimbalParams:
        return GimbalParams(
            kv_high=self.gimbal_kv_high,
            kv_spread=self.gimbal_kv_spread,
            kv_cost_tokens=self.gimbal_kv_cost_tokens,
            kv_floor=self.gimbal_kv_floor,
            moe_cost_tokens=self.gimbal_moe_cost_tokens,
        )

    def build_decode_profile(self) -> Profile:
        """The decode profile these settings name, with their weights."""
        return profiles.decode_profile(self.policy, self.decode_weights or None)

    def build_dp_profile(self, params: GimbalParams | None = None) -> Profile:
        """The DP profile these settings name, with their weights and Gimbal parameters."""
        weights = dict(self.dp_weights)
        if self.affinity_weight is not None:
            if "expert_affinity" not in profiles.dp_profile(self.dp_rule).weights:
                raise ValueError(f"affinity_weight is for a DP profile with expert affinity, not {self.dp_rule!r}")
            weights["expert_affinity"] = self.affinity_weight
        return profiles.dp_profile(self.dp_rule, params or self.gimbal_params(), weights or None)

    def tier_weights(self) -> TierWeights:
        """The precise index's credit per cache tier (`solver.routing.prefix.tiers`)."""
        return TierWeights(self.prefix_tier_gpu, self.prefix_tier_cpu, self.prefix_tier_disk)

    def affinity_limits(self) -> AffinityLimits:
        """The expert-affinity bounds these settings set (`services.router.affinity`)."""
        return AffinityLimits(
            cache_keys=self.affinity_cache_keys,
            cache_bytes=self.affinity_cache_bytes,
            half_life_s=self.affinity_half_life_s,
            pending=self.affinity_pending,
            pending_ttl_s=self.affinity_pending_ttl_s,
            max_features=self.affinity_max_features,
        )
