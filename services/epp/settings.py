"""Endpoint-picker settings (`SWITCHYARD_EPP_*`): where the ext_proc gRPC server listens, what it answers.

Routing itself is the router's core, configured as everywhere else by `SWITCHYARD_ROUTER_*` (profiles, weights,
prefix index); liveness by `SWITCHYARD_LIVENESS_*`. The body limits are the gateway's own defaults, so a request
the gateway would refuse the picker refuses too.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from switchyard.services.gateway.settings import GatewaySettings

_GATEWAY = GatewaySettings.model_fields
#: The flow-control settings the picker shares with the gateway (`Flow` reads them from `gateway()`).
FLOW_FIELDS = (
    "admission",
    "saturation_concurrency",
    "saturation_kv_usage",
    "queue_max_requests",
    "queue_max_per_tenant",
    "queue_max_wait_s",
    "retry_after_s",
    "default_priority",
)


class EppSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_EPP_", env_file=".env", extra="ignore")

    #: The ext_proc gRPC listener (and its gRPC health service). 9002 is the port GIE's pickers use.
    host: str = "127.0.0.1"
    port: int = Field(default=9002, ge=0, le=65535)
    #: The picker's HTTP port on `host`: Prometheus `/metrics`, and `POST /v1/select` (AIBrix's external routing
    #: request, for proxies that are not Envoy: docs/epp.md); 0: none.
    metrics_port: int = Field(default=9090, ge=0, le=65535)
    #: TLS on the gRPC port: a PEM certificate chain and its private key (both, or neither: plaintext).
    tls_cert: Path | None = None
    tls_key: Path | None = None

    #: Endpoints sent after the chosen one, in order (least outstanding first): a proxy whose retry policy walks
    #: the list (Envoy's override_host load-balancing policy) tries them when the first cannot be reached. An
    #: `ORIGINAL_DST` cluster reads one address only: set 0 for it (infra/envoy/README.md).
    fallbacks: int = Field(default=2, ge=0, le=16)
    #: Shed load: answer 429 when every candidate engine already has this many requests outstanding (running,
    #: waiting, and decided by any replica since its last report: the router core's count). 0: never shed.
    shed_load: int = Field(default=0, ge=0)

    # --- flow control under saturation: the gateway's (services/gateway/flow.py), with its header names ---
    #: While every candidate engine is saturated, hold requests in the picker, let them out by priority band
    #: (`x-switchyard-priority`) and fairly across tenants (`x-switchyard-tenant`, else the body's `user`), and shed
    #: past the bounds below with 429 and `Retry-After` (an ImmediateResponse). Off: only `shed_load` applies.
    admission: bool = True
    #: As the gateway's `saturation_concurrency`: requests outstanding at which an engine is saturated (0: its
    #: hello's `capacity.max_running`) ...
    saturation_concurrency: int = Field(default=_GATEWAY["saturation_concurrency"].default, ge=0)
    #: ... or its KV cache usage at which it is.
    saturation_kv_usage: float = Field(default=_GATEWAY["saturation_kv_usage"].default, gt=0, le=1.0)
    #: As the gateway's: requests queued at once, per tenant, and the longest one waits before its 429 ...
    queue_max_requests: int = Field(default=_GATEWAY["queue_max_requests"].default, ge=1)
    queue_max_per_tenant: int = Field(default=_GATEWAY["queue_max_per_tenant"].default, ge=1)
    queue_max_wait_s: float = Field(default=_GATEWAY["queue_max_wait_s"].default, gt=0)
    #: ... the `Retry-After` (seconds) of every 429 the queue answers, and the band of a request naming none.
    retry_after_s: int = Field(default=_GATEWAY["retry_after_s"].default, ge=0)
    default_priority: Literal["low", "normal", "high"] = _GATEWAY["default_priority"].default

    #: The request body limit (the gateway's): a larger body is refused with 413. The JSON depth limit is the
    #: gateway parser's own (`shared/json_depth.py`).
    max_body_bytes: int = Field(default=_GATEWAY["max_body_bytes"].default, ge=1024)
    #: Name each prompt's prefix-cache blocks for the core's prefix scorers, with the gateway's tokenizer path.
    prefix_keys: bool = True
    #: Tokenizers per served model, "model=path,model2=path2" (as `SWITCHYARD_GATEWAY_TOKENIZERS`).
    tokenizers: str = ""
    #: How often the routing artifact's key is read (one message; the picker creates no consumer).
    artifact_poll_s: float = Field(default=1.0, gt=0)

    #: An engine whose answers show this many connection failures in a row leaves rotation ...
    eject_after_failures: int = Field(default=2, ge=1)
    #: ... until its own `GET /health` answers 2xx; ejected engines are checked this often.
    health_check_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=1.0, gt=0)

    #: ext_proc streams served at once (one per HTTP request in flight); more wait in gRPC's queue.
    max_streams: int = Field(default=4096, ge=1)
    #: Identifies this picker on the bus: its connection name, the subject of its decisions
    #: (`sy.route.decided.gateway.<id>`) and, with per-role credentials, its user `epp-<id>`.
    epp_id: str = Field(default_factory=lambda: "epp-" + uuid.uuid4().hex[:8])

    @model_validator(mode="after")
    def _tls_pair(self) -> EppSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("SWITCHYARD_EPP_TLS_CERT and SWITCHYARD_EPP_TLS_KEY go together: set both or neither")
        return self

    def gateway(self) -> GatewaySettings:
        """The gateway settings the shared pieces read (tokenizer path, registry, health checks): the gateway's
        defaults, with what the picker sets itself."""
        return GatewaySettings.model_construct(
            prefix_keys=self.prefix_keys,
            tokenizers=self.tokenizers,
            max_body_bytes=self.max_body_bytes,
            eject_after_failures=self.eject_after_failures,
            health_check_interval_s=self.health_check_interval_s,
            health_timeout_s=self.health_timeout_s,
            gateway_id=self.epp_id,
            **{name: getattr(self, name) for name in FLOW_FIELDS},
        )
