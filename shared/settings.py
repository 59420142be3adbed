"""Settings shared by every Switchyard process, read from `SWITCHYARD_*` environment variables.

Service-specific knobs live in each service's own settings class (same prefix, e.g. `SWITCHYARD_ROUTER_*`),
so one service's configuration never needs another's. Values can also come from a `.env` file in the
working directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from switchyard.data import trace_path
from switchyard.shared.subjects import Subjects, check_token


class SwitchyardSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_", env_file=".env", extra="ignore")

    #: NATS servers; a comma-separated list in the environment. Empty means "start an embedded server"
    #: for `switchyard up`, and is an error for a service started on its own.
    nats_servers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    nats_user: str | None = None
    nats_password: str | None = None
    nats_token: str | None = None
    nats_nkey_seed_file: Path | None = None
    nats_creds_file: Path | None = None
    #: Per-role NATS users (`switchyard nats-config` writes this JSON file): each component connects as its
    #: role (router, placement, migration, fit, api, readonly, fleet, loadgen, admin, engine-<id>).
    #: Overrides nats_user/nats_password for a component whose role is in the file.
    nats_credentials: Path | None = None
    nats_tls_ca: Path | None = None
    nats_tls_cert: Path | None = None
    nats_tls_key: Path | None = None
    nats_connect_timeout_s: float = Field(default=5.0, gt=0)
    #: Give up on the first connection after this long (reconnects after a successful one never give up).
    nats_initial_connect_s: float = Field(default=30.0, gt=0)
    subject_prefix: str = "sy"

    #: SQLAlchemy URL. `postgresql://...` and `sqlite:///path` are accepted as-is and given async drivers.
    #: Empty means a SQLite file under `data_dir`.
    database_url: str | None = None
    #: Where embedded servers keep their state: NATS JetStream store, SQLite file, artifacts, reports.
    data_dir: Path = Path(".switchyard")
    #: A folder of the user's own traces laid out like the shipped `switchyard.data` (routing/, requests/,
    #: expert_load/); the CLI defaults take a file from it where it has one, else the shipped copy.
    trace_dir: Path | None = None
    #: JSON `{engine_id: {"ep_group": ..., "dp_rank": ...}}` (`switchyard nats-config --engines id:group:rank`):
    #: when set, placement, migration and the API believe a hello only from a listed engine for its listed group
    #: and rank (bus permissions prove who an engine is, not which group it belongs to).
    engine_manifest: Path | None = None
    #: A secret shared by the fit job (signs routing artifacts) and the routers (refuse unsigned or wrongly
    #: signed ones). Unset: artifacts are neither signed nor checked beyond their content hash.
    artifact_key_file: Path | None = None
    #: Largest bus payload accepted by decoders (and configured on the embedded server).
    max_payload_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    #: An engine answers the first announce at once, then at most one hello per this many seconds (announces
    #: in between get one trailing hello): an announce flood costs each engine ~1 hello/s, not one per announce.
    #: A service that waits for hellos after announcing should wait longer than this.
    announce_min_interval_s: float = Field(default=1.0, gt=0, le=60)
    log_level: str = "INFO"

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

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.subject_prefix)

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "switchyard.sqlite"

    def engine_bindings(self) -> dict[str, tuple[str, int]] | None:
        """The engine manifest as engine id -> (ep_group, dp_rank), or None when there is none."""
        if self.engine_manifest is None:
            return None
        import json

        try:
            raw = json.loads(self.engine_manifest.read_text())
            return {e: (str(v["ep_group"]), int(v.get("dp_rank", 0))) for e, v in raw.items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"SWITCHYARD_ENGINE_MANIFEST {self.engine_manifest}: {exc}") from exc

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
