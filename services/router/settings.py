"""Router settings (`SWITCHYARD_ROUTER_*`)."""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from switchyard.solver.routing import DECODE_POLICIES


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_ROUTER_", env_file=".env", extra="ignore")

    #: Decode policy for `sy.route.decode`: random, rr, jsq, p2c, domain, eldr, eldr-vanilla, eldr-tau0.
    policy: str = "eldr"
    #: Data-parallel dispatch rule for `sy.route.dp`: Gimbal's pressure score (Algorithm 1), or vLLM's own DP
    #: load balancer (4·waiting + running, counting this replica's decisions as waiting until telemetry).
    dp_rule: Literal["gimbal", "vllm"] = "gimbal"
    #: An engine silent for longer than this leaves the candidate set (telemetry arrives every ~100 ms).
    stale_after_s: float = Field(default=1.0, gt=0)
    #: An engine silent for this long is forgotten entirely (a new hello brings it back).
    forget_after_s: float = Field(default=300.0, gt=0)
    #: A decision stops counting as in flight once a telemetry received this long after it arrives.
    inflight_grace_s: float = Field(default=0.05, ge=0)
    #: Label -> traffic share, required by the oracle `domain` policy (a JSON object in the environment).
    domain_shares: dict[str, float] = Field(default_factory=dict)
    #: Decisions are shared with the other replicas (`sy.route.decided`) at the end of a burst of requests, in
    #: the replies' socket write, at most one message per this interval; none waits more than twice it
    #: (0: at the end of every burst).
    share_interval_s: float = Field(default=0.002, ge=0, le=0.1)
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

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in DECODE_POLICIES:
            raise ValueError(f"unknown decode policy {value!r}; choose one of {', '.join(DECODE_POLICIES)}")
        return value

    @model_validator(mode="after")
    def _domain_needs_shares(self) -> RouterSettings:
        if self.policy == "domain" and not self.domain_shares:
            raise ValueError("the domain policy needs SWITCHYARD_ROUTER_DOMAIN_SHARES (JSON label -> share)")
        return self
