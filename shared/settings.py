"""Settings shared by every Switchyard process, read from `SWITCHYARD_*` environment variables.

Service-specific knobs live in each service's own settings class (same prefix, e.g. `SWITCHYARD_ROUTER_*`),
so one service's configuration never needs another's. Values can also come from a `.env` file in the
working directory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from switchyard.data import trace_path
from switchyard.shared.engine_manifest import EngineManifest
from switchyard.shared.subjects import Subjects, check_token

log = logging.getLogger(__name__)


class SwitchyardSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_", env_file=".env", extra="ignore")

    #: NATS servers; a comma-separated list in the environment. Empty means "start an embedded server"
    #: for `switchyard up`, and is an error for a service started on its own.
    nats_servers: Annotated[list[str], NoDecode] = Field(default_factory=list)

    #: One NATS identity for every component (user and password, a token, an nkey seed file or a JWT `.creds`
    #: file), for a bus without per-role users; `nats_credentials` below gives each role its own.
    nats_user: str | None = None
    nats_password: str | None = None
    nats_token: str | None = None
    nats_nkey_seed_file: Path | None = None
    nats_creds_file: Path | None = None
    #: Per-role NATS users (`switchyard nats-config` writes this JSON file): each component connects as its
    #: role (router, placement, migration, fit, api, readonly, fleet, loadgen, admin, engine-<id>).
    #: Overrides nats_user/nats_password for a component whose role is in the file.
    nats_credentials: Path | None = None

    #: TLS to the NATS servers: the CA that signed them, and a client certificate and key where they ask for one.
    nats_tls_ca: Path | None = None
    nats_tls_cert: Path | None = None
    nats_tls_key: Path | None = None
    #: Seconds one connection attempt may take.
    nats_connect_timeout_s: float = Field(default=5.0, gt=0)
    #: Give up on the first connection after this long (reconnects after a successful one never give up).
    nats_initial_connect_s: float = Field(default=30.0, gt=0)
    #: The first token of every subject (`sy.engine.<id>.hello`, ...): deployments sharing one NATS account keep
    #: apart by it.
    subject_prefix: str = "sy"

    #: SQLAlchemy URL. `postgresql://...` and `sqlite:///path` are accepted as-is and given async drivers.
    #: Empty means a SQLite file under `data_dir`.
    database_url: str | None = None
    #: Where embedded servers keep their state: NATS JetStream store, SQLite file, artifacts, reports.
    data_dir: Path = Path(".switchyard")
    #: A folder of the user's own traces laid out like the shipped `switchyard.data` (routing/, requests/,
    #: expert_load/); the CLI defaults take a file from it where it has one, else the shipped copy.
    trace_dir: Path | None = None
    #: JSON `{engine_id: {"role", "model", "base_url", "ep_group", "dp_rank"}}` (each field optional;
    #: `switchyard nats-config --engines`): when set, the gateway, the router, placement, migration and the API
    #: believe a hello only from a listed engine and only for what its entry lists (bus permissions prove who
    #: an engine is, not what it serves or where).
    engine_manifest: Path | None = None
    #: Refuse every engine no manifest lists, also when there is no manifest (then every engine is refused: route
    #: nothing rather than prompts to whoever holds an engine password). Unset: on exactly when per-role NATS
    #: credentials are in use (`SWITCHYARD_NATS_CREDENTIALS`, the production shape of `nats-config`); `false` is
    #: the operator's explicit opt-out. `switchyard up` lists the engines it starts itself.
    engine_strict: bool | None = None
    #: A secret shared by the fit job (signs routing artifacts) and the routers (refuse unsigned or wrongly
    #: signed ones). Unset: artifacts are neither signed nor checked beyond their content hash.
    artifact_key_file: Path | None = None
    #: Largest bus payload accepted by decoders (and configured on the embedded server).
    max_payload_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    #: An engine answers the first announce at once, then at most one hello per this many seconds (announces
    #: in between get one trailing hello): an announce flood costs each engine ~1 hello/s, not one per announce.
    #: A service that waits for hellos after announcing should wait longer than this.
    announce_min_interval_s: float = Field(default=1.0, gt=0, le=60)
    #: Python logging level of every component (DEBUG also shows the schema upgrades Alembic runs).
    log_level: str = "INFO"

    #: Copies JetStream keeps of every stream and KV bucket (its `num_replicas`): 1 on a single server (the
    #: embedded one), 3 on a 3-node cluster, so that losing one node loses nothing and stops nothing. A value
    #: above 1 needs a clustered server; an existing stream with another count is updated to this one.
    stream_replicas: int = Field(default=1, ge=1, le=5)

    # ----- JetStream bounds (`shared.stream_limits`): sizes from the contract; 0 = none for an age -----
    #: Largest expert-load window stored: the schema's largest window (2^18 layer x expert cells) at uint32 is
    #: 1 MiB, DeepSeek-V3 (58 x 256) with per-source counts for 16 EP ranks 0.97 MiB; a quarter on top.
    stream_expert_load_window_bytes: int = Field(default=1280 * 1024, ge=1024)
    #: Windows kept per engine (per subject): placement replays 1800 s (its warmup) at the vLLM agent's 1 s
    #: interval. With the window size, one engine's share is at most 2.2 GiB, however fast it publishes.
    stream_expert_load_windows_per_engine: int = Field(default=1800, ge=1)
    #: The stream's bound: 4.5 engines at their cap, or with one at its cap, the 60 KB windows of 78 DeepSeek-V3
    #: engines (no per-source counts) besides. Full, it drops its oldest windows (the lightest in placement's
    #: decayed window).
    stream_expert_load_max_bytes: int = Field(default=10 * 1024**3, ge=1024)
    stream_expert_load_max_msgs: int = Field(default=1_000_000, ge=1)
    #: Twice placement's warmup (`SWITCHYARD_PLACEMENT_WARMUP_S`, 1800 s): nothing reads older windows.
    stream_expert_load_max_age_s: float = Field(default=3600.0, ge=0)
    #: Plans and calibration requests, written only by placement and the API: a DeepSeek-V3 plan (a [58, 32, 8]
    #: int32 layout, up to 2000 moves) is 60-110 KB, so 2 GiB is 20,000-35,000 plans. Placement publishes at most
    #: one plan per group per `SWITCHYARD_PLACEMENT_INFLIGHT_TIMEOUT_S` (600 s) while the last is unconsumed: a
    #: full stream means a migration service down for a week with 20 groups, and then the oldest plans go first.
    stream_placement_max_bytes: int = Field(default=2 * 1024**3, ge=1024)
    stream_placement_max_msgs: int = Field(default=100_000, ge=1)
    #: No age limit: a plan is work, and the migration service must find one it has not consumed yet.
    stream_placement_max_age_s: float = Field(default=0.0, ge=0)
    #: Largest routing sample stored: two [L, E] count arrays (DeepSeek-V3 at uint32: 119 KB), up to 2^17
    #: cells each, plus a quarter.
    stream_routing_samples_sample_bytes: int = Field(default=1280 * 1024, ge=1024)
    #: ~35,000 DeepSeek-V3 samples: more than `switchyard fit --from-stream` reads (the newest 20,000).
    stream_routing_samples_max_bytes: int = Field(default=4 * 1024**3, ge=1024)
    stream_routing_samples_max_msgs: int = Field(default=50_000, ge=1)
    stream_routing_samples_max_age_s: float = Field(default=7 * 86400.0, ge=0)
    #: The routing artifact bucket: its 16 revisions at the largest payload (128 MiB), twice over.
    kv_router_max_bytes: int = Field(default=256 * 1024**2, ge=1024)
    #: The lease bucket: one ~100-byte key per service and group, and their delete markers.
    kv_leases_max_bytes: int = Field(default=64 * 1024**2, ge=1024)

    @field_validator("nats_servers", mode="before")
    @classmethod
    def _split_servers(cls, value: object) -> object:
        if isinstance(value, str):
            return [s.strip() for s in value.split(",") if s.strip()]
        return value

    @field_validator("nats_servers")
    @classmethod
    def _check_servers(cls, value: list[str]) -> list[str]:
        for url in value:
            if "://" not in url:
                raise ValueError(f"NATS server {url!r} needs a scheme, e.g. nats://127.0.0.1:4222")
        return value

    @field_validator("subject_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        return check_token(value, "subject prefix")

    @model_validator(mode="after")
    def _check_credentials(self) -> SwitchyardSettings:
        if (self.nats_user is None) != (self.nats_password is None):
            raise ValueError("SWITCHYARD_NATS_USER and SWITCHYARD_NATS_PASSWORD must be given together")
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise ValueError("SWITCHYARD_NATS_TLS_CERT and SWITCHYARD_NATS_TLS_KEY must be given together")
        methods = [self.nats_user, self.nats_token, self.nats_nkey_seed_file, self.nats_creds_file]
        if sum(m is not None for m in methods) > 1:
            raise ValueError("choose one NATS authentication: user/password, token, nkey seed or creds file")
        return self

    @model_validator(mode="after")
    def _one_engine_fits(self) -> SwitchyardSettings:
        share = self.stream_expert_load_windows_per_engine * self.stream_expert_load_window_bytes
        if share * 2 > self.stream_expert_load_max_bytes:
            raise ValueError(
                f"one engine's expert-load share (SWITCHYARD_STREAM_EXPERT_LOAD_WINDOWS_PER_ENGINE x _WINDOW_BYTES "
                f"= {share} bytes) must be at most half of SWITCHYARD_STREAM_EXPERT_LOAD_MAX_BYTES "
                f"({self.stream_expert_load_max_bytes}): an engine at its cap would push the others' windows out"
            )
        return self

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.subject_prefix)

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "switchyard.sqlite"

    @property
    def strict_engines(self) -> bool:
        """Whether an engine no manifest lists is refused (`engine_strict`, else per-role credentials in use)."""
        return self.engine_strict if self.engine_strict is not None else self.nats_credentials is not None

    def engine_manifest_entries(self) -> EngineManifest | None:
        """The engine manifest (`shared.engine_manifest`); in strict mode without one, an empty manifest (every
        engine unlisted, so refused: one warning here, one line per refused engine); else None."""
        if self.engine_manifest is not None:
            return EngineManifest.load(self.engine_manifest)
        if not self.strict_engines:
            return None
        log.warning(
            "no engine manifest and SWITCHYARD_ENGINE_STRICT is on (per-role NATS credentials): every engine's hello "
            "is refused; set SWITCHYARD_ENGINE_MANIFEST (switchyard nats-config --engines writes one), or "
            "SWITCHYARD_ENGINE_STRICT=false to take any engine whose credentials the bus accepts"
        )
        return EngineManifest({})

    def artifact_key(self) -> bytes | None:
        """The artifact signing key (the key file's bytes, surrounding whitespace removed), or None."""
        if self.artifact_key_file is None:
            return None
        key = self.artifact_key_file.read_bytes().strip()
        if len(key) < 16:
            raise ValueError(f"SWITCHYARD_ARTIFACT_KEY_FILE {self.artifact_key_file}: a key needs >= 16 bytes")
        return key

    def trace(self, relative: str) -> Path:
        """A shipped trace (`switchyard.data` names), or the user's copy under `trace_dir` when it has one."""
        return trace_path(relative, self.trace_dir)

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.sqlite_path.resolve()}"
